"""The ``saga`` command line.

Every command takes the Kafka address from ``--bootstrap`` or
``SAGA_KAFKA_BOOTSTRAP``, the topic prefix from ``--prefix`` or
``SAGA_TOPIC_PREFIX`` (default ``saga``), and Kafka client settings (SASL, TLS)
from ``--kafka-config FILE`` (``key=value`` lines) or ``SAGA_KAFKA_<NAME>``
variables. Expected failures print one sentence and exit non-zero (2 for bad
usage or input); there are no stack traces for them. No message or log line
shows a password: storage URLs' passwords and Kafka settings named like
``sasl.password`` are redacted (:mod:`streams._secrets`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from streams import (
    ConfigurationError,
    ConflictingRequest,
    InvalidRecord,
    SagaError,
    SagaTimeout,
    schema,
    to_dict,
)
from streams._kafka import KafkaSettings, create_topics, wait_for_broker
from streams._secrets import install_log_redaction, redact, remember_settings, url_password

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_CONNECT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 1_000_000_000  # as coordinator._client.MAX_TIMEOUT_S (not imported: start-up cost)


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"saga: {redact(message)}", err=True)
    sys.exit(code)


class Seconds(click.FloatRange):
    """A positive, finite number of seconds (click's FLOAT accepts nan and inf)."""

    name = "seconds"

    def __init__(self, maximum: float = MAX_TIMEOUT_S) -> None:
        super().__init__(0, maximum, min_open=True)
        self.maximum = maximum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = math.nan
        if not (math.isfinite(seconds) and 0 < seconds <= self.maximum):
            self.fail(
                f"{value!r} is not a positive number of seconds (at most {self.maximum:,.0f}); "
                "give one such as 30",
                param,
                ctx,
            )
        return seconds


def connect_timeout_option(fn: F) -> F:
    return click.option(
        "--connect-timeout",
        type=Seconds(3600),
        default=DEFAULT_CONNECT_TIMEOUT_S,
        show_default=True,
        envvar="SAGA_CONNECT_TIMEOUT",
        help="Seconds to wait at start-up for Kafka to answer before exiting with one "
        "sentence [env SAGA_CONNECT_TIMEOUT].",
    )(fn)


def _parse_retention(_ctx: click.Context, _param: click.Parameter, value: str) -> int:
    from streams._duration import parse_duration_ms

    try:
        return parse_duration_ms(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--retention") from None


def retention_option(what: str) -> Callable[[F], F]:
    """``--retention`` (a duration) as ``retention_ms``; the same default everywhere."""
    from streams._duration import DEFAULT_RETENTION

    return click.option(
        "--retention",
        "retention_ms",
        default=DEFAULT_RETENTION,
        show_default=True,
        callback=_parse_retention,
        help=f"{what} (90s, 30m, 12h, 7d); use one value for the coordinator and "
        "every participant.",
    )


def kafka_options(fn: F) -> F:
    fn = click.option(
        "--kafka-config",
        type=click.Path(dir_okay=False),
        default=None,
        help="File of key=value Kafka client settings (security.protocol, sasl.*, ssl.*).",
    )(fn)
    fn = click.option(
        "--prefix", default=None, help="Topic prefix [env SAGA_TOPIC_PREFIX; default: saga]."
    )(fn)
    fn = click.option(
        "--bootstrap", default=None, help="Kafka bootstrap servers [env SAGA_KAFKA_BOOTSTRAP]."
    )(fn)
    return fn


def settings_from(
    bootstrap: str | None, prefix: str | None, kafka_config: str | None
) -> KafkaSettings:
    settings = KafkaSettings.from_sources(bootstrap, prefix, kafka_config, os.environ)
    # sasl.password, ssl.key.password, ...: never shown by a message or log line.
    remember_settings(settings.extra)
    return settings


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
    """saga: all-or-nothing changes across PostgreSQL, MongoDB and Redis through Kafka.

    Start with `saga topics create`, then run `saga coordinator run` and one
    `saga participant run` per storage, and submit sagas with `saga submit` or
    the client library.
    """
    from streams import _faults

    _faults.configure(os.environ.get("SAGA_FAULTS"))
    # Test-only: the chaos suite's negative controls (streams/_faults.py); never set in production.
    _faults.configure_unsafe(os.environ.get("SAGA_UNSAFE_TEST_SWITCHES"))
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    if os.environ.get("SAGA_UNSAFE_TEST_SWITCHES"):
        logging.getLogger("saga").warning(
            "unsafe test switches on (%s): guarantees are broken on purpose",
            os.environ["SAGA_UNSAFE_TEST_SWITCHES"],
        )


# ---------------------------------------------------------------- topics


@main.group()
def topics() -> None:
    """Create the saga topics."""


@topics.command("create")
@kafka_options
@click.option(
    "--partitions",
    type=click.IntRange(1, 1024),
    default=8,
    show_default=True,
    help="Partitions per topic: the unit of parallelism.",
)
@click.option("--replication-factor", type=click.IntRange(1, 16), default=1, show_default=True)
@retention_option("The coordinator's retention: the status topic keeps records twice as long")
def topics_create(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    partitions: int,
    replication_factor: int,
    retention_ms: int,
) -> None:
    """Create requests, events, decisions, status (compacted) and dlq with one partition count."""
    settings = settings_from(bootstrap, prefix, kafka_config)
    created = create_topics(settings, partitions, replication_factor, retention_ms=retention_ms)
    for name in settings.topics.all:
        click.echo(
            f"{name}: {'created' if name in created else 'exists'} ({partitions} partitions)"
        )


# ---------------------------------------------------------------- coordinator


@main.group()
def coordinator() -> None:
    """Run the coordinator service."""


@coordinator.command("run")
@kafka_options
@click.option(
    "--instance-id",
    default="0",
    show_default=True,
    help="Stable and unique per coordinator process; names its transactional producer.",
)
@click.option(
    "--participants",
    default=None,
    help="Comma-separated names of the participants that exist; a request naming "
    "another rolls back at once (default: accept any name).",
)
@retention_option("Forget sagas (memory, status topic) finished longer ago than this")
@connect_timeout_option
def coordinator_run(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    instance_id: str,
    participants: str | None,
    retention_ms: int,
    connect_timeout: float,
) -> None:
    """Consume requests and step events, decide commit or rollback, publish status.

    Sagas that ended committed or rolled back are forgotten --retention after their
    deadline and last change; a request whose deadline passed longer ago than that
    goes to the DLQ as expired.
    """
    from coordinator._service import CoordinatorService

    known = (
        frozenset(p.strip() for p in participants.split(",") if p.strip()) if participants else None
    )
    settings = settings_from(bootstrap, prefix, kafka_config)
    wait_for_broker(settings, timeout=connect_timeout)
    service = CoordinatorService(
        settings, instance_id=instance_id, participants=known, retention_ms=retention_ms
    )
    service.install_signal_handlers()
    service.run()


# ---------------------------------------------------------------- participant


@main.group()
def participant() -> None:
    """Run a participant worker for one storage."""


@participant.command("run")
@kafka_options
@click.option("--name", required=True, help="Participant name, as steps name it.")
@click.option("--storage", type=click.Choice(["sql", "mongo", "redis"]), required=True)
@click.option(
    "--url",
    default=None,
    help="Storage URL: postgresql://user:password@host:5432/db, sqlite:///file.db, "
    "mongodb://user:password@host:27017/db or redis://:password@host:6379/0. Every local "
    "user can read a command line (ps): give a URL with a password through --url-file, "
    "--url-env or SAGA_STORAGE_URL instead, or its password through --password-file.",
)
@click.option(
    "--url-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Read the storage URL from the first line of this file (e.g. a mounted secret).",
)
@click.option(
    "--url-env",
    metavar="NAME",
    default=None,
    help="Read the storage URL from the environment variable NAME (e.g. SAGA_POSTGRES_URL).",
)
@click.option(
    "--password-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Read the storage password from the first line of this file; it replaces the "
    "URL's password.",
)
@click.option(
    "--targets",
    required=True,
    help="Comma-separated allow-list of tables / collections / key prefixes.",
)
@click.option("--handlers", default=None, help="Dotted path of a module with custom HANDLERS.")
@click.option("--schema", "db_schema", default=None, help="SQL schema of the tables and ledger.")
@retention_option("Remove ledger entries of transactions finished longer ago than this")
@connect_timeout_option
def participant_run(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    name: str,
    storage: str,
    url: str | None,
    url_file: str | None,
    url_env: str | None,
    password_file: str | None,
    targets: str,
    handlers: str | None,
    db_schema: str | None,
    retention_ms: int,
    connect_timeout: float,
) -> None:
    """Apply this participant's steps, confirm on commit, compensate on rollback.

    The storage URL comes from one of --url, --url-file or --url-env, else from
    the SAGA_STORAGE_URL environment variable; --password-file sets its password.
    No message or log line shows the password. An authentication failure of the
    storage exits with code 2; Kafka not answering within --connect-timeout
    seconds exits with code 1.
    """
    from participants import ParticipantRuntime, open_storage
    from participants._open import storage_url

    if url is not None and url_password(url):
        logging.getLogger("saga.participant").warning(
            "the storage password is on the command line, where every local user can read "
            "it (ps); pass the URL with --url-file, --url-env or SAGA_STORAGE_URL instead"
        )
    resolved = storage_url(
        url=url, url_file=url_file, url_env=url_env, password_file=password_file, environ=os.environ
    )
    settings = settings_from(bootstrap, prefix, kafka_config)
    target_list = [t.strip() for t in targets.split(",") if t.strip()]
    store = open_storage(
        storage, name=name, url=resolved, targets=target_list, handlers=handlers, schema=db_schema
    )
    wait_for_broker(settings, timeout=connect_timeout)
    runtime = ParticipantRuntime(name, store, settings, retention_ms=retention_ms)
    runtime.install_signal_handlers()
    runtime.run()


# ---------------------------------------------------------------- client commands


class _NotANumber(ValueError):
    def __init__(self, literal: str) -> None:
        super().__init__(literal)
        self.literal = literal


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NotANumber(literal)
    return value


def _no_constant(literal: str) -> Any:
    raise _NotANumber(literal)


def _read_submission(source: str) -> dict[str, Any]:
    """The submission object of ``source`` (a path, or - for standard input).

    Raises :class:`ConfigurationError` (exit 2) naming what to fix.
    """
    where = "standard input" if source == "-" else source
    try:
        if source == "-":
            raw = sys.stdin.buffer.read()
        else:
            with open(source, "rb") as handle:
                raw = handle.read()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read {where}: {exc.strerror or exc}; give the path of a JSON file, "
            "or - for standard input"
        ) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigurationError(
            f"{where} is not UTF-8 text (byte {exc.start} cannot be decoded); save the "
            "submission as UTF-8 JSON"
        ) from exc
    try:
        data = json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except _NotANumber as exc:
        problem = (
            "which is not JSON"
            if exc.literal in ("NaN", "Infinity", "-Infinity")
            else "which is too large for a 64-bit number"
        )
        raise ConfigurationError(
            f"{where} holds {exc.literal}, {problem}; write a finite number such as 30"
        ) from exc
    except json.JSONDecodeError as exc:
        raise ConfigurationError(
            f"{where} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}; "
            "fix the JSON"
        ) from exc
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise ConfigurationError(
            f"{where} must hold an object with a 'steps' list of "
            '{"participant": ..., "action": ..., "args": {...}} objects'
        )
    if "meta" in data and data["meta"] is not None and not isinstance(data["meta"], dict):
        raise ConfigurationError(
            f"{where}: meta must be an object of names to values, such as "
            f'{{"trace": "abc"}}, not {_json_type(data["meta"])}'
        )
    if "timeout_s" in data:
        _check_seconds(data["timeout_s"], f"{where}: timeout_s")
    return data


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _check_seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(
            f"{what} must be a number of seconds such as 30, not {json.dumps(value)}"
        )
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ConfigurationError(
            f"{what} must be a positive number of seconds, at most {MAX_TIMEOUT_S:,}; "
            f"got {json.dumps(value)}"
        )
    return float(value)


@main.command()
@kafka_options
@click.argument("source", default="-")
@click.option("--wait/--no-wait", default=False, help="Wait for the final status and print it.")
@click.option(
    "--timeout",
    type=Seconds(),
    default=None,
    help="Seconds until the saga's deadline (overrides the file's timeout_s; default 30).",
)
def submit(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    source: str,
    wait: bool,
    timeout: float | None,
) -> None:
    """Submit a saga from a JSON file (or - for stdin); prints its tx_id.

    The JSON object has `steps` (list of {participant, action, args}) and
    optionally `saga`, `mode` (parallel|sequential), `timeout_s`, `tx_id`, `meta`.
    """
    from coordinator._client import DEFAULT_TIMEOUT_S, SagaClient, build_request

    data = _read_submission(source)
    deadline_s = timeout if timeout is not None else float(data.get("timeout_s", DEFAULT_TIMEOUT_S))
    settings = settings_from(bootstrap, prefix, kafka_config)
    try:
        # Checked before connecting: bad input is a usage error, whatever Kafka's state.
        request = build_request(
            data["steps"],
            saga=str(data.get("saga", "saga")),
            mode=data.get("mode", "parallel"),
            timeout=deadline_s,
            tx_id=data.get("tx_id"),
            meta=data.get("meta"),
        )
    except InvalidRecord as exc:
        where = "standard input" if source == "-" else source
        raise ConfigurationError(f"{where}: {exc.reason}") from exc
    with SagaClient(settings, status_from_beginning=False) as client:
        client.send(request)
        tx_id = request.tx_id
        click.echo(tx_id)
        if wait:
            status = client.result(tx_id, timeout=deadline_s + 30)
            click.echo(json.dumps(to_dict(status), indent=2))
            if status.state != "committed":
                sys.exit(3)


@main.command()
@kafka_options
@click.argument("tx_id")
def status(bootstrap: str | None, prefix: str | None, kafka_config: str | None, tx_id: str) -> None:
    """Print the latest status of a transaction (reads the status topic)."""
    from coordinator._client import StatusView

    view = StatusView(settings_from(bootstrap, prefix, kafka_config), from_beginning=True)
    try:
        view.wait_caught_up(60)
        found = view.get(tx_id)
    finally:
        view.close()
    if found is None:
        _fail(f"no status for transaction {tx_id}: the coordinator has not seen it (yet)")
    click.echo(json.dumps(to_dict(found), indent=2))


@main.command()
@kafka_options
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds per refresh.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit (for scripts).")
def watch(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    interval: float,
    once: bool,
) -> None:
    """A live view of the status topic: counts per state and the latest transactions."""
    from rich.console import Group
    from rich.live import Live
    from rich.table import Table

    from coordinator._client import StatusView

    view = StatusView(settings_from(bootstrap, prefix, kafka_config), from_beginning=True)

    def render() -> Group:
        snap = view.snapshot()
        counts = Counter(s.state.value for s in snap.values())
        summary = Table(title=f"saga status ({len(snap)} transactions)")
        for state in (
            "pending",
            "committing",
            "committed",
            "rolling_back",
            "rolled_back",
            "failed",
        ):
            summary.add_column(state, justify="right")
        summary.add_row(
            *(
                str(counts.get(s, 0))
                for s in (
                    "pending",
                    "committing",
                    "committed",
                    "rolling_back",
                    "rolled_back",
                    "failed",
                )
            )
        )
        latest = Table(title="latest")
        for col in ("tx_id", "saga", "state", "steps", "reason"):
            latest.add_column(col)
        for s in sorted(snap.values(), key=lambda s: s.updated_ms, reverse=True)[:15]:
            steps = " ".join(f"{p.participant}:{p.status.value}" for p in s.steps)
            latest.add_row(s.tx_id, s.saga, s.state.value, steps, s.reason or "")
        return Group(summary, latest)

    try:
        view.wait_caught_up(60)
        if once:
            from rich.console import Console

            Console().print(render())
            return
        with Live(render(), refresh_per_second=4) as live:
            while True:
                time.sleep(interval)
                live.update(render())
    except KeyboardInterrupt:
        pass
    finally:
        view.close()


@main.command()
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
) -> None:
    """Run the demo workload end to end on running services and print a summary.

    `make demo` starts the local services and runs this. Each run uses fresh
    topics (prefix demo-<time> unless --prefix is given) and recreates the
    saga_demo schema, database and key prefix.
    """
    from rich.console import Console

    from coordinator._demo import DemoConfig, run_demo

    settings = settings_from(bootstrap, prefix or f"demo-{int(time.time())}", kafka_config)
    cfg = DemoConfig(
        settings,
        postgres_url,
        mongo_url,
        redis_url,
        sagas=sagas,
        fail_share=fail_share,
        reconcile=reconcile_after,
    )
    sys.exit(run_demo(cfg, Console()))


