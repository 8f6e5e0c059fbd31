"""``saga reconcile`` as a command: exit statuses, one-sentence failures, spark-submit, bench.

The "could not run" cases (exit 2) fail before Spark starts, so they take a
second each (Kafka unreachable: the ten seconds the job waits for a broker).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from saga.streams import Decision, Mode, Outcome, SagaRequest, Step, StepEvent, StepStatus, encode
from saga.streams.kafka import KafkaSettings, Producer, create_topics, delete_topics
from tests._infra import ROOT, Services, unique_name

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NOW = 1_800_000_000_000


def reconcile(
    services: Services, *args: str, prefix: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m streams.reconcile ARGS`` with the services' addresses in its environment."""
    environ = dict(os.environ)
    environ.update(
        SAGA_KAFKA_BOOTSTRAP=services.kafka_bootstrap,
        SAGA_SPARK_JARS=str(services.spark_jars_dir),
    )
    if prefix is not None:
        environ["SAGA_TOPIC_PREFIX"] = prefix
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "saga.streams.reconcile", *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def one_sentence(done: subprocess.CompletedProcess[str]) -> str:
    """The failure's stderr: one line, no traceback."""
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("saga reconcile:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def topics(services: Services) -> Iterator[KafkaSettings]:
    """Fresh topics holding one stuck saga (no decision long after its deadline) and one
    that committed."""
    settings = KafkaSettings(bootstrap=services.kafka_bootstrap, prefix=unique_name("rcc"))
    create_topics(settings, 2)
    t = settings.topics
    steps = (Step("bank", "insert", {"target": "t", "key": "k"}),)
    with Producer(settings) as producer:
        for tx in ("stuck", "done"):
            request = SagaRequest(tx, "s", Mode.PARALLEL, steps, NOW - 500_000, NOW - 600_000)
            producer.produce(t.requests, tx, encode(request))
            applied = StepEvent(tx, 0, "bank", StepStatus.APPLIED, NOW - 599_000)
            producer.produce(t.events, tx, encode(applied))
        decision = Decision("done", Outcome.COMMIT, "all steps applied", NOW - 598_000)
        producer.produce(t.decisions, "done", encode(decision))
        committed = StepEvent("done", 0, "bank", StepStatus.COMMITTED, NOW - 597_000)
        producer.produce(t.events, "done", encode(committed))
        producer.flush(30)
    yield settings
    delete_topics(settings, list(t.all))


# ---------------------------------------------------------------- could not run: exit 2


def test_kafka_unreachable(services: Services, tmp_path: Path) -> None:
    done = reconcile(services, "--bootstrap", "127.0.0.1:1", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "cannot reach Kafka" in one_sentence(done)


def test_topics_missing(services: Services, tmp_path: Path) -> None:
    done = reconcile(services, "--out", str(tmp_path), prefix=unique_name("absent"))
    assert done.returncode == 2
    assert "does not exist" in one_sentence(done)


def test_jars_folder_missing(topics: KafkaSettings, services: Services, tmp_path: Path) -> None:
    done = reconcile(
        services,
        "--jars-dir",
        str(tmp_path / "nowhere"),
        "--out",
        str(tmp_path),
        prefix=topics.prefix,
    )
    assert done.returncode == 2
    assert "jars folder" in one_sentence(done)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--grace", "soon"], "not a duration"),
        (["--ledger", "oracle://x"], "must start with sql:, mongo: or redis:"),
        (["--ledger", "sql:redis://h/0"], "postgres://, mariadb:// or mysql://"),
        (["--ledger", "redis:redis://h/0#colour=red"], "unknown option(s) colour"),
        (["--table", "accounts"], "must be NAME=KIND:URL"),
        (["--check", "nonsense"], "must be NAME=SQL"),
        (["--starting-offsets", "{"], "is not JSON"),
        (["--conf", "novalue"], "must be key=value"),
        (["--replay-rate", "0"], "positive number"),
    ],
)
def test_bad_options(services: Services, tmp_path: Path, args: list[str], says: str) -> None:
    done = reconcile(services, *args, "--out", str(tmp_path))
    assert done.returncode == 2
    assert says in one_sentence(done)


def test_store_unreachable(topics: KafkaSettings, services: Services, tmp_path: Path) -> None:
    done = reconcile(
        services,
        "--ledger",
        "redis:redis://127.0.0.1:1/0",
        "--out",
        str(tmp_path),
        prefix=topics.prefix,
    )
    assert done.returncode == 2
    assert "cannot reach redis redis://127.0.0.1:1/0" in one_sentence(done)


def test_usage_error_through_the_saga_command(services: Services, tmp_path: Path) -> None:
    """Registered under ``saga`` (``main.add_command(reconcile)``), a bad option still exits 2."""
    code = (
        "from saga.coordinator.cli import main, run; "
        "from saga.streams.reconcile.cli import reconcile; "
        "main.add_command(reconcile); run()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "reconcile", "--grace", "soon", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "not a duration" in one_sentence(done)


# ---------------------------------------------------------------- runs


def test_findings_exit_1_and_summary_json(
    topics: KafkaSettings, services: Services, tmp_path: Path
) -> None:
    done = reconcile(
        services, "--now-ms", str(NOW), "--out", str(tmp_path), "--json", prefix=topics.prefix
    )
    assert done.returncode == 1, done.stderr
    summary = json.loads(done.stdout)
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert {k: v for k, v in summary["classes"].items() if v} == {
        "stuck_no_decision": 1,
        "ok": 1,
    }
    assert summary["records"]["total"] == 6
    assert summary["replay"] == {
        "mode": "dry-run",
        "planned": 1,
        "decisions": 0,
        "requests": 1,
        "sent": 0,
    }
    assert summary["verdict"] == "stuck no decision: 1"


def test_spark_submit(topics: KafkaSettings, services: Services, tmp_path: Path) -> None:
    """The same job through spark-submit (the jars given with --jars, not --jars-dir)."""
    spark_submit = Path(sys.executable).parent / "spark-submit"
    env = dict(os.environ)
    env.update(
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SAGA_KAFKA_BOOTSTRAP=services.kafka_bootstrap,
        SAGA_TOPIC_PREFIX=topics.prefix,
    )
    env.pop("SAGA_SPARK_JARS", None)
    done = subprocess.run(
        [
            str(spark_submit),
            "--master",
            "local[2]",
            "--conf",
            "spark.ui.enabled=false",
            "--jars",
            ",".join(str(j) for j in services.spark_jars),
            str(ROOT / "streams" / "reconcile" / "__main__.py"),
            "--now-ms",
            str(NOW),
            "--out",
            str(tmp_path),
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["classes"]["stuck_no_decision"] == 1


def test_benchmark_command_runs(services: Services) -> None:
    """``python -m streams.reconcile.bench`` with a tiny log: reports records/s and wall time,
    and the job classifies every generated saga as generated."""
    environ = dict(os.environ)
    environ.update(
        SAGA_KAFKA_BOOTSTRAP=services.kafka_bootstrap,
        SAGA_SPARK_JARS=str(services.spark_jars_dir),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "saga.streams.reconcile.bench",
            "--sagas",
            "2000",
            "--driver-memory",
            "1g",
        ],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "records/s" in done.stdout
    assert "wall time" in done.stdout
    assert '"classes_as_generated": true' in done.stdout
