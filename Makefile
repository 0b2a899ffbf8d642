# The two entry points: `make up` serves the built-in model, `make test` runs the checks.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test install lint typecheck pytest loop clean lora-demo up-lora

up: $(STAMP)
	$(BIN)/pdserve up

# The LoRA demo: train a pirate-style adapter for the built-in model (~1-3 min on a CPU),
# then serve it beside the base model ("model": "pirate").
LORA_DEMO := lora-demo/pirate
$(LORA_DEMO)/adapter_model.safetensors: $(STAMP) pdserve/builtin/lora_demo.py
	$(BIN)/python -m pdserve.builtin.lora_demo $(LORA_DEMO)

lora-demo: $(LORA_DEMO)/adapter_model.safetensors

up-lora: lora-demo
	$(BIN)/pdserve up --enable-lora --lora-modules pirate=$(LORA_DEMO)

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
	$(BIN)/python -m pytest -q --durations=15

# Flake hunt (not part of `make test`): the process-level suites LOOPS times in a row;
# BUSY=1 keeps every core busy with another process meanwhile.
LOOPS ?= 10
BUSY ?= 0
loop: $(STAMP)
	bash tests/loop.sh $(LOOPS) $(BUSY)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