@main.command()
@kafka_options
@click.option(
    "--phases",
    default="main,latency,rollback,direct,log",
    show_default=True,
    help="Comma-separated phases to run: main (closed loop, all commit), latency (open "
    "loop at --rate), rollback (closed loop, --rollback-fail-share rejected), direct "
    "(direct-write baseline), log (log-bound baseline).",
)
@click.option(
    "--warmup",
    type=click.FloatRange(0, 3600),
    default=10.0,
    show_default=True,
    help="Seconds of load before each saga phase's measured window.",
)
@click.option(
    "--duration",
    type=click.FloatRange(0, 86_400, min_open=True),
    default=60.0,
    show_default=True,
    help="Seconds measured in the main phase.",
)
@click.option(
    "--latency-duration",
    type=click.FloatRange(0, 86_400, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds measured in the open-loop latency phase.",
)
@click.option(
    "--rollback-duration",
    type=click.FloatRange(0, 86_400, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds measured in the rollback phase.",
)
@click.option(
    "--baseline-duration",
    type=click.FloatRange(0, 86_400, min_open=True),
    default=20.0,
    show_default=True,
    help="Seconds of each baseline (direct writes, log bound).",
)
@click.option(
    "--rate",
    type=click.FloatRange(0, 1_000_000, min_open=True),
    default=500.0,
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
    "--service-pid",
    "service_pid",
    multiple=True,
    metavar="NAME=PID",
    help="The pid of a service not started by infra/services.sh, for its CPU figures "
    "(NAME: kafka, postgres, redis or ferretdb); repeatable.",
)
@click.option(
    "--postgres-url",
    envvar="SAGA_POSTGRES_URL",
    required=True,
    help="PostgreSQL for the bank participant [env SAGA_POSTGRES_URL].",
)
@click.option(
    "--mongo-url",
    envvar="SAGA_MONGO_URL",
    required=True,
    help="MongoDB-wire server for the wallet participant [env SAGA_MONGO_URL].",
)
@click.option(
    "--redis-url",
    envvar="SAGA_REDIS_URL",
    required=True,
    help="Redis for the rewards participant [env SAGA_REDIS_URL].",
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
    data_schema: str,
    report: str,
    logs: str,
    seed: int,
    keep_topics: bool,
    service_pid: tuple[str, ...],
    postgres_url: str,
    mongo_url: str,
    redis_url: str,
) -> None:
    """Measure sustained sagas/s and latencies against baselines measured in the same run.

    Starts a coordinator and three participants (PostgreSQL, MongoDB wire,
    Redis) per saga phase on fresh topics (prefix bench-<time> unless --prefix
    is given), drives three-step transfer sagas, then measures the direct-write
    and log-bound baselines. Prints a table and writes a JSON report.
    """
    from pathlib import Path

    from rich.console import Console

    from coordinator._bench import BenchConfig, run_bench

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
        schema=data_schema,
        report=Path(report),
        logs=Path(logs),
        seed=seed,
        keep_topics=keep_topics,
        service_pids=pids,
    )
    sys.exit(run_bench(cfg, Console()))


@main.command("schema")
@click.argument("record_type", required=False)
def schema_cmd(record_type: str | None) -> None:
    """Print the JSON Schema of a record type (saga.request, saga.step, ...), or list them."""
    from streams import SCHEMA_NAMES

    if record_type is None:
        for name in SCHEMA_NAMES:
            click.echo(name)
        return
    if record_type not in SCHEMA_NAMES:
        _fail(f"unknown record type {record_type!r}; one of: {', '.join(SCHEMA_NAMES)}", 2)
    click.echo(json.dumps(schema(record_type), indent=2))


from streams.reconcile.cli import reconcile  # noqa: E402  (registered after main exists)

main.add_command(reconcile)


def run() -> None:
    """Entry point: turn expected failures into one sentence and an exit code."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted", 130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except SagaTimeout as exc:
        _fail(str(exc), 4)
    except (ConfigurationError, ConflictingRequest) as exc:
        _fail(str(exc), 2)
    except SagaError as exc:
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        sys.exit(130)
