# Two commands do all set-up on a fresh machine:
#   make demo   builds .venv, installs sdplan, trains a tiny Stable Diffusion LoRA on the CPU
#   make test   builds .venv, installs sdplan with test tools, runs lint and the test suite (make test-all: every test)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned first, so installing diffusers & co. does not pull another build. Which build it is depends on
# pip's index (CPU on this project's CI image; from PyPI on Linux the CUDA one): for the CPU build from PyPI,
#   make demo TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH ?= torch==2.13.0

.PHONY: demo test test-all lint install bytecode clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[tensorboard]"
	touch $@

# The tests also run DeepSpeed ZeRO-2 with CPU optimizer offload on the CPU (DS_ACCELERATOR=cpu).
$(VENV)/.test-installed: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test,tensorboard,deepspeed]"
	touch $@

install: $(VENV)/.installed

# Where PYTHONDONTWRITEBYTECODE is set (it is on our development machine) Python writes no bytecode: every process
# compiled sdplan's sources again: ~0.15 s of each `sdplan` command, more of each trainer process. This compiles
# them once (again only where a source changed; Python never uses a .pyc older than its source).
bytecode: install
	$(BIN)/python -m compileall -q sdplan trainer

demo: install bytecode
	$(BIN)/sdplan train --demo --out sdplan-demo --force

lint: $(VENV)/.test-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two pytest-xdist workers (the suite takes 8-10 min on two cores, a minute of it DeepSpeed compiling its CPU
# Adam op in a fresh venv); -n 0 runs it serially.
XDIST ?= -n 2 --dist worksteal

test: lint bytecode
	$(BIN)/python -m pytest -q $(XDIST) -m "not extended"

# the same, with the longest runs whose ground another test covers (`extended`: DeepSpeed resumed 1 -> 2 processes,
# beside tests/test_trainer.py's 2 -> 1): about a minute more
test-all: lint bytecode
	$(BIN)/python -m pytest -q $(XDIST) -m "slow or not slow"

clean:
	rm -rf $(VENV) sdplan-demo sdplan-demo-* .pytest_cache .ruff_cache
