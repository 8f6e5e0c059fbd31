# The two user-facing targets are `make test` and `make demo`: each does all
# set-up on a fresh machine (virtual environment, Debian packages, Kafka and
# Spark jars from Maven Central, FerretDB via go install, services started)
# and is cheap when repeated.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
INFRA  := infra/services.sh
# Exports the running services' addresses (SAGA_KAFKA_BOOTSTRAP, ...) into a recipe.
WITH_ENV := eval "$$($(INFRA) env)" &&

.PHONY: help venv lint docs docs-check unit test demo bench bench-short profile reconcile-bench state-bench chaos chaos-short chaos-cluster console-screenshots infra-up infra-down infra-status cluster-up cluster-down cluster-status spark-cluster-up spark-cluster-down clean

help:
	@echo "make test          install everything, start the local services, lint, run the test suite"
	@echo "make demo          install everything, start the local services, run the demo workload"
	@echo "make bench         throughput, latency and CPU per saga, wallet on FerretDB and on PostgreSQL,"
	@echo "                   read_committed beside none, signed beside unsigned, a hot-record phase,"
	@echo "                   against the direct-write and log baselines (about 20 min; BENCH_ARGS=...)"
	@echo "make bench-short   the same with 10 s phases, for a quick check"
	@echo "make profile       py-spy flame graphs and top functions of every process in a main phase"
	@echo "make infra-up      provision and start Kafka, PostgreSQL, Redis, FerretDB"
	@echo "make infra-status  which services are up, and their addresses as shell exports"
	@echo "make infra-down    stop the services started by infra-up, and the Kafka and Spark clusters if up"
	@echo "make spark-cluster-up    a Spark standalone master and two workers on loopback, for"
	@echo "                         saga reconcile --master (addresses: infra/spark-cluster.sh env)"
	@echo "make spark-cluster-down  stop them"
	@echo "make lint          ruff and mypy"
	@echo "make docs          serve the manual (MkDocs) on http://127.0.0.1:8000 (DOCS_ADDR=host:port), live-reloaded"
	@echo "make docs-check    build the manual with mkdocs build --strict (part of make test)"
	@echo "make unit          the unit tests only (no services)"
	@echo "make reconcile-bench  the reconciliation job's throughput on a generated log"
	@echo "make state-bench   coordinator and client memory and restart after 2,000,000 sagas (default settings)"
	@echo "make chaos-short   fault injection, short profile (CI): every fault type once, a few minutes;"
	@echo "                   then 1,000+ hostile records of 29 kinds in 1,000+ valid sagas; then the"
	@echo "                   isolation tier: 2,000+ sagas on 20 hot records per store, kills, a reader"
	@echo "make chaos         fault injection, long profile: 20,000 sagas, 20 kills of each component"
	@echo "make console-screenshots  the web console's browser test, saving docs/img/console-*.png"
	@echo "make cluster-up    start a local three-broker Kafka cluster (infra/kafka-cluster.sh) next to the single node"
	@echo "make cluster-down  stop it; make cluster-status: its nodes and addresses"
	@echo "make chaos-cluster fault injection on the three-broker cluster: 5,000+ sagas, brokers killed by role"
	@echo "                   (leader, transaction and group coordinator), paused, down for minutes, rolled (about 25 min)"

# setuptools installs saga editable through a meta path finder, so that only `saga` (not
# coordinator/, streams/, ...) becomes importable, and always follows that with an
# information-only notice ("Editable installation ... be careful with folders ...") that
# pip prints as a warning: PYTHONWARNINGS filters that one notice, nothing else.
$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@echo "installing saga-olep with every extra and the dev tools into $(VENV)"
	@PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e '.[dev,all]'
	@touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check saga coordinator participants streams tests
	$(VENV)/bin/ruff format --check saga coordinator participants streams tests
	$(VENV)/bin/mypy

# The manual: docs/ and mkdocs.yml; the CLI and wire references are generated from the
# code at build time (docs/_hooks.py). --strict turns a broken link or a missing page
# into a failure.
# NO_MKDOCS_2_WARNING: Material's banner about its successor, printed on every build.
DOCS_ADDR ?= 127.0.0.1:8000
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
docs: venv
	$(MKDOCS) serve --dev-addr $(DOCS_ADDR)

docs-check: venv
	$(MKDOCS) build --strict --quiet --site-dir build/site

unit: venv
	$(VENV)/bin/pytest -m unit -q

infra-up:
	@$(INFRA) up

# Everything the local set-up may have started: the clusters first (each a no-op when down).
infra-down:
	@infra/kafka-cluster.sh down
	@infra/spark-cluster.sh down
	@$(INFRA) down

infra-status:
	@$(INFRA) status

# A Spark standalone cluster (README "Running on a cluster"), run from the venv's pyspark.
spark-cluster-up: venv
	@infra/spark-cluster.sh up

