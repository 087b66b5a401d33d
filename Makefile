# flwr-gsgm: `make run` (set up + GSGM on real non-IID Fashion-MNIST), `make test` (set up + tests).
# Everything installs from the project's own files into .venv; Flower's state lives in .flwr/.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATA_DIR ?= /usr/share/datasets/fashion-mnist
NUM_NODES ?= 10
RUN_CONFIG ?=
# Passed to the recipe through the environment: written into the recipe, the shell
# would strip the quotes of TOML strings (strategy="asgd" would become strategy=asgd).
export RUN_CONFIG

.PHONY: setup data run test lint bench clean

setup: data $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[app,test]"
	touch $(STAMP)

# Fashion-MNIST from Debian's package dataset-fashion-mnist (gzipped IDX files).
data:
	@if [ ! -f "$(DATA_DIR)/t10k-labels-idx1-ubyte.gz" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "Installing Debian package dataset-fashion-mnist"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist; \
	  else \
	    echo "Fashion-MNIST not found in $(DATA_DIR): run 'sudo apt-get install dataset-fashion-mnist'" \
	         "or set DATA_DIR and run config data-root to a folder with the four IDX files" >&2; exit 1; \
	  fi; \
	fi

run: setup
	PATH="$(abspath $(BIN)):$$PATH" bash scripts/run_simulation.sh $(NUM_NODES) $${RUN_CONFIG:+"$$RUN_CONFIG"}

test: setup lint
	$(BIN)/python -m pytest -q

# ruff (pyproject [tool.ruff]): the linter and the formatter's check, 100 columns.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python benchmarks/bench_core.py

clean:
	rm -rf $(VENV) .flwr outputs .pytest_cache .hypothesis
