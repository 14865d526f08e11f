# Two commands: `make demo` and `make test`. Each creates .venv if missing and installs what it
# needs (quick the second time: a stamp file remembers what was installed for which pyproject).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: test docs test-qwen demo lint typecheck contracts unit bench bench-setup bench-qwen clean

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
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	$(BIN)/pytest -q -m "not heavy"

# The documentation site (MkDocs Material) into site/; its CLI, HTTP API and benchmark pages are
# generated from the code at build time (docs/hooks/fedshard_reference.py).
docs: $(VENV)/.installed-dev
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The tests that need the real Qwen2.5-Coder-1.5B (first run: about 25 minutes to convert,
# export and quantize it; cached in .cache/fedshard after), kept out of `make test` for CI's time.
test-qwen: $(VENV)/.installed-dev
	$(BIN)/pytest -q -m heavy

# `make demo DEMO_ARGS="--exit --port 0"` for scripts (see `fedshard demo --help`).
DEMO_ARGS ?=
demo: $(VENV)/.installed-dev
	$(BIN)/fedshard demo $(DEMO_ARGS)

# Every benchmark (bench/*.py; helpers start with _), each measuring its alternatives side by side
# in one run, then bench/results/REPORT.md from all their results (bench/report).
bench: $(VENV)/.installed-dev
	set -e; for script in bench/[!_]*.py; do echo "== $$script"; $(BIN)/python $$script; done
	$(BIN)/python bench/report

# The benchmarks' own dependencies: llama.cpp's prebuilt CPU binary through node-llama-cpp
# (npm; needs node and npm, about 85 MB; nothing is compiled), for bench/generate.py --llama-cpp.
NODE_LLAMA_CPP := 3.22.1
bench/.node/.installed: Makefile
	mkdir -p bench/.node
	cd bench/.node && npm install --no-audit --no-fund --omit=optional --ignore-scripts \
		--no-save node-llama-cpp@$(NODE_LLAMA_CPP) @node-llama-cpp/linux-x64@$(NODE_LLAMA_CPP)
	touch $@
bench-setup: $(VENV)/.installed-dev bench/.node/.installed

# Qwen2.5-Coder-1.5B in int4 on four 512 MiB agents vs one ONNX Runtime session vs llama.cpp.
bench-qwen: bench-setup
	$(BIN)/python bench/generate.py --model qwen2.5-coder-1.5b --weights int4 --agents 4 \
		--memory 512MiB --no-caps --no-transformers --llama-cpp --tokens 32 --runs 1 \
		--out bench/results/generate_qwen.md
	$(BIN)/python bench/report

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache site