spark-cluster-down:
	@infra/spark-cluster.sh down

test: venv lint docs-check infra-up
	@$(WITH_ENV) $(VENV)/bin/pytest -m "not slow and not chaos" -q

demo: venv infra-up
	@$(WITH_ENV) $(VENV)/bin/saga demo

# End-to-end sagas/s, latencies and CPU per saga, with the direct-write and log-bound
# baselines measured in the same run; writes reports/bench.json. Options: BENCH_ARGS
# (see `saga bench --help`), e.g. BENCH_ARGS="--phases main,direct --duration 30".
# Both layouts (wallet on FerretDB, wallet on PostgreSQL), each: main 60 s and open loop at
# 400 sagas/s, each at read_committed then at none; main signed and unsigned, alternately;
# rollback with 20 % rejected; hot (every saga on 10 records per store); direct writes;
# then the log bound.
BENCH_ARGS ?=
BENCH_LAYOUTS := --layout default --layout pg-wallet
# Main and open loop at read_committed and at none, side by side; the hot phase; and the
# main phase with and without signed records, twice each, alternately (the pooled
# signed/unsigned ratio in the final table).
BENCH_COMPARE := --isolation both --signing both --signing-rounds 2
BENCH_SHORT := --warmup 3 --duration 10 --latency-duration 10 --rollback-duration 10 \
	--hot-duration 10 --baseline-duration 10 --report reports/bench-short.json
bench: venv infra-up
	@$(WITH_ENV) $(VENV)/bin/saga bench $(BENCH_LAYOUTS) $(BENCH_COMPARE) $(BENCH_ARGS)

bench-short: venv infra-up
	@$(WITH_ENV) $(VENV)/bin/saga bench $(BENCH_LAYOUTS) $(BENCH_COMPARE) $(BENCH_SHORT) \
		$(BENCH_ARGS)

# py-spy records every product process during a 30 s main phase of each layout:
# reports/profile/<layout>.main/*.raw (collapsed stacks) and summary.txt.
PROFILE_ARGS ?=
profile: venv infra-up
	@$(WITH_ENV) $(VENV)/bin/saga bench $(BENCH_LAYOUTS) --phases main --warmup 5 \
		--duration 30 --profile reports/profile --report reports/bench-profile.json $(PROFILE_ARGS)

# The reconciliation job's throughput on a generated log (SAGAS=1000000 by default).
SAGAS ?= 1000000
reconcile-bench: venv infra-up
	@$(WITH_ENV) $(PY) -m saga.streams.reconcile.bench --sagas $(SAGAS)

# Bounded state: a coordinator's restart-to-ready time and memory, and a new client's
# start-to-ready time, after 10,000 and after 1,000,000 sagas of history (about 15 min).
STATE_ARGS ?=
state-bench: venv infra-up
	@$(WITH_ENV) $(PY) -m tests.state_bench $(STATE_ARGS)

# Fault injection (tests/chaos): kills and restarts the services infra-up started, so it
# runs after the other tests. CHAOS_SEED=N replays a run; the report goes to CHAOS_REPORT
# (default reports/chaos.json; the hostile profile's reports/chaos-hostile.json; the
# isolation tier's reports/chaos-isolation.json).
chaos-short: venv infra-up
	@$(WITH_ENV) $(VENV)/bin/pytest -m chaos -q -s tests/chaos/test_chaos.py::test_short_profile \
		tests/chaos/test_chaos.py::test_hostile_profile tests/chaos/test_chaos.py::test_isolation_profile

chaos: venv infra-up
	@$(WITH_ENV) $(VENV)/bin/pytest -m chaos -q -s tests/chaos/test_chaos.py::test_long_profile

# The web console's browser test (headless Chromium from Debian's packages, installed by
# infra/chromium.sh), keeping its screenshots in docs/img for the README.
console-screenshots: venv infra-up
	@$(WITH_ENV) SAGA_CONSOLE_SCREENSHOTS=docs/img $(VENV)/bin/pytest -q \
		tests/e2e/test_console_browser.py

# A three-broker KRaft cluster on loopback (other ports and folders than the single node,
# which keeps running): `eval "$$(infra/kafka-cluster.sh env)"` points saga at it.
CLUSTER := infra/kafka-cluster.sh

cluster-up:
	@$(CLUSTER) up

cluster-down:
	@$(CLUSTER) down

cluster-status:
	@$(CLUSTER) status

# The cluster profile: the databases of infra-up, Kafka from the three-broker cluster; kills,
# pauses and restarts the cluster's nodes only. Report: CHAOS_REPORT (reports/chaos-cluster.json).
chaos-cluster: venv infra-up cluster-up
	@$(WITH_ENV) eval "$$($(CLUSTER) env)" && $(VENV)/bin/pytest -m chaos -q -s \
		tests/chaos/test_chaos_cluster.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
