# The two entry points of the README. Both set up .venv first (tools/bootstrap.py: only what changed).
PY ?= python3

.PHONY: setup run test
setup:
	$(PY) tools/bootstrap.py

run: setup
	.venv/bin/pi2-gguf run

test:
	$(PY) tools/bootstrap.py --with-import
	.venv/bin/pytest
