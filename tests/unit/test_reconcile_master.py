"""``saga reconcile`` on a cluster, the parts that need no service: which Python the
executors start, when the driver binds to loopback, store URLs read from the
environment (so that no password is on the command line), and the options."""

from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from saga.streams import ConfigurationError, KafkaSettings
from saga.streams.reconcile import ReconcileConfig, parse_ledger, parse_table
from saga.streams.reconcile._spark import executor_python, kafka_options, on_loopback
from saga.streams.reconcile.cli import reconcile

pytestmark = pytest.mark.unit

SECRET = "s3cret-Pa55word"
ENV = {
    "PG": f"postgresql://saga:{SECRET}@db.example:5432/saga",
    "REDIS": f"redis://:{SECRET}@cache.example:6379",
}


@pytest.mark.parametrize(
    ("master", "loopback"),
    [
        ("local[*]", True),
        ("local", True),
        ("spark://127.0.0.1:17077", True),
        ("spark://localhost:7077", True),
        ("spark://[::1]:7077", True),
        ("spark://127.0.0.1:7077,127.0.0.1:7078", True),
        ("spark://10.0.0.5:7077", False),
        ("spark://spark-master.internal:7077", False),
        ("yarn", False),
    ],
)
def test_which_masters_are_on_loopback(master: str, loopback: bool) -> None:
    assert on_loopback(master) is loopback


def test_executors_start_this_python_unless_told() -> None:
    env = {"PYSPARK_PYTHON": "/opt/venv/bin/python"}
    conf = {"spark.pyspark.python": "/srv/saga/bin/python"}
    # local: this very interpreter, whatever the settings (it has the package)
    assert executor_python("local[*]", conf, env) == sys.executable
    cluster = "spark://127.0.0.1:17077"
    assert executor_python(cluster, {}, {}) == sys.executable
    assert executor_python(cluster, {}, env) == "/opt/venv/bin/python"
    assert executor_python(cluster, conf, env) == "/srv/saga/bin/python"


@pytest.mark.parametrize("spec", ["sql:$PG#schema=bank", "sql:${PG}#schema=bank"])
def test_a_store_url_from_the_environment(spec: str) -> None:
    ledger = parse_ledger(spec, ENV)
    assert ledger.store.url == ENV["PG"]
    assert ledger.store.options == {"schema": "bank"}
    assert SECRET not in ledger.label


def test_a_table_url_from_the_environment_keeps_the_rest_of_the_url() -> None:
    table = parse_table("points=redis:${REDIS}/2#prefix=shop", ENV)
    assert table.store.url == ENV["REDIS"] + "/2"
    assert table.store.options == {"prefix": "shop", "target": "points"}


def test_an_unset_variable_says_so_without_a_value() -> None:
    with pytest.raises(ConfigurationError, match=r"reads the URL from \$NOPE, which is not set"):
        parse_ledger("sql:$NOPE#schema=bank", ENV)


def test_a_variable_holding_the_wrong_kind_of_url_never_shows_its_password() -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_ledger("mongo:$PG", ENV)
    assert "needs a mongodb://" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_the_command_fails_in_one_sentence_on_an_unset_variable() -> None:
    done = CliRunner().invoke(
        reconcile,
        ["--bootstrap", "127.0.0.1:1", "--ledger", "sql:$NOPE#schema=bank"],
        env={"NOPE": ""},
    )
    assert done.exit_code == 2
    assert done.output.strip().startswith("saga reconcile: --ledger reads the URL from $NOPE")
    assert "Traceback" not in done.output


def test_the_command_takes_the_master_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from saga.streams.reconcile import _job

    def run(config: ReconcileConfig, **_: object) -> None:
        # Stop before Spark: say what the job was asked to do.
        raise ConfigurationError(f"master={config.master} memory={config.executor_memory}")

    monkeypatch.setattr(_job, "run", run)
    runner = CliRunner()
    args = ["--bootstrap", "127.0.0.1:1", "--executor-memory", "3g"]
    done = runner.invoke(reconcile, args, env={"SAGA_SPARK_MASTER": "spark://10.1.2.3:7077"})
    assert done.output.strip() == "saga reconcile: master=spark://10.1.2.3:7077 memory=3g"
    done = runner.invoke(reconcile, [*args, "--master", "local[2]"])
    assert done.output.strip() == "saga reconcile: master=local[2] memory=3g"


def test_the_kafka_source_does_not_wait_long_on_an_empty_fetch_unless_told_to() -> None:
    """Each task's last fetch (transaction markers only) waits fetch.max.wait.ms."""
    plain = kafka_options(KafkaSettings(bootstrap="k:9092", prefix="p"))
    assert plain["kafka.isolation.level"] == "read_committed"
    assert int(plain["kafka.fetch.max.wait.ms"]) <= 50
    told = kafka_options(
        KafkaSettings(bootstrap="k:9092", prefix="p", extra={"fetch.max.wait.ms": "200"})
    )
    assert told["kafka.fetch.max.wait.ms"] == "200"
