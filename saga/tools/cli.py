"""``saga demo`` and ``saga bench``: the tools' commands, attached to ``saga`` lazily.

:mod:`coordinator.cli` imports this module when one of the two commands is
named (or ``saga --help`` lists them); it imports only click and the core's
command-line helpers. The demo and the benchmark themselves (and their storage
drivers: SQLAlchemy, pymongo, redis) are imported when the command runs; when
they cannot be, the command says to install ``saga-olep[tools]`` and exits 2.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from saga.coordinator._cli_common import TOOLS_HINT, fail, kafka_options, settings_from

_F = TypeVar("_F", bound=Callable[..., Any])


def _seconds(name: str, default: float, text: str) -> Callable[[_F], _F]:
    """A ``--NAME SECONDS`` option of ``saga bench``: a positive duration, up to a day."""
    return click.option(
        name,
        type=click.FloatRange(0, 86_400, min_open=True),
        default=default,
        show_default=True,
        help=text,
    )


def _missing(command: str, exc: ImportError) -> NoReturn:
    """One sentence naming the module the tools lack, and exit 2."""
    what = exc.name or "a module of the tools"
    fail(f"saga {command} needs {what}, which is not installed; {TOOLS_HINT}", 2)


@click.command()
@kafka_options
@click.option("--sagas", type=click.IntRange(1, 1_000_000), default=2000, show_default=True)
@click.option(
    "--fail-share",
    type=click.FloatRange(0, 1),
    default=0.2,
    show_default=True,
    help="Share of sagas designed to fail (insufficient funds or out of stock).",
)
@click.option(
    "--postgres-url",
    envvar="SAGA_POSTGRES_URL",
    required=True,
    help="PostgreSQL for the ledger participant [env SAGA_POSTGRES_URL].",
)
@click.option(
    "--mongo-url",
    envvar="SAGA_MONGO_URL",
    required=True,
    help="MongoDB-wire server for the inventory participant [env SAGA_MONGO_URL].",
)
@click.option(
    "--redis-url",
    envvar="SAGA_REDIS_URL",
    required=True,
    help="Redis for the loyalty participant [env SAGA_REDIS_URL].",
)
@click.option(
    "--reconcile/--no-reconcile",
    "reconcile_after",
    default=True,
    show_default=True,
    help="End by auditing the demo's log and ledgers with `saga reconcile`.",
)
@click.option(
    "--setup-only",
    is_flag=True,
    help="Only create the topics (prefix: --prefix, SAGA_TOPIC_PREFIX or saga) and the "
    "demo's tables, collection and keys where they are missing (keeping what exists), then "
    "exit: how the compose app profile starts.",
)
@click.option(
    "--partitions",
    type=click.IntRange(1, 1024),
    default=4,
    show_default=True,
    help="Partitions of the topics the demo creates.",
)
def demo(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    sagas: int,
    fail_share: float,
    postgres_url: str,
    mongo_url: str | None,
    redis_url: str | None,
    reconcile_after: bool,
    setup_only: bool,
    partitions: int,
) -> None:
    """Run the demo workload end to end on running services and print a summary.

    `make demo` starts the local services and runs this. Each run uses fresh
    topics (prefix demo-<time> unless --prefix is given) and recreates the
    saga_demo schema, database and key prefix; at the end it prints the prefix
    and the `saga reconcile` command that audits the run again.
    """
    try:
        from rich.console import Console

        from saga.tools import require_drivers

        require_drivers()
        from saga.tools.demo import DemoConfig, run_demo
        from saga.tools.demo import setup_only as run_setup
    except ImportError as exc:
        _missing("demo", exc)

    # The workload runs on fresh topics; --setup-only prepares the deployment's own
    # (--prefix, SAGA_TOPIC_PREFIX or saga), as the compose app profile's services use.
    if prefix is None and not setup_only:
        prefix = f"demo-{int(time.time())}"
    settings = settings_from(bootstrap, prefix, kafka_config)
    cfg = DemoConfig(
        settings,
        postgres_url,
        mongo_url,
        redis_url,
        sagas=sagas,
        fail_share=fail_share,
        partitions=partitions,
        reconcile=reconcile_after,
    )
    sys.exit((run_setup if setup_only else run_demo)(cfg, Console()))


@click.command()
@kafka_options
@click.option(
    "--phases",
    default="main,latency,rollback,hot,direct,log",
    show_default=True,
    help="Comma-separated phases to run: main (closed loop, all commit), latency (open "
    "loop at --rate), rollback (closed loop, --rollback-fail-share rejected), hot (the "
    "main phase's loop with every step on one of 10 records per store), direct "
    "(direct-write baseline), log (log-bound baseline).",
)
@click.option(
    "--warmup",
    type=click.FloatRange(0, 3600),
    default=10.0,
    show_default=True,
    help="Seconds of load before each saga phase's measured window.",
)
@_seconds("--duration", 60.0, "Seconds measured in the main phase.")
@_seconds("--latency-duration", 30.0, "Seconds measured in the open-loop latency phase.")
@_seconds("--rollback-duration", 30.0, "Seconds measured in the rollback phase.")
@_seconds("--hot-duration", 30.0, "Seconds measured in the hot-record phase.")
@_seconds("--baseline-duration", 20.0, "Seconds of each baseline (direct writes, log bound).")
@click.option(
    "--rate",
    type=click.FloatRange(0, 1_000_000, min_open=True),
    default=400.0,
    show_default=True,
    help="Sagas per second offered in the open-loop latency phase.",
)
@click.option(
    "--window",
    type=click.IntRange(1, 1_000_000),
    default=1000,
    show_default=True,
    help="Sagas kept in flight by the closed-loop phases; the open loop sheds (does not "
    "send) the sagas due while this many are in flight.",
)
@click.option(
    "--fail-share",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Share of sagas designed to be rejected in the main and latency phases.",
)
@click.option(
    "--rollback-fail-share",
    type=click.FloatRange(0, 1),
    default=0.2,
    show_default=True,
    help="Share of sagas designed to be rejected in the rollback phase.",
)
@click.option(
    "--partitions",
    type=click.IntRange(1, 1024),
    default=4,
    show_default=True,
    help="Partitions of each phase's fresh topics.",
)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Worker processes per participant (on FerretDB, more than one Mongo worker "
    "may race on a document; the cross-store check would show it).",
)
@click.option(
    "--accounts",
    type=click.IntRange(1, 10_000_000),
    default=10_000,
    show_default=True,
    help="Accounts (rows, documents, hashes) per store.",
)
@click.option(
    "--batch",
    type=click.IntRange(1, 100_000),
    default=500,
    show_default=True,
    help="Writes per batch (one local transaction) in the direct-write baseline.",
)
@click.option(
    "--saga-timeout",
    type=click.FloatRange(0, 3600, min_open=True),
    default=60.0,
    show_default=True,
    help="Seconds until each saga's deadline.",
)
@click.option(
    "--settle",
    type=click.FloatRange(0, 3600),
    default=60.0,
    show_default=True,
    help="Before each saga phase, wait up to this many seconds until the services "
    "(Kafka, PostgreSQL, Redis, FerretDB) use at most 0.15 cores, so that the work left "
    "by the phase before (autovacuum, checkpoints, log cleaning) is not measured; 0: "
    "do not wait.",
)
@click.option(
    "--schema",
    "data_schema",
    default="saga_bench",
    show_default=True,
    help="PostgreSQL schema, MongoDB database and Redis key prefix of the bench's data "
    "(recreated per phase, dropped at the end).",
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False),
    default="reports/bench.json",
    show_default=True,
    help="Where to write the JSON report.",
)
@click.option(
    "--logs",
    type=click.Path(file_okay=False),
    default=".infra/logs/bench",
    show_default=True,
    help="Folder for the coordinator's and participants' logs.",
)
@click.option("--seed", type=int, default=7, show_default=True, help="Workload random seed.")
@click.option("--keep-topics", is_flag=True, help="Keep each phase's topics (for inspection).")
@click.option(
    "--signing",
    type=click.Choice(["off", "on", "both"]),
    default="off",
    show_default=True,
    help="Signed records: off; on (every saga phase with a key folder of its own); both "
    "(the main phase twice, without then with, side by side with the throughput ratio).",
)
@click.option(
    "--signing-rounds",
    type=click.IntRange(1, 20),
    default=1,
    show_default=True,
    help="With --signing both: run the unsigned and the signed main phase this many times "
    "each, alternately (unsigned, signed, signed, unsigned, ...), and pool them: a "
    "drift or a slow spell of the machine then weighs on both sides alike.",
)
@click.option(
    "--isolation",
    type=click.Choice(["read_committed", "none", "both"]),
    default="read_committed",
    show_default=True,
    help="The sagas' isolation level; both: the main and latency phases run at "
    "read_committed, then again at none, side by side with the throughput ratio, CPU per "
    "saga and open-loop latencies (the other phases at read_committed).",
)
@click.option(
    "--service-pid",
    "service_pid",
    multiple=True,
    metavar="NAME=PID",
    help="The pid of a service not started by infra/services.sh, for its CPU figures "
    "(NAME: kafka, postgres, redis, ferretdb or mariadb); repeatable.",
)
@click.option(
    "--layout",
    "layouts",
    multiple=True,
    metavar="LAYOUT",
    help="Which store each participant runs on: default (bank=postgres,wallet=ferretdb,"
    "rewards=redis), pg-wallet (the wallet on PostgreSQL too), mariadb-bank (the bank on "
    "MariaDB, --mariadb-url), or bank=STORE,wallet=STORE,rewards=STORE (STORE: postgres, "
    "ferretdb, redis, mariadb). Repeat it to run every phase on "
    "each layout in turn and compare them side by side [default: default].",
)
@click.option(
    "--profile",
    "profile_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Record every product process (coordinator, participants, the bench's client) "
    "with py-spy during each main phase into this folder: raw collapsed stacks (open them "
    "in speedscope or flamegraph.pl) and summary.txt, the top functions per process.",
)
@click.option(
    "--postgres-url",
    envvar="SAGA_POSTGRES_URL",
    required=True,
    help="PostgreSQL for the participants the layout puts there [env SAGA_POSTGRES_URL].",
)
@click.option(
    "--mongo-url",
    envvar="SAGA_MONGO_URL",
    required=True,
    help="MongoDB-wire server (FerretDB) for the participants the layout puts there "
    "[env SAGA_MONGO_URL].",
)
@click.option(
    "--redis-url",
    envvar="SAGA_REDIS_URL",
    required=True,
    help="Redis for the participants the layout puts there [env SAGA_REDIS_URL].",
)
@click.option(
    "--mariadb-url",
    envvar="SAGA_MARIADB_URL",
    default="",
    help="MariaDB or MySQL for the participants the layout puts there (mariadb-bank) "
    "[env SAGA_MARIADB_URL].",
)
def bench(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    phases: str,
    warmup: float,
    duration: float,
    latency_duration: float,
    rollback_duration: float,
    hot_duration: float,
    baseline_duration: float,
    rate: float,
    window: int,
    fail_share: float,
    rollback_fail_share: float,
    partitions: int,
    workers: int,
    accounts: int,
    batch: int,
    saga_timeout: float,
    settle: float,
    data_schema: str,
    report: str,
    logs: str,
    seed: int,
    keep_topics: bool,
    signing: str,
    signing_rounds: int,
    isolation: str,
    service_pid: tuple[str, ...],
    layouts: tuple[str, ...],
    profile_dir: str | None,
    postgres_url: str,
    mongo_url: str,
    redis_url: str,
    mariadb_url: str,
) -> None:
    """Measure sustained sagas/s and latencies against baselines measured in the same run.

    Starts a coordinator and three participants (each on the store --layout
    gives it) per saga phase on fresh topics (prefix bench-<time> unless --prefix
    is given), drives three-step transfer sagas, then measures the direct-write
    and log-bound baselines. With several --layout, every phase runs on each in
    turn. Prints tables and writes a JSON report.
    """
    from pathlib import Path

    try:
        from rich.console import Console

        from saga.tools import require_drivers

        require_drivers()
        from saga.tools.bench import BenchConfig, run_bench
        from saga.tools.bench.config import DEFAULT_LAYOUT, parse_layout
    except ImportError as exc:
        _missing("bench", exc)

    pids: dict[str, int] = {}
    for item in service_pid:
        name, _, pid = item.partition("=")
        if not pid.strip().isdigit():
            raise click.BadParameter(f"{item!r} is not NAME=PID", param_hint="--service-pid")
        pids[name.strip()] = int(pid)
    settings = settings_from(bootstrap, prefix or f"bench-{int(time.time())}", kafka_config)
    cfg = BenchConfig(
        settings,
        postgres_url,
        mongo_url,
        redis_url,
        phases=tuple(p.strip() for p in phases.split(",") if p.strip()),
        warmup=warmup,
        duration=duration,
        latency_duration=latency_duration,
        rollback_duration=rollback_duration,
        hot_duration=hot_duration,
        baseline_duration=baseline_duration,
        rate=rate,
        window=window,
        fail_share=fail_share,
        rollback_fail_share=rollback_fail_share,
        partitions=partitions,
        workers=workers,
        accounts=accounts,
        batch=batch,
        saga_timeout=saga_timeout,
        settle_timeout=settle,
        schema=data_schema,
        report=Path(report),
        logs=Path(logs),
        seed=seed,
        keep_topics=keep_topics,
        signing=signing,
        signing_rounds=signing_rounds,
        isolation=isolation,
        service_pids=pids,
        layouts=tuple(parse_layout(t) for t in layouts) or (DEFAULT_LAYOUT,),
        profile=None if profile_dir is None else Path(profile_dir),
        mariadb_url=mariadb_url,
    )
    sys.exit(run_bench(cfg, Console()))
