"""``saga reconcile``: the command (also ``python -m streams.reconcile`` and ``spark-submit``).

The ``saga`` command line registers it with ``main.add_command(reconcile)``.
Expected failures print one sentence on stderr and exit 2; findings exit 1.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from pathlib import Path

import click

from saga.streams._errors import ConfigurationError, SagaError
from saga.streams.kafka import KafkaSettings
from saga.streams.reconcile._config import (
    DEFAULT_GRACE_MS,
    ReconcileConfig,
    parse_check,
    parse_duration_ms,
    parse_ledger,
    parse_offsets,
    parse_since,
    parse_table,
    spark_conf_pairs,
)

__all__ = ["main", "reconcile"]

_EPILOG = """\b
Examples:
  saga reconcile                                   # audit everything, dry run
  saga reconcile --replay                          # ... and re-publish what is stuck
  saga reconcile --since 2h --grace 5m
  saga reconcile \\
    --ledger 'sql:postgresql://saga:saga@127.0.0.1:15432/saga#schema=bank' \\
    --ledger 'redis:redis://127.0.0.1:16379/0#prefix=saga' \\
    --table 'accounts=sql:postgresql://saga:saga@127.0.0.1:15432/saga#schema=bank' \\
    --check 'money=SELECT sum(balance) = 200000 AS ok, sum(balance) AS total FROM accounts'
  saga reconcile --master spark://127.0.0.1:17077 \\
    --ledger 'sql:$SAGA_POSTGRES_URL#schema=bank'  # the job reads the URL (and password)

\b
Store specs: KIND:URL#key=value&... with KIND sql (schema, table), mongo
(database, collection) or redis (prefix, target); ledgers also take
participants=a,b. URL may be $NAME, an environment variable the job reads
(single-quote the spec: no password then reaches the process list). A check
holds when its query returns no row, or, if it has a boolean column ok, when
ok is true in every row it returns.

