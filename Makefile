# The commands of the README. Each installs what it needs first (idempotent).
# CPU machines: torch==2.13.0 is the CPU build; on a GPU machine install your CUDA torch first.
PYTHON ?= python3
TORCH ?= torch==2.13.0
DEEPSPEED ?= deepspeed==0.19.8
PIP = $(PYTHON) -m pip install --disable-pip-version-check --progress-bar on
HAVE_TORCH = $(shell $(PYTHON) -c "import torch" 2>/dev/null && echo y)

.PHONY: install install-demo demo test lint wheels-peers wheels-fa4

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
	$(PYTHON) -m accelerate.commands.launch --config_file recipes/cpu-2proc.yaml scripts/train.py

test: install
	$(PYTHON) -m ruff check hf_longctx tests scripts examples
	$(PYTHON) -m pytest -q --durations=15 tests

lint:
	$(PYTHON) -m ruff check hf_longctx tests scripts examples

# The peers of scripts/bench_peers.py as wheels for the GPU machine (Python 3.12, x86-64, no network), in .whl/peers/:
# DeepSpeed built here as a pure-Python wheel (no CUDA ops; its CPU Adam compiles there on first use), the pinned
# peers (the "peers" extra), and what that machine's image lacks for them. Install there with
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/peers/*.whl && export PYTHONPATH=/tmp/site:$$PWD
PEERS_WHEELS ?= .whl/peers
PEERS_PINS = liger-kernel==0.8.5 torchao==0.17.0 trl==1.16.0
PEERS_MISSING = datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5
PY312_X86 = --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

wheels-peers:
	mkdir -p $(PEERS_WHEELS)
	DS_BUILD_OPS=0 $(PYTHON) -m pip wheel --disable-pip-version-check -q --no-deps --no-build-isolation \
		-w $(PEERS_WHEELS) "$(DEEPSPEED)"
	$(PYTHON) -m pip download --disable-pip-version-check -q --no-deps $(PY312_X86) -d $(PEERS_WHEELS) \
		$(PEERS_PINS) $(PEERS_MISSING)
	@ls -1 $(PEERS_WHEELS)
	@du -ch $(PEERS_WHEELS)/*.whl | tail -1

# The "fa4" extra as wheels for the same machine, in .whl/fa4/: FlashAttention-4 and what its image lacks for it.
# The CUTLASS DSL's three wheels fill one nvidia_cutlass_dsl package (separate pip --target installs would replace each
# other's), so unpack every wheel into one folder there:
#   for w in .whl/fa4/*.whl; do python3 -m zipfile -e $$w /tmp/site; done
#   export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$$PWD
FA4_WHEELS ?= .whl/fa4
FA4_PINS = flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
	nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 \
	apache-tvm-ffi==0.1.15.post2 quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5 einops==0.8.2

wheels-fa4:
	mkdir -p $(FA4_WHEELS)
	$(PYTHON) -m pip download --disable-pip-version-check -q --no-deps $(PY312_X86) --platform any -d $(FA4_WHEELS) \
		$(FA4_PINS)
	@ls -1 $(FA4_WHEELS)
	@du -ch $(FA4_WHEELS)/*.whl | tail -1
