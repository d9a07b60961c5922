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
	# TensorRT-RTX builds plans without a GPU, so the TensorRT build tests run on CPU machines too;
	# where its wheel does not install, those tests are skipped with that reason.
	$(BIN)/pip install --quiet tensorrt-rtx || echo "tensorrt-rtx did not install: TensorRT build tests will be skipped"
	touch $(STAMP)

# two workers, one test file each at a time (module fixtures are built once): most of the suite's time is
# single-threaded export tracing, so the second core halves it; each tiny export is traced once per run and shared
# by both workers (tests/tiny.py, EXPORT_CACHE). The tools run from the repository root as modules (python -m tools.X)
test: $(STAMP)
	$(BIN)/pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check specdeploy tests tools

bench: $(STAMP)
	$(BIN)/python -m tools.bench_verify_cost
	$(BIN)/python -m tools.bench_overhead

demo: $(STAMP)
	$(BIN)/python -m tools.demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
