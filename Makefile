# Two entry points: `make demo` and `make test`. Each bootstraps .venv by itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvwire-installed

export UCX_NET_DEVICES ?= lo

.PHONY: demo test lint typecheck unit venv clean

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel on disk, never a CUDA download.
	$(BIN)/python -m pip install -q -c constraints-dev.txt torch
	$(BIN)/python -m pip install -q -c constraints-dev.txt -e '.[dev,nixl,ucx]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvwire demo

lint: $(STAMP)
	$(BIN)/ruff check kvwire transports conformance tests
	$(BIN)/ruff format --check kvwire transports conformance tests

typecheck: $(STAMP)
	$(BIN)/mypy --strict kvwire

unit: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck unit

clean:
	rm -rf $(VENV) build dist
