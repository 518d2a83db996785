# The commands of the README. Each installs what it needs first (idempotent).
# CPU machines: torch==2.13.0 is the CPU build; on a GPU machine install your CUDA torch first.
PYTHON ?= python3
TORCH ?= torch==2.13.0
DEEPSPEED ?= deepspeed==0.19.8
PIP = $(PYTHON) -m pip install --disable-pip-version-check --progress-bar on
HAVE_TORCH = $(shell $(PYTHON) -c "import torch" 2>/dev/null && echo y)

.PHONY: install install-demo demo test lint

# What the demo needs and nothing else (no DeepSpeed, no test tools), with pip's progress shown.
install-demo:
	@echo "== installing hf_longctx and its runtime dependencies (torch, transformers, accelerate, datasets)"
	$(PIP) $(if $(HAVE_TORCH),,"$(TORCH)") -e .

# Everything CI needs: the test tools, TRL, and DeepSpeed for the ZeRO tests.
install:
	$(PIP) -q $(if $(HAVE_TORCH),,"$(TORCH)") -e ".[dev]"
	# DeepSpeed ships as source only: build it against the torch above, without its CUDA ops
	$(if $(shell $(PYTHON) -c "import deepspeed" 2>/dev/null && echo y),,DS_BUILD_OPS=0 $(PIP) -q --no-build-isolation "$(DEEPSPEED)")

demo: install-demo
	accelerate launch --config_file recipes/cpu-2proc.yaml scripts/train.py

test: install
	$(PYTHON) -m ruff check hf_longctx tests scripts examples
	$(PYTHON) -m pytest -q --durations=15 tests

lint:
	$(PYTHON) -m ruff check hf_longctx tests scripts examples
