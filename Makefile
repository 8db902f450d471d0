# The two set-up commands of the README: `make up` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: up test lint model bench

# A venv with the project installed. PyTorch goes in first, pinned to the CPU build that
# the package index carries, so that the project's torch range does not pull a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

model: $(VENV)/.installed
	$(PY) -m backend models pull smollm2

test: $(VENV)/.installed model
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(VENV)/.installed model
	$(PY) bench/engine.py

up: $(VENV)/.installed model
	@echo "make up: the stack (ops up + an article pipeline) is coming with the ops issues; for now try:"
	@echo "  $(PY) -m backend generate --model smollm2 'Write a haiku about scribes.'"
	@exit 2
