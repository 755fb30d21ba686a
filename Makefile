# The two commands: `make up` brings the whole system up; `make test` runs the suite.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
DEPS_STAMP := $(VENV)/.deps-installed

# `make security` (.ci/run, before the tests): bandit over the code that runs, with the
# checks skipped in bandit.yaml and the reviewed findings in .bandit-baseline.json
# (each explained in docs/security.md#bandit); any new finding fails it.
SECURITY_PATHS := apps heteroflow agent/heteroflow_agent celery_worker.py manage.py

.PHONY: up test test-fast lint security install engines stores clean-data bench bench-scheduler bench-agent bench-sweep bench-submit bench-gateway bench-tunnel bench-simulate bench-predict bench-cli bench-logs soak

up: $(DEPS_STAMP)
	$(BIN)/python -m heteroflow.launcher up

test: $(DEPS_STAMP)
	$(BIN)/python -m heteroflow.launcher test -- $(PYTEST_ARGS)

# The edit-test loop: everything but the end-to-end (-m e2e) and browser (-m browser) tests.
test-fast: $(DEPS_STAMP)
	$(BIN)/python -m heteroflow.launcher test -- -m "not e2e and not browser" $(PYTEST_ARGS)

lint: $(DEPS_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

security: $(DEPS_STAMP)
	$(BIN)/bandit -q -c bandit.yaml -b .bandit-baseline.json -r $(SECURITY_PATHS)

install: $(DEPS_STAMP)

# Real inference engines (requirements/engines.txt: llama.cpp's server), which the agent's
# process runtime launches and the engine end-to-end tests need. A 7-20 minute build the
# first time on a machine; the wheel is cached (scripts/engines.sh).
engines: $(DEPS_STAMP)
	VENV=$(VENV) bash scripts/engines.sh $(ENGINES_ARGS)

stores: $(DEPS_STAMP)
	$(BIN)/python -m heteroflow.launcher stores

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "HeteroFlow needs Python 3.11 or newer; set PYTHON=/path/to/python3.11")'
	$(PYTHON) -m venv $(VENV)

# the project's requirements, and `hf` (client/, editable) for `make up`'s users
$(DEPS_STAMP): requirements/base.txt requirements/dev.txt client/pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements/dev.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ./client
	touch $@

clean-data:
	@echo "This deletes the embedded database, Redis data and logs in $${HETEROFLOW_DATA_DIR:-.heteroflow}."
	@read -p "Type 'yes' to continue: " answer && [ "$$answer" = yes ] && rm -rf "$${HETEROFLOW_DATA_DIR:-.heteroflow}"

# Heartbeat ingestion with a Celery worker and beat running every periodic job; steady
# and busy readings; prints rate, latency, deadlocks, lock waits, each job's run times
# and the processes' error lines (docs/nodes.md#benchmarks). For example:
#   make bench BENCH_ARGS="--nodes 1000 --duration 30 --mode closed --connections 48 --skip-list"
#   make bench BENCH_ARGS="--nodes 10000 --mode closed --skip-list"      # the 10,000-node fleet
#   make bench BENCH_ARGS="--mode closed --generator wrk"                 # wrk sends (apt-get install wrk)
bench: $(DEPS_STAMP)
	$(BIN)/python bench/heartbeats.py $(BENCH_ARGS)

bench-scheduler: $(DEPS_STAMP)
	$(BIN)/python bench/scheduler.py $(BENCH_ARGS)

bench-agent: $(DEPS_STAMP)
	$(BIN)/python bench/agent_resources.py $(BENCH_ARGS)

bench-sweep: $(DEPS_STAMP)
	$(BIN)/python bench/sweep.py $(BENCH_ARGS)

bench-submit: $(DEPS_STAMP)
	$(BIN)/python bench/submit.py $(BENCH_ARGS)

bench-gateway: $(DEPS_STAMP)
	$(BIN)/python bench/gateway.py $(BENCH_ARGS)

# The tunnel (docs/tunnel.md#benchmarks): throughput, added latency and 200 concurrent
# sessions through the whole path of a user's session and through the SSH hop alone, and
# an idle tunnel's memory and bytes/s per node (the 10,000-node plan).
bench-tunnel: $(DEPS_STAMP)
	$(BIN)/python bench/tunnel.py $(BENCH_ARGS)

# The simulator (docs/simulate.md#speed): a generated week of 100,000 jobs replayed on
# 1,000 nodes × 8 cards, binpack and spread; the target is 120 s each.
bench-simulate: $(DEPS_STAMP)
	$(BIN)/python bench/simulate.py $(BENCH_ARGS)

# The start-time estimates' accuracy (docs/predictions.md#measured-accuracy): a generated
# two-day trace replayed on a busy fleet, each job's first estimate against its real start.
bench-predict: $(DEPS_STAMP)
	$(BIN)/python bench/predict.py $(BENCH_ARGS)

# Live logs under load (docs/deployment.md#live-logs): ingestion MB/s, the heartbeat's p99
# with and without it, print-to-screen latency through a real agent and `hf logs -f`, and
# 100 followers of one chatty task, with the worker and beat running every periodic job.
#   make bench-logs BENCH_ARGS="--duration 30 --skip-latency --hb-rate 4"
bench-logs: $(DEPS_STAMP)
	$(BIN)/python bench/logs.py $(BENCH_ARGS)

# hf's own times (docs/cli.md#speed): `hf --version`, and `hf ps` against a live server whose
# tenant has 10,000 tasks.
bench-cli: install
	$(BIN)/python bench/cli.py $(BENCH_ARGS)

# The soak (docs/deployment.md#soak): the whole control plane under heartbeats, tasks and
# gateway traffic for DURATION minutes; SOAK_ARGS for more options (--nodes 200 …).
DURATION ?= 30
soak: $(DEPS_STAMP)
	$(BIN)/python bench/soak.py --duration $(DURATION) $(SOAK_ARGS)
