"""``saga reconcile --master spark://...`` on a Spark standalone cluster agrees with ``local[*]``.

The test brings up its own cluster with ``infra/spark-cluster.sh`` (a master and two
workers, on free ports, in a temporary folder, so a cluster a user started is left
alone), seeds one log and one set of ledgers in the three stores with the seeding
helpers of ``test_reconcile.py`` (every class of finding, so the comparison has
something to disagree on), then runs the command twice on the same log and ledgers:
once on the cluster, once in ``local[*]``. The two runs must report the same findings,
transaction by transaction, the same summary and the same replay plan. That the
cluster did the work is read from the cluster itself: the master lists the finished
application, and its executors' logs (under the workers' folders) show tasks run,
Python tasks (the MongoDB and Redis ledger readers) among them.

The stores' URLs reach the job as ``$NAME`` specs: no password may show in any
process's command line during the cluster run, nor in the cluster's logs.

Starting the cluster takes about half a minute on two cores; the whole module a few
minutes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest

from saga.streams.kafka import KafkaSettings
from saga.streams.reconcile import ReconcileConfig
from saga.streams.reconcile._spark import start_spark
from tests._infra import ROOT, Services
from tests._system import fresh_topics
from tests.integration.test_reconcile import (
    GRACE,
    NOW,
    PARTITIONS,
    Stores,
    findings,
    open_stores,
    seed_every_class,
)

if TYPE_CHECKING:
    from pymongo.database import Database

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SCRIPT = ROOT / "infra" / "spark-cluster.sh"
WORKERS = 2


@dataclass(frozen=True)
class Cluster:
    master: str  # spark://host:port
    ui: str  # http://host:port of the master's web UI
    folder: Path  # logs, pid files, the workers' work folders

    def status(self) -> dict[str, Any]:
        """The master's JSON status: workers, active and completed applications."""
        with urllib.request.urlopen(f"{self.ui}/json/", timeout=10) as answer:
            found: dict[str, Any] = json.load(answer)
            return found


def free_port(count: int = 1) -> int:
    """A port free on loopback now, with the ``count - 1`` after it free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first: int = s.getsockname()[1]
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first


def cluster_script(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("spark-cluster")
    env = dict(os.environ)
    env.update(
        SAGA_HOST="127.0.0.1",
        SAGA_PYTHON=sys.executable,
        SAGA_SPARK_CLUSTER_DIR=str(folder),
        SPARK_MASTER_PORT=str(free_port()),
        SPARK_MASTER_WEBUI_PORT=str(free_port()),
        SPARK_WORKER_WEBUI_PORT=str(free_port(WORKERS)),
        SPARK_WORKERS=str(WORKERS),
        SPARK_WORKER_CORES="1",
        SPARK_WORKER_MEMORY="1g",
    )
    up = cluster_script("up", env)
    try:
        assert up.returncode == 0, up.stderr
        exports = dict(
            line.removeprefix("export ").split("=", 1)
            for line in cluster_script("env", env).stdout.splitlines()
        )
        yield Cluster(exports["SAGA_SPARK_MASTER"], exports["SAGA_SPARK_MASTER_UI"], folder)
    finally:
        down = cluster_script("down", env)
        assert down.returncode == 0, down.stderr


@pytest.fixture
def settings(services: Services) -> Iterator[KafkaSettings]:
    yield from fresh_topics(services, "rcl", PARTITIONS)


@pytest.fixture
def stores(
    services: Services,
    pg_schema: tuple[str, str],
    mongo_db: Database[dict[str, Any]],
    redis_prefix: str,
) -> Iterator[Stores]:
    yield from open_stores(services, pg_schema, mongo_db, redis_prefix)


# ---------------------------------------------------------------- helpers

# The stores' URLs go to the job through these variables, never on its command line.
URL_VARIABLES = {
    "postgres_url": "SAGA_TEST_LEDGER_PG",
    "mongo_url": "SAGA_TEST_LEDGER_MONGO",
    "redis_url": "SAGA_TEST_LEDGER_REDIS",
}


def ledger_specs(stores: Stores) -> list[str]:
    return [
        f"sql:${URL_VARIABLES['postgres_url']}#schema={stores.schema}",
        f"mongo:${URL_VARIABLES['mongo_url']}#database={stores.mongo.name}",
        f"redis:${URL_VARIABLES['redis_url']}#prefix={stores.redis_prefix}",
    ]


def secrets_of(services: Services) -> list[str]:
    """The stores' passwords long enough to be told apart from other text."""
    found = []
    for url in (services.postgres_url, services.mongo_url, services.redis_url):
        password = urlsplit(url).password
        if password and len(password) >= 12:
            found.append(password)
    return found


