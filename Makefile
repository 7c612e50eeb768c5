# `make demo` and `make test` each create .venv if it is missing, install sleuth into it (skipped when
# pyproject.toml has not changed since the last install), fetch the embedded defaults once, then run.
VENV    ?= .venv
PY      := $(VENV)/bin/python
SLEUTH  := $(VENV)/bin/sleuth
STAMP   := $(VENV)/.sleuth-installed
QUESTION ?= Who directed the film 2001: A Space Odyssey?

.PHONY: demo test test-fast lint bench install assets

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
