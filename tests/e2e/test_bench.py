"""`saga bench` runs end to end on the real services and writes its report.

A tiny profile (a few seconds per phase) through the real command line: every
phase runs, the run exits 0 and the JSON report holds the figures the issue asks
for, each a positive number. Nothing here asserts on speed: the figures come
from the benchmark itself, on a machine whose load this test does not control.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._infra import ROOT, Services

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

TINY = [
    *("--warmup", "1", "--duration", "3", "--latency-duration", "3"),
    *("--rollback-duration", "3", "--baseline-duration", "2"),
    *("--accounts", "300", "--window", "100", "--rate", "20", "--partitions", "2"),
    *("--batch", "100", "--saga-timeout", "60"),
]

POSITIVE = (
    "sagas_per_s",
    "direct_write_sagas_per_s",
    "log_bound_sagas_per_s",
    "rollback_sagas_per_s",
    "rollback_ratio",
    "direct_write_ratio",
    "log_bound_ratio",
    "records_per_saga",
)


def test_bench_tiny_profile_writes_a_complete_report(
    services: Services, topic_prefix: str, tmp_path: Path
) -> None:
    report = tmp_path / "bench.json"
    command = [
        *(sys.executable, "-m", "coordinator", "bench", *TINY),
        *("--bootstrap", services.kafka_bootstrap, "--prefix", topic_prefix),
        *("--schema", topic_prefix, "--report", str(report), "--logs", str(tmp_path / "logs")),
        *("--postgres-url", services.postgres_url, "--mongo-url", services.mongo_url),
        *("--redis-url", services.redis_url),
    ]
    env = {**os.environ, "COLUMNS": "200"}  # one line per row of rich's output
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200, check=False
    )
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output
    assert f"report: {report}" in done.stdout, output

    data = json.loads(report.read_text())
    for key in POSITIVE:
        assert isinstance(data[key], int | float) and data[key] > 0, (key, data[key])
    for key in ("decision_latency_ms", "completion_latency_ms"):
        figures = data[key]
        for q in ("p50", "p95", "p99", "max"):
            assert isinstance(figures[q], int | float) and figures[q] >= 0, (key, q, figures)
        assert figures["p50"] <= figures["p95"] <= figures["p99"] <= figures["max"], figures

    # CPU per saga: every process the bench started is measured; a service is
    # measured when infra/services.sh started it, and n/a (null) otherwise.
    cpu = data["cpu_s_per_saga"]
    started = ["coordinator", "bank#0 (sql)", "wallet#0 (mongo)", "rewards#0 (redis)"]
    for name in [*started, "client (bench)"]:
        assert isinstance(cpu[name], float) and cpu[name] > 0, (name, cpu)
    for name in ("kafka", "postgres", "redis", "ferretdb"):
        assert cpu[name] is None or cpu[name] >= 0, (name, cpu)

    for name, phase in data["phases"].items():
        assert phase["completed_in_window"] > 0, (name, phase)
        assert phase["unfinished"] == phase["failed"] == phase["unexpected_rollbacks"] == 0, phase
        assert phase["stores_agree"] is True, (name, phase["store_totals"])
    rollback = data["phases"]["rollback"]
    assert rollback["rolled_back_in_window"] > 0, rollback
    assert data["machine"]["cores"] >= 1
    assert data["parameters"]["rollback_fail_share"] == 0.2
    assert set(data["git"]) == {"commit", "dirty"}


def test_bench_wallet_on_postgres_runs_two_sql_participants_on_one_database(
    services: Services, topic_prefix: str, tmp_path: Path
) -> None:
    """``--layout pg-wallet``: bank and wallet both on PostgreSQL (one schema, one ledger
    table), every saga finishes and each store moved exactly the committed money."""
    report = tmp_path / "bench.json"
    command = [
        *(sys.executable, "-m", "coordinator", "bench", *TINY),
        *("--layout", "pg-wallet", "--phases", "main,rollback"),
        *("--bootstrap", services.kafka_bootstrap, "--prefix", topic_prefix),
        *("--schema", topic_prefix, "--report", str(report), "--logs", str(tmp_path / "logs")),
        *("--postgres-url", services.postgres_url, "--mongo-url", services.mongo_url),
        *("--redis-url", services.redis_url),
    ]
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200, check=False
    )
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output

    data = json.loads(report.read_text())
    figures = data["layouts"]["pg-wallet"]
    assert figures["stores"] == {"bank": "postgres", "wallet": "postgres", "rewards": "redis"}
    assert {"bank#0 (sql)", "wallet#0 (sql)", "rewards#0 (redis)"} <= set(data["cpu_s_per_saga"])
    assert figures["cpu_ms_per_saga_total"] > 0
    for name, phase in figures["phases"].items():
        assert phase["completed_in_window"] > 0, (name, phase)
        assert phase["unfinished"] == phase["failed"] == phase["unexpected_rollbacks"] == 0, phase
        assert phase["stores_agree"] is True, (name, phase["store_totals"])
    assert figures["phases"]["rollback"]["rolled_back_in_window"] > 0