class CommandLineWatch:
    """Reads every process's command line until stopped; remembers any holding a secret."""

    def __init__(self, secrets: list[str]) -> None:
        self.secrets = [s.encode() for s in secrets]
        self.seen: list[str] = []
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CommandLineWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    line = (entry / "cmdline").read_bytes()
                except OSError:  # gone meanwhile, or not ours to read
                    continue
                if any(secret in line for secret in self.secrets):
                    self.seen.append(line.replace(b"\0", b" ").decode(errors="replace")[:120])
            self.scans += 1
            self._stop.wait(0.25)


def reconcile(
    services: Services, settings: KafkaSettings, stores: Stores, out: Path, master: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``python -m streams.reconcile`` over the seeded log and ledgers; the summary."""
    env = dict(os.environ)
    env.pop("SAGA_SPARK_MASTER", None)
    env.update(
        SAGA_KAFKA_BOOTSTRAP=services.kafka_bootstrap,
        SAGA_SPARK_JARS=str(services.spark_jars_dir),
        SAGA_TOPIC_PREFIX=settings.prefix,
    )
    env.update({var: getattr(services, field) for field, var in URL_VARIABLES.items()})
    args = [sys.executable, "-m", "saga.streams.reconcile", "--master", master]
    for spec in ledger_specs(stores):
        args += ["--ledger", spec]
    args += ["--now-ms", str(NOW), "--grace", f"{GRACE}ms", "--all", "--json", "--out", str(out)]
    args += ["--driver-memory", "1g", "--shuffle-partitions", "4"]
    done = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr  # findings were seeded
    return done, json.loads(done.stdout)


def comparable(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without what differs between any two runs (timings, output folder)."""
    return {k: v for k, v in summary.items() if k not in ("timings", "findings_path")}


def executor_logs(cluster: Cluster, app_id: str) -> dict[str, str]:
    """``{worker/executor: stderr}`` of the application's executors."""
    logs = {}
    for path in sorted((cluster.folder / "work").glob(f"*/{app_id}/*/stderr")):
        logs[f"{path.parent.parent.parent.name}/{path.parent.name}"] = path.read_text(
            errors="replace"
        )
    return logs


# ---------------------------------------------------------------- the test


def test_the_cluster_and_local_runs_agree(
    cluster: Cluster,
    services: Services,
    settings: KafkaSettings,
    stores: Stores,
    tmp_path: Path,
) -> None:
    clean, expected = seed_every_class(settings, stores)
    assert cluster.status()["completedapps"] == []

    secrets = secrets_of(services)
    with CommandLineWatch(secrets) as watch:
        _, on_cluster = reconcile(services, settings, stores, tmp_path / "cluster", cluster.master)
    assert watch.scans > 0
    assert watch.seen == [], f"a store password is on a command line: {watch.seen}"
    _, local = reconcile(services, settings, stores, tmp_path / "local", "local[*]")

    # The cluster ran it: the master lists the finished application, whose executors
    # (in the workers' JVMs) ran tasks, the Python ledger readers among them.
    status = cluster.status()
    assert len(status["workers"]) == WORKERS
    apps = status["completedapps"]
    assert [(a["name"], a["state"]) for a in apps] == [("saga-reconcile", "FINISHED")], apps
    logs = executor_logs(cluster, apps[0]["id"])
    assert logs, f"no executor log under {cluster.folder / 'work'}"
    assert any("Running task" in text for text in logs.values()), list(logs)
    assert any("PythonRunner: Times" in text for text in logs.values()), list(logs)
    # ... and nothing a worker or an executor logged holds a password.
    for path in cluster.folder.rglob("*"):
        if path.is_file() and path.suffix != ".jar":
            text = path.read_text(errors="replace")
            assert not any(secret in text for secret in secrets), path

    # The same verdict, summary and replay plan ...
    assert comparable(on_cluster) == comparable(local)
    assert local["classes"]["violation"] > 0 and local["classes"]["stuck_no_decision"] > 0
    assert local["ledgers"] and all(x["entries"] > 0 for x in local["ledgers"])
    plan = (tmp_path / "local" / "replay.jsonl").read_text()
    assert plan and (tmp_path / "cluster" / "replay.jsonl").read_text() == plan

    # ... and the same findings, transaction by transaction: the seeded ones.
    config = ReconcileConfig(
        settings=settings, out=tmp_path / "unused", master="local[1]", driver_memory="1g"
    )
    spark = start_spark(config, [])
    try:
        found_local = findings(spark, tmp_path / "local")
        found_cluster = findings(spark, tmp_path / "cluster")
    finally:
        spark.stop()
    assert found_cluster == found_local
    got = {
        tx: (r["class"], tuple(r["invariants"]))
        for tx, r in found_local.items()
        if r["class"] != "ok"
    }
    assert got == expected
    assert {tx for tx, r in found_local.items() if r["class"] == "ok"} == clean
