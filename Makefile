# The two entry points: `make up` serves the built-in model, `make test` runs the checks.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test install lint typecheck pytest loop clean

up: $(STAMP)
	$(BIN)/pdserve up

test: $(STAMP) lint typecheck pytest

install: $(STAMP)

# torch is pinned here (and in constraints.txt): an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py constraints.txt kv_transfer/pool/_hostcopy.c \
		$(wildcard pdserve/engine/kernels/*.c pdserve/engine/kernels/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -q

# Flake hunt (not part of `make test`): the process-level suites LOOPS times in a row;
# BUSY=1 keeps every core busy with another process meanwhile.
LOOPS ?= 10
BUSY ?= 0
loop: $(STAMP)
	bash tests/loop.sh $(LOOPS) $(BUSY)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
