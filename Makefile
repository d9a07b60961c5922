# `make test` and `make demo` each do their own set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch pinned to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[export,dev]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check specdeploy tests tools

bench: $(STAMP)
	$(BIN)/python tools/bench_verify_cost.py
	$(BIN)/python tools/bench_overhead.py

demo: $(STAMP)
	$(BIN)/python tools/demo.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
