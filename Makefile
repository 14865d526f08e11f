# Two commands: `make demo` and `make test`. Each creates .venv if missing and installs what it
# needs (quick the second time: a stamp file remembers what was installed for which pyproject).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: test demo lint typecheck contracts unit bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch goes first and alone, pinned, so that nothing later pulls a CUDA build.
$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

test: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest -q

# `make demo DEMO_ARGS="--exit --port 0"` for scripts (see `fedshard demo --help`).
DEMO_ARGS ?=
demo: $(VENV)/.installed-dev
	$(BIN)/fedshard demo $(DEMO_ARGS)

# Every benchmark (bench/*.py; helpers start with _), each measuring its alternatives side by side
# in one run, then bench/results/REPORT.md from all their results (bench/report).
bench: $(VENV)/.installed-dev
	set -e; for script in bench/[!_]*.py; do echo "== $$script"; $(BIN)/python $$script; done
	$(BIN)/python bench/report

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
