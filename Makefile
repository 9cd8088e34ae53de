# Two entry points, each installs everything it needs first:
#   make up    -> run topologies/default.yaml (override: make up TOPOLOGY=topologies/x.yaml)
#   make test  -> the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TOPOLOGY ?= topologies/default.yaml
PYTEST_ARGS ?=

.PHONY: up test lint protos bench clean-venv

$(STAMP): requirements.txt pyproject.toml scripts/install-system-packages.sh
	bash scripts/install-system-packages.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and exact: the CPU build. A bare `torch` requirement could pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements.txt torch==2.13.0
	# checked once numpy is in too (torch warns on import without it)
	$(BIN)/python -c "import torch, sys; sys.exit('torch has CUDA: refusing a GPU build' if torch.version.cuda else 0)"
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

up: $(STAMP)
	$(BIN)/testbed up $(TOPOLOGY)

test: $(STAMP)
	$(BIN)/python -m ruff check testbed tests bench
	$(BIN)/python -m mypy testbed
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/python -m ruff check testbed tests bench

# Regenerate the committed gRPC stubs (a test fails when they are stale).
protos: $(STAMP)
	$(BIN)/python -m testbed.wire.generate

clean-venv:
	rm -rf $(VENV)
