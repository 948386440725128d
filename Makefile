# Gradient Garden — two commands for a fresh machine:
#   make run    install, prepare the embedded default corpus and train the debug recipe (CPU, minutes)
#   make test   install with dev extras, check notebooks are clean and exported, lint with ruff, run the notebooks
#               (their committed outputs must match a fresh run) and pytest
#   make book   run every notebook and keep its outputs, so the notebooks read as a book without running them
PY ?= python3
PYTEST_ARGS ?=
VENV ?= .venv
BIN := $(VENV)/bin
RECIPE ?= recipes/pretraining/debug.yaml
TORCH ?= torch==2.13.0

.PHONY: install install-dev run test check-clean lint nbtest book pytest export clean-nbs

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .

install-dev: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	@# the chat page's browser test drives Debian's Chromium; install it where we can, never fail without it
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v chromium >/dev/null 2>&1; then \
		(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) || \
		echo "note: could not install chromium; tests/test_serve_browser.py will be skipped"; fi

run: install
	$(BIN)/gg prepare --recipe $(RECIPE)
	$(BIN)/gg train --recipe $(RECIPE)

# gg notebook's template is package data, outside nbs/: cleaned the same way
TEMPLATE := gradient_garden/assets/runs/train.ipynb

export:
	$(BIN)/nbdev-export
	$(BIN)/nbdev-clean
	$(BIN)/nbdev-clean --fname $(TEMPLATE)

check-clean:
	$(BIN)/nbdev-clean
	$(BIN)/nbdev-clean --fname $(TEMPLATE)
	$(BIN)/nbdev-export
	@if [ -n "$$(git status --porcelain -- nbs gradient_garden)" ]; then \
		echo "nbdev-clean/nbdev-export changed files; run 'make export' and commit:"; \
		git status --porcelain -- nbs gradient_garden; exit 1; fi

# ruff check only (pyproject.toml [tool.ruff]); exported code is fixed in its notebook, then `make export`
lint:
	$(BIN)/ruff check gradient_garden tests bench tools

nbtest: export OMP_NUM_THREADS=1
nbtest:
	bash tools/nbtest.sh $(BIN)

book: export OMP_NUM_THREADS=1
book:
	$(BIN)/nbdev-test --n-workers 2 --timing --save
	$(BIN)/nbdev-clean

pytest: export OMP_NUM_THREADS=1
pytest:
	$(BIN)/pytest -q --durations=30 $(PYTEST_ARGS) tests

test: install-dev check-clean lint nbtest pytest
