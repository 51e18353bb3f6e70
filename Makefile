# keyq — the usual targets. `make test` is all a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PACKAGES := broker producer worker janitor keyq
CODE := $(PACKAGES) tests bench scripts

.PHONY: help install services lint typecheck test bench demo clean

help:
	@echo "make test       install into $(VENV), find or start RabbitMQ and Redis, lint, type-check, run the tests"
	@echo "make demo       the demo: order events through workers and a janitor, with chaos, verified"
	@echo "make bench      every benchmark, keyq against its baselines, into bench/results/all.json"
	@echo "make services   find or start RabbitMQ and Redis (scripts/services.sh)"
	@echo "make lint | typecheck | install | clean"

$(BIN)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "keyq needs Python 3.11 or newer")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $@

install: $(BIN)/.installed

services:
	@scripts/services.sh

lint: install
	$(BIN)/ruff check $(CODE)
	$(BIN)/ruff format --check $(CODE)

typecheck: install
	$(BIN)/mypy

test: install services lint typecheck
	$(BIN)/pytest

demo: install services
	$(BIN)/keyq demo --chaos

bench: install services
	$(BIN)/python -m bench --out bench/results/all.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info
