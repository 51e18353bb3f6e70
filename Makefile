# keyq — the usual targets. `make test` is all a fresh machine needs: Python 3.11 and Java 17,
# with RabbitMQ and Redis running, installable (as root) or, failing both, a Docker engine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The import package `keyq`: its root in src/keyq, the four components mapped into it.
PACKAGES := src/keyq broker producer worker janitor
CODE := $(PACKAGES) tests bench scripts

.PHONY: help install services test-services coverage rabbitmq4 lint typecheck package test test-rabbitmq4 test-fast bench \
	demo compose-check clean

help:
	@echo "make test       install into $(VENV), find or start RabbitMQ and Redis, lint, type-check,"
	@echo "                check the package, run the tests (PYTEST_ARGS: a subset)"
	@echo "make test-fast  the unit tests alone: no RabbitMQ, Redis or Spark needed (under a minute)"
	@echo "make test-rabbitmq4  the tests on RabbitMQ 4.3 and Valkey 9, private nodes and clusters"
	@echo "                included, every deprecated feature denied (as root; PYTEST_ARGS: a subset)"
	@echo "make rabbitmq4  make and start RabbitMQ 4.3 and Valkey 9 (scripts/rabbitmq4.sh; as root)"
	@echo "make demo       the demo: order events through workers and a janitor, with chaos, verified"
	@echo "make bench      every benchmark, keyq against its baselines, into bench/results/all.json"
	@echo "make services   find or start RabbitMQ and Redis, locally or with docker compose"
	@echo "make coverage   the suite under branch coverage, subprocesses included (build/coverage/)"
	@echo "make package    build the sdist and wheel, twine check them, use the wheel in a fresh venv"
	@echo "make compose-check  docker-compose.yml end to end in a Docker engine (~5 min a run):"
	@echo "                build, demo, scale and kill, metrics, Parquet, teardown"
	@echo "make lint | typecheck | install | clean"

# `make demo` needs keyq with its worker extra (the demo's workers run Spark) and nothing else;
# `make test` adds every other extra the tests use (Spark Connect's client, OpenTelemetry) and
# the test tools. `pip install keyq` alone is the producer SDK and the operator commands.
$(BIN)/.installed-worker: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "keyq needs Python 3.11 or newer")'
	@echo "keyq: installing keyq[worker] into $(VENV): keyq, and the Spark its workers run (pyspark, pyarrow, pandas)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[worker]" --config-settings editable_mode=strict
	@touch $@

$(BIN)/.installed: $(BIN)/.installed-worker
	@echo "keyq: installing the connect and otel extras and the test tools (pytest, ruff, mypy, build, selenium...) into $(VENV): the tests and checks use them"
	$(BIN)/python -m pip install -q -e ".[worker,connect,otel,dev]" --config-settings editable_mode=strict
	@touch $@

# A strict editable install links each module into build/__editable__.*, the folder on the
# venv's path that maps broker/ to keyq.broker and so on: a module added or removed needs a
# relink, which a change to a package folder triggers.
$(BIN)/.linked: $(BIN)/.installed-worker $(PACKAGES)
	$(BIN)/python -m pip install -q --no-deps -e . --config-settings editable_mode=strict
	@touch $@

install: $(BIN)/.installed $(BIN)/.linked

services:
	@scripts/services.sh

# The services, and the programs only the tests use (promtool, chromium, chromedriver).
test-services:
	@scripts/services.sh --test-tools

# RabbitMQ 4.3 and Valkey 9 from a Debian forky root (made the first time: ~3 min, 1 GB), on
# loopback ports of their own; `eval "$$(scripts/rabbitmq4.sh env)"` points keyq at them.
rabbitmq4:
	scripts/rabbitmq4.sh setup
	scripts/rabbitmq4.sh start

lint: install
	$(BIN)/ruff check $(CODE)
	$(BIN)/ruff format --check $(CODE)

typecheck: install
	$(BIN)/mypy

# The sdist and wheel as an index takes them; the wheel installed alone, without extras, into a
# fresh venv and used on the services (scripts/package_check.sh; ~15 s, nothing left behind).
package: install services
	PYTHON=$(BIN)/python scripts/package_check.sh

# The suite runs in TEST_PROCESSES pytest processes (pytest-xdist): most of a test's time is
# spent waiting on a broker, a Redis or a worker, so more processes than cores pay. Each test
# owns its streams and private servers (tests/conftest.py); a file whose tests share a
# module-scoped server is kept in one process (xdist_group). PYTEST_ARGS: a subset, e.g.
# PYTEST_ARGS=tests/test_status.py
TEST_PROCESSES ?= 3
PYTEST_PARALLEL = -n $(TEST_PROCESSES) --dist loadgroup

# The checks run side by side (one core each); the tests marked `alone` (they assert on timing)
# run after the rest, in one process.
test: install test-services
	$(MAKE) --no-print-directory --output-sync=target -j3 lint typecheck package
	KEYQ_TEST_ALONE=skip $(BIN)/pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)
	KEYQ_TEST_ALONE=only $(BIN)/pytest $(PYTEST_ARGS)

# Branch coverage of keyq's code over the suite, subprocesses included (scripts/coverage.sh):
# the figures per component in build/coverage/per-package.txt.
coverage: install test-services
	BIN=$(BIN) scripts/coverage.sh $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The suite against RabbitMQ 4.3 and Valkey 9: the shared services are those of `make
# rabbitmq4`, and the private nodes, clusters and Redis servers the tests start come from the
# same forky root (KEYQ_TEST_RABBITMQ=4), every deprecated feature denied.
# PYTEST_ARGS: a subset, e.g. PYTEST_ARGS='-m broker_versions' or PYTEST_ARGS=tests/test_cluster.py
test-rabbitmq4: install rabbitmq4
	eval "$$(scripts/rabbitmq4.sh env)" && KEYQ_TEST_RABBITMQ=4 $(BIN)/pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# Unit tests only (tests/conftest.py marks every test that uses no service fixture). The
# service URLs point at a closed port, so a test that reaches a service unmarked fails here.
test-fast: install
	KEYQ_AMQP_URL=amqp://guest:guest@127.0.0.1:1/%2F KEYQ_REDIS_URL=redis://127.0.0.1:1/0 \
		$(BIN)/pytest -m unit -q -p no:cacheprovider

demo: $(BIN)/.linked services
	$(BIN)/keyq demo --chaos

bench: install services
	$(BIN)/python -m bench --out bench/results/all.json

# The compose deployment in a real Docker engine (not part of `make test`: minutes a run).
# COMPOSE_CHECK_ARGS: e.g. --runs 3, --host-network (see scripts/compose_check.py).
compose-check:
	$(PYTHON) scripts/compose_check.py $(COMPOSE_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build dist *.egg-info
