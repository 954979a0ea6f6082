"""Measurements: decode speed against stock llama.cpp (in RAM and under a cgroup memory limit) and perplexity."""

# the prompt every decode benchmark uses
PROMPT = ("Write a Python function that parses a CSV file of sales records and returns the total "
          "revenue per region, then explain how it handles malformed lines.")
