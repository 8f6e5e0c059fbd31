"""The ``saga`` command line.

Every command takes the Kafka address from ``--bootstrap`` or
``SAGA_KAFKA_BOOTSTRAP``, the topic prefix from ``--prefix`` or
``SAGA_TOPIC_PREFIX`` (default ``saga``), and Kafka client settings (SASL, TLS)
from ``--kafka-config FILE`` (``key=value`` lines) or ``SAGA_KAFKA_<NAME>``
variables. Expected failures print one sentence and exit non-zero (2 for bad
usage or input); there are no stack traces for them. No message or log line
shows a password: storage URLs' passwords and Kafka settings named like
``sasl.password`` are redacted (:mod:`streams._secrets`).

This module holds the group, the service commands (``coordinator``, ``participant``)
and the entry point; ``topics`` and ``schema`` live in :mod:`coordinator._cli_topics`,
the shared options in :mod:`coordinator._cli_common`, the client commands in
:mod:`coordinator._cli_client`, ``participants`` (the participant registry) in
:mod:`coordinator._cli_registry`, and ``reconcile`` in :mod:`streams.reconcile.cli`.
``demo`` and ``bench`` belong to the tools package (:mod:`saga.tools.cli`, the
``tools`` extra) and are attached lazily: the core imports no storage driver.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import socket
import sys

import click

from saga.coordinator._cli_acls import acls
from saga.coordinator._cli_admin import COMMANDS as ADMIN_COMMANDS
from saga.coordinator._cli_client import abort, status, submit, watch
from saga.coordinator._cli_common import (
    TOOLS_HINT,
    connect_timeout_option,
    fail,
    kafka_options,
    keys_dir_option,
    load_keys,
    process_faults,
    refuse_test_switches,
    retention_option,
    settings_from,
)
from saga.coordinator._cli_keys import keys
from saga.coordinator._cli_observe import Observability, log_format_option, observe_options
from saga.coordinator._cli_registry import participants
from saga.coordinator._cli_topics import schema_cmd, topics
from saga.streams import (
    ConfigurationError,
    ConflictingRequest,
    SagaError,
    SagaTimeout,
    StorageKind,
)
from saga.streams._logs import LogFormat, configure_logging
from saga.streams._secrets import redact, url_password
from saga.streams.kafka import wait_for_broker

# The tools' commands: name -> module of the tools package that defines it.
TOOL_COMMANDS = {"bench": "saga.tools.cli", "demo": "saga.tools.cli"}
# Core commands imported only when run (a web server is no start-up cost for the rest).
LAZY_COMMANDS = {"console": "saga.coordinator._console._cli"}


def _tools_missing(name: str, problem: str) -> click.Command:
    """A stand-in for a tool command whose package cannot be imported: one sentence, exit 2."""

    def explain() -> None:
        fail(f"saga {name} needs the tools package ({problem}); {TOOLS_HINT}", 2)

    return click.Command(
        name,
        callback=explain,
        help=f"Not installed: {TOOLS_HINT}.",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
    )


_VERBOSE_KEY = "saga.verbose"


def _log_level(verbose: int) -> int:
    return logging.WARNING - 10 * min(verbose, 2)


def _more_verbose(ctx: click.Context, _param: click.Parameter, value: int) -> None:
    """``-v`` given after the subcommand: adds to the group's count, lowers the log level."""
    if value:
        total = int(ctx.meta.get(_VERBOSE_KEY, 0)) + value
        ctx.meta[_VERBOSE_KEY] = total
        logging.getLogger().setLevel(_log_level(total))


def with_verbose(command: click.Command) -> click.Command:
    """``command`` (and, for a group, every command under it) accepting ``-v/--verbose``.

    So ``saga coordinator run -v`` means ``saga -v coordinator run``. A command whose
    own ``-v`` means something else (``reconcile``: Spark's warnings) keeps it.
    Idempotent: run on each command as it is looked up.
    """
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            with_verbose(sub)
        return command
    if not any("-v" in p.opts or "--verbose" in p.opts for p in command.params):
        command.params.append(
            click.Option(
                ["-v", "--verbose"],
                count=True,
                expose_value=False,
                callback=_more_verbose,
                help="More log output (-v info, -vv debug); as `saga -v ...`.",
            )
        )
    return command


