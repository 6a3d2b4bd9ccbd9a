# Set-up happens on demand: every target below creates .venv and installs the
# package with what it needs first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,demo,docs]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check synkhronos tests demos bench
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/python demos/mnist/train_mnist_cpu_data.py

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python bench/call_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
