# The two commands of the README. Each installs what it needs first (idempotent).
# CPU machines: torch==2.13.0 is the CPU build; on a GPU machine install your CUDA torch first.
PYTHON ?= python3
TORCH ?= torch==2.13.0
DEEPSPEED ?= deepspeed==0.19.8

.PHONY: install demo test lint

install:
	$(PYTHON) -m pip install -q --disable-pip-version-check $(if $(shell $(PYTHON) -c "import torch" 2>/dev/null && echo y),,"$(TORCH)") -e ".[dev]"
	# DeepSpeed ships as source only: build it against the torch above, without its CUDA ops
	$(if $(shell $(PYTHON) -c "import deepspeed" 2>/dev/null && echo y),,DS_BUILD_OPS=0 $(PYTHON) -m pip install -q --disable-pip-version-check --no-build-isolation "$(DEEPSPEED)")

demo: install
	accelerate launch --config_file recipes/cpu-2proc-distfa.yaml scripts/train.py

test: install
	$(PYTHON) -m ruff check hf_longctx tests scripts
	$(PYTHON) -m pytest -q tests

lint:
	$(PYTHON) -m ruff check hf_longctx tests scripts
