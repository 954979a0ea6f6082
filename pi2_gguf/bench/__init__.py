"""Measurements: decode speed against stock llama.cpp (in RAM and under a cgroup memory limit) and perplexity."""