class SagaGroup(click.Group):
    """The ``saga`` group: its own commands, plus the tools' commands imported on demand.

    Every command it hands out accepts ``-v`` after its name too (:func:`with_verbose`).
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *TOOL_COMMANDS, *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        found = self._command(ctx, cmd_name)
        return with_verbose(found) if found is not None else None

    def _command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            lazy = getattr(importlib.import_module(LAZY_COMMANDS[cmd_name]), cmd_name)
            assert isinstance(lazy, click.Command)
            return lazy
        module_name = TOOL_COMMANDS.get(cmd_name)
        if module_name is None or cmd_name in self.commands:
            return super().get_command(ctx, cmd_name)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            return _tools_missing(cmd_name, f"cannot import {exc.name or module_name}")
        command = getattr(module, cmd_name)
        assert isinstance(command, click.Command)
        return command


def default_instance_id() -> str:
    """The host name (a container's is its id): distinct per replica of a scaled service.

    Two coordinators on one host need ``--instance-id`` (or ``SAGA_INSTANCE_ID``): with the
    same id the newer fences the older. A name Kafka cannot use in a client id is cut to
    the characters it can.
    """
    name = "".join(c for c in socket.gethostname() if c.isalnum() or c in "._-")[:100]
    return name or "0"


def _duration_ms(value: str, option: str, least_ms: int, most_ms: int) -> int:
    from saga.streams._duration import parse_duration_ms

    try:
        ms = parse_duration_ms(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None
    if not least_ms <= ms <= most_ms:
        raise click.BadParameter(
            f"{value!r} is out of range: give {least_ms} ms to {most_ms // 3_600_000} h",
            param_hint=option,
        )
    return ms


def _exit_wedged(message: str) -> None:
    """A Kafka client is wedged: exit, so that a supervisor's restart takes over (any thread)."""
    click.echo(f"saga: {redact(message)}; exiting so that a restarted process takes over", err=True)
    os._exit(1)


@click.group(cls=SagaGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="More log output (-v info, -vv debug); also accepted after the subcommand.",
)
@log_format_option
@click.version_option(package_name="saga-olep", prog_name="saga")
@click.pass_context
def main(ctx: click.Context, verbose: int, log_format: LogFormat | None) -> None:
    """saga: all-or-nothing changes across PostgreSQL, MongoDB and Redis through Kafka.

    Start with `saga topics create`, then run `saga coordinator run` and one
    `saga participant run` per storage, and submit sagas with `saga submit` or
    the client library.
    """
    ctx.meta[_VERBOSE_KEY] = verbose
    configure_logging(verbose, log_format or "text")
    # Test-only variables (streams/_faults.py): refused unless the test launcher runs us.
    refuse_test_switches(os.environ)


# ---------------------------------------------------------------- coordinator


@main.group()
def coordinator() -> None:
    """Run the coordinator service."""


@coordinator.command("run")
@kafka_options
@click.option(
    "--instance-id",
    envvar="SAGA_INSTANCE_ID",
    default=None,
    help="Stable and unique per coordinator process; names its transactional producer and "
    "group membership, so a restart with the same id fences its predecessor and takes back "
    "its partitions at once [env SAGA_INSTANCE_ID; default: the host name, distinct per "
    "container of a scaled service].",
)
@click.option(
    "--participants",
    default=None,
    help="Comma-separated names of the participants that exist; a request naming "
    "another rolls back at once (default: those that announced themselves on the "
    "participant registry, <prefix>.participants).",
)
@click.option(
    "--unknown-participants",
    type=click.Choice(["reject", "accept"]),
    default="reject",
    show_default=True,
    help="Without --participants: reject a request naming a participant that has not "
    "announced itself on the registry within --participant-grace (roll it back), or "
    "accept any name (for deployments that start participants after their first requests).",
)
@click.option(
    "--participant-grace",
    "participant_grace_ms",
    default="30s",
    show_default=True,
    callback=lambda _c, _p, v: (
        0 if v == "off" else _duration_ms(v, "--participant-grace", 100, 86_400_000)
    ),
    help="How long a request naming a participant that has not announced itself yet waits "
    "for it (never past the saga's deadline) before it rolls back (off: at once); names "
    "in --participants are known at once.",
)
@retention_option("Forget sagas (memory, status topic) finished longer ago than this")
@click.option(
    "--redrive-after",
    "redrive_after_ms",
    default="30s",
    show_default=True,
    callback=lambda _c, _p, v: (
        0 if v == "off" else _duration_ms(v, "--redrive-after", 100, 86_400_000)
    ),
    help="Send the decision of a saga stalled committing or rolling back again after this "
    "long without a change, then after twice as long each time (off: never).",
)
@click.option(
    "--redrive-limit",
    type=click.IntRange(0, 100),
    default=5,
    show_default=True,
    help="Re-sends of a stalled decision since the saga's last change, at most.",
)
@connect_timeout_option
@keys_dir_option
@click.option(
    "--aborters",
    default="client,operator",
    show_default=True,
    help="With a key folder: whose signed aborts are honoured (client, operator or both).",
)
@observe_options
def coordinator_run(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    instance_id: str | None,
    participants: str | None,
    unknown_participants: str,
    participant_grace_ms: int,
    retention_ms: int,
    redrive_after_ms: int,
    redrive_limit: int,
    connect_timeout: float,
    keys_dir: str | None,
    aborters: str,
    observability: Observability,
) -> None:
    """Consume requests and step events, decide commit or rollback, publish status.

    Sagas that ended committed or rolled back are forgotten --retention after their
    deadline and last change; a request whose deadline passed longer ago than that
    goes to the DLQ as expired. The decision of a saga that stalls committing or rolling
    back is sent again (--redrive-after). A request naming a participant that has not
    announced itself on the participant registry waits for it up to --participant-grace,
    then rolls back (see --unknown-participants); the coordinator reads the registry to
    its end before it decides anything.
    """
    from saga.coordinator._chores import Redrive
    from saga.coordinator._service import CoordinatorService
    from saga.streams.log import KafkaLog

    faults = process_faults()
    known = (
        frozenset(p.strip() for p in participants.split(",") if p.strip()) if participants else None
    )
    allowed = frozenset(a.strip() for a in aborters.split(",") if a.strip())
    if not allowed or not allowed <= {"client", "operator"}:
        fail(f"--aborters must name client, operator or both, got {aborters!r}", 2)
    settings = settings_from(bootstrap, prefix, kafka_config)
    signing_keys = load_keys(keys_dir, "coordinator")
    wait_for_broker(settings, timeout=connect_timeout)
    service = CoordinatorService(
        settings,
        instance_id=instance_id or default_instance_id(),
        participants=known,
        unknown_participants="accept" if unknown_participants == "accept" else "reject",
        retention_ms=retention_ms,
        log=KafkaLog(settings, on_wedged=_exit_wedged),
        faults=faults,
        keys=signing_keys,
        aborters=allowed,
        redrive=Redrive(after_ms=redrive_after_ms, limit=redrive_limit),
        participant_grace_ms=participant_grace_ms,
    )
    service.install_signal_handlers()
    with observability.serve(service.observer, "coordinator"):
        _freeze_start_up()
        service.run()


def _freeze_start_up() -> None:
    """Leave what start-up made (modules, clients, the storage's engine) out of every
    later garbage collection: it lives as long as the process.

    A full collection scans every tracked object, and the modules alone are some
    77,000: each full pass of a service paused its batch loop (gen2 pauses of 100 ms
    and more in a participant during the bench's open loop) to scan objects that are
    never garbage. Reference counting still frees them as before.
    """
    gc.collect()
    gc.freeze()


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
@click.option(
    "--worker-id",
    envvar="SAGA_WORKER_ID",
    default=None,
    help="Stable across restarts and unique among this participant's live workers (e.g. "
    "sql-0): a restarted worker takes back its partitions at once instead of after the "
    "Kafka session timeout [env SAGA_WORKER_ID; default: none, a dynamic group member].",
)
@retention_option("Remove ledger entries of transactions finished longer ago than this")
@click.option(
    "--heartbeat",
    "heartbeat_ms",
    default="5s",
    show_default=True,
    callback=lambda _c, _p, v: _duration_ms(v, "--heartbeat", 100, 86_400_000),
    help="How often to announce on the participant registry that this process is up "
    "(500ms, 5s, 1m); it counts as gone after three missed heartbeats.",
)
@connect_timeout_option
@keys_dir_option
@observe_options
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
    worker_id: str | None,
    retention_ms: int,
    heartbeat_ms: int,
    connect_timeout: float,
    keys_dir: str | None,
    observability: Observability,
) -> None:
    """Apply this participant's steps, confirm on commit, compensate on rollback.

    The storage URL comes from one of --url, --url-file or --url-env, else from
    the SAGA_STORAGE_URL environment variable; --password-file sets its password.
    No message or log line shows the password. Before it consumes, the process
    announces itself on the participant registry (<prefix>.participants), then
    again every --heartbeat. An authentication failure of the
    storage exits with code 2; Kafka not answering within --connect-timeout
    seconds exits with code 1.
    """
    from saga.participants import ParticipantRuntime, open_storage
    from saga.participants._open import storage_url
    from saga.streams.log import KafkaLog

    faults = process_faults()

    if url is not None and url_password(url):
        logging.getLogger("saga.participant").warning(
            "the storage password is on the command line, where every local user can read "
            "it (ps); pass the URL with --url-file, --url-env or SAGA_STORAGE_URL instead"
        )
    resolved = storage_url(
        url=url, url_file=url_file, url_env=url_env, password_file=password_file, environ=os.environ
    )
    settings = settings_from(bootstrap, prefix, kafka_config)
    signing_keys = load_keys(keys_dir, f"participant-{name}")
    target_list = [t.strip() for t in targets.split(",") if t.strip()]
    store = open_storage(
        storage,
        name=name,
        url=resolved,
        targets=target_list,
        handlers=handlers,
        schema=db_schema,
        faults=faults,
    )
    wait_for_broker(settings, timeout=connect_timeout)
    runtime = ParticipantRuntime(
        name,
        store,
        settings,
        retention_ms=retention_ms,
        log=KafkaLog(settings, on_wedged=_exit_wedged),
        faults=faults,
        keys=signing_keys,
        heartbeat_interval_ms=heartbeat_ms,
        kind=StorageKind(storage),
        targets=target_list,
        worker_id=worker_id or None,
    )
    runtime.observer.description = f"{storage}, targets {','.join(target_list)}"
    runtime.install_signal_handlers()
    with observability.serve(runtime.observer, f"participant-{name}"):
        _freeze_start_up()
        runtime.run()


from saga.streams.reconcile.cli import reconcile  # noqa: E402  (registered after main exists)

main.add_command(reconcile)
main.add_command(topics)
main.add_command(schema_cmd)
main.add_command(acls)
for _command in (submit, status, watch, abort, keys, participants, *ADMIN_COMMANDS):
    main.add_command(_command)


def run() -> None:
    """Entry point: turn expected failures into one sentence and an exit code."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        fail("aborted", 130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except SagaTimeout as exc:
        fail(str(exc), 4)
    except (ConfigurationError, ConflictingRequest) as exc:
        fail(str(exc), 2)
    except SagaError as exc:
        fail(str(exc), 1)
    except KeyboardInterrupt:
        sys.exit(130)
