# The two set-up commands of the README: `make up` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# PyTorch first, pinned, so the project's torch range does not pull something else. On this project's
# machines the pinned release is the CPU build; elsewhere set TORCH_INDEX (e.g. the CPU wheel index
# https://download.pytorch.org/whl/cpu, or a CUDA one) to choose the build.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: up test lint model bench tools device-wheels

# A venv with the project installed.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

model: $(VENV)/.installed
	$(PY) -m backend models pull smollm2

# Agent CLIs the tests drive for real, from the npm registry: Claude Code (`claude mcp add-json`, and `claude -p`
# against the Messages API) and Codex (`codex exec` against the Responses API; its binary ships in the package).
CLAUDE_CODE ?= @anthropic-ai/claude-code@2.1.197
CODEX ?= @openai/codex@0.171.0
.tools/npm/bin/claude:
	npm install -g -q --prefix .tools/npm $(CLAUDE_CODE) >/dev/null
.tools/npm/bin/codex:
	npm install -g -q --prefix .tools/npm $(CODEX) >/dev/null

tools:
	@if command -v npm >/dev/null 2>&1; then $(MAKE) -s .tools/npm/bin/claude .tools/npm/bin/codex; \
	else echo "npm not found: the Claude Code and Codex CLI tests will be skipped"; fi

# The tests keep models and caches under .home (tests/conftest.py's default, as .ci/run sets it): the model they
# read is pulled there too, not into the user's home that `make up` uses.
test: export SCRIPTORIUM_HOME ?= $(CURDIR)/.home
test: $(VENV)/.installed model tools
	$(PY) -m ruff check .
	$(PY) -m pytest -q tests

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(VENV)/.installed model
	$(PY) bench/engine_vs_peers.py

# The stack on the embedded default (backend on this machine with smollm2, MCP over HTTP), then one
# article written through the MCP server as an agent would; prints where article.html is. The stack
# stays up (`.venv/bin/ops down` stops it); running it again leaves healthy services alone.
up: $(VENV)/.installed model
	$(VENV)/bin/ops up
	$(PY) -m mcp_server.try_pipeline

# What the GPU machine lacks (it has no network; its Python is 3.12), for bench/device_check.sh: carry .wheels.
device-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
		--platform manylinux2014_x86_64 -d .wheels gguf xgrammar apache-tvm-ffi pydantic pydantic-core \
		annotated-types typing-inspection jsonschema jsonschema-specifications referencing rpds-py attrs