\b
Exit status: 0 clean; 1 violations, early effects, stuck sagas or a failed check;
2 the job could not run (Kafka, a topic, the jars, a store or an option).
"""


@click.command(
    "reconcile",
    epilog=_EPILOG,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "--bootstrap", default=None, help="Kafka bootstrap servers [env SAGA_KAFKA_BOOTSTRAP]."
)
@click.option("--prefix", default=None, help="Topic prefix [env SAGA_TOPIC_PREFIX; default: saga].")
@click.option(
    "--kafka-config",
    type=click.Path(dir_okay=False),
    default=None,
    help="File of key=value Kafka client settings (security.protocol, sasl.*, ssl.*).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("reports/reconcile"),
    show_default=True,
    help="Folder for findings/ (Parquet), summary.json and replay.jsonl.",
)
@click.option(
    "--master",
    envvar="SAGA_SPARK_MASTER",
    default=None,
    metavar="URL",
    help="Spark master URL, e.g. spark://127.0.0.1:17077 for infra/spark-cluster.sh's cluster "
    "[env SAGA_SPARK_MASTER; default: local[*]].",
)
@click.option(
    "--jars-dir",
    type=click.Path(path_type=Path),
    envvar="SAGA_SPARK_JARS",
    default=None,
    help="Folder with spark-sql-kafka-0-10 and its dependencies [env SAGA_SPARK_JARS].",
)
@click.option(
    "--since",
    default=None,
    metavar="WHEN",
    help="Audit only records since then: 30m, 2h, 1d, an ISO 8601 time or epoch ms.",
)
@click.option(
    "--starting-offsets",
    default=None,
    metavar="JSON",
    help='Spark offsets JSON: {"saga.events": {"0": 42}}.',
)
@click.option(
    "--ending-offsets",
    default=None,
    metavar="JSON",
    help="Spark offsets JSON; default: the end now.",
)
@click.option(
    "--grace",
    metavar="DURATION",
    default=f"{DEFAULT_GRACE_MS // 1000}s",
    show_default=True,
    help="How long after a deadline or a decision a saga may still finish on its own.",
)
@click.option(
    "--now-ms",
    type=int,
    default=None,
    metavar="MS",
    help="The audit's 'now' (epoch ms) [default: clock].",
)
@click.option(
    "--ledger",
    "ledgers",
    multiple=True,
    metavar="SPEC",
    help="A ledger (KIND:URL#options) to cross-check (I4, I7).",
)
@click.option(
    "--table",
    "tables",
    multiple=True,
    metavar="NAME=SPEC",
    help="A store table, seen by --check as the view NAME.",
)
@click.option(
    "--check",
    "checks",
    multiple=True,
    metavar="NAME=SQL",
    help="A business invariant (I5): Spark SQL, or @FILE.",
)
@click.option(
    "--replay/--dry-run",
    default=False,
    show_default=True,
    help="Re-publish the request of each stuck_no_decision saga and the decision of each "
    "stuck_unfinished one (the dry run only lists them).",
)
@click.option(
    "--replay-rate",
    type=float,
    metavar="N",
    default=None,
    help="At most this many replayed records per second, each acknowledged before the next.",
)
@click.option(
    "--keys-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="SAGA_KEYS_DIR",
    default=None,
    help="Key folder (signed records): a record not signed by a principal allowed to write "
    "it is invalid, like one that breaks the contract [env SAGA_KEYS_DIR; default: "
    "signatures not checked].",
)
@click.option("--all", "write_all", is_flag=True, help="Write every transaction, ok ones too.")
@click.option(
    "--show",
    type=click.IntRange(0, 10_000),
    default=20,
    show_default=True,
    metavar="N",
    help="Findings to print (all of them are in findings/).",
)
@click.option("--driver-memory", default="2g", show_default=True, help="Spark driver memory.")
@click.option(
    "--executor-memory",
    default=None,
    metavar="SIZE",
    help="Memory per executor on a cluster, e.g. 1g [default: Spark's, 1g].",
)
@click.option(
    "--shuffle-partitions",
    type=click.IntRange(1, 100_000),
    default=None,
    metavar="N",
    help="Spark SQL shuffle partitions [default: from the log's size: 2 for a small "
    "log, up to 8 for millions of records].",
)
@click.option(
    "--conf",
    "conf",
    multiple=True,
    metavar="KEY=VALUE",
    help="key=value: any Spark setting (never a secret: Spark settings show in process lists).",
)
@click.option("--json", "as_json", is_flag=True, help="Print summary.json instead of the tables.")
@click.option("-v", "--verbose", count=True, help="Spark warnings and more log lines.")
def reconcile(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    out: Path,
    master: str | None,
    jars_dir: Path | None,
    since: str | None,
    starting_offsets: str | None,
    ending_offsets: str | None,
    grace: str,
    now_ms: int | None,
    ledgers: tuple[str, ...],
    tables: tuple[str, ...],
    checks: tuple[str, ...],
    replay: bool,
    replay_rate: float | None,
    keys_dir: Path | None,
    write_all: bool,
    show: int,
    driver_memory: str,
    executor_memory: str | None,
    shuffle_partitions: int | None,
    conf: tuple[str, ...],
    as_json: bool,
    verbose: int,
) -> None:
    """Audit the saga log (and the participants' ledgers) with Spark; replay stuck sagas.

    Reads requests, events and decisions (and the dead letters) as a batch,
    checks invariants I1-I4, I6 and I7 per transaction, classifies each as ok,
    in_flight, stuck_no_decision, stuck_unfinished, compensation_failed,
    resolved_by_hand, early_effect or violation, writes the findings as Parquet with a JSON
    summary, and prints a summary table and the operator actions (aborts,
    resolves, redrives). With --replay it re-publishes what stuck sagas miss.
    """
    started = time.monotonic()
    try:
        settings = KafkaSettings.from_sources(bootstrap, prefix, kafka_config, os.environ)
        clock = now_ms if now_ms is not None else time.time_ns() // 1_000_000
        config = ReconcileConfig(
            settings=settings,
            out=out,
            jars_dir=jars_dir,
            master=master,
            grace_ms=parse_duration_ms(grace, "--grace"),
            now_ms=now_ms,
            since_ms=parse_since(since, clock) if since else None,
            starting_offsets=parse_offsets(starting_offsets, "--starting-offsets")
            if starting_offsets
            else None,
            ending_offsets=parse_offsets(ending_offsets, "--ending-offsets")
            if ending_offsets
            else None,
            ledgers=tuple(parse_ledger(s) for s in ledgers),
            tables=tuple(parse_table(s) for s in tables),
            checks=tuple(parse_check(s) for s in checks),
            replay=replay,
            replay_rate=replay_rate,
            keys_dir=keys_dir,
            write_all=write_all,
            show=show,
            driver_memory=driver_memory,
            executor_memory=executor_memory,
            shuffle_partitions=shuffle_partitions,
            spark_conf=spark_conf_pairs(conf),
            verbose=verbose,
        )
        _require_spark(config)
        from saga.streams.reconcile._job import run

        def say(line: str) -> None:
            click.echo(f"saga reconcile: [{time.monotonic() - started:5.1f}s] {line}", err=True)

        result = run(config, started=started, say=say)
    except ConfigurationError as exc:
        _fail(str(exc))
    except SagaError as exc:  # e.g. Kafka failing mid-run
        _fail(str(exc))
    except KeyboardInterrupt:
        sys.exit(130)
    if as_json:
        import json

        click.echo(json.dumps(result.summary, indent=2))
    else:
        from rich.console import Console

        from saga.streams.reconcile._report import render

        render(Console(), result.summary, result.shown)
    sys.exit(result.exit_code)


SPARK_HINT = "pip install 'saga-olep[spark]'"

# The module each store kind's reader imports (PostgreSQL's ledger check uses psycopg).
_STORE_DRIVERS = {"sql": "psycopg", "mongo": "pymongo", "redis": "redis"}


def _require_spark(config: ReconcileConfig) -> None:
    """Import pyspark and the drivers of the stores named; a missing one names the extra.

    Raises:
        ConfigurationError: "the audit needs the spark extra ...": the spark extra
            brings pyspark and every store reader's driver.
    """
    kinds = {s.store.kind for s in config.ledgers} | {t.store.kind for t in config.tables}
    for module in ("pyspark", *sorted(_STORE_DRIVERS[k] for k in kinds)):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigurationError(
                f"the audit needs the spark extra ({exc.name or module} is not "
                f"installed): {SPARK_HINT}"
            ) from None


def _fail(message: str) -> None:
    click.echo(f"saga reconcile: {message}", err=True)
    sys.exit(2)


def main() -> None:
    """``python -m streams.reconcile`` / ``spark-submit streams/reconcile/__main__.py``."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    reconcile.main(prog_name="saga reconcile")
