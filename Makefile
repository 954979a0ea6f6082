# The two entry points of the README. Both set up .venv first (tools/bootstrap.py: only what changed).
PY ?= python3

.PHONY: setup run test tools
setup:
	$(PY) tools/bootstrap.py

run: setup
	.venv/bin/pi2-gguf demo

test:
	$(PY) tools/bootstrap.py --with-import --with-tools
	.venv/bin/mypy
	.venv/bin/pytest

# llama.cpp's own tools (llama-server, llama-cli, llama-completion, llama-bench) in .venv/bin, on the wheel's ggml
tools:
	$(PY) tools/bootstrap.py --with-tools
