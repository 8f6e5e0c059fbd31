"""``saga console``: serve the web console for one topic prefix."""

from __future__ import annotations

import getpass
import os
import re
import signal
import tempfile
import threading
from pathlib import Path

import click

from saga.coordinator._cli_common import (
    connect_timeout_option,
    fail,
    kafka_options,
    keys_dir_option,
    settings_from,
)
from saga.streams import ConfigurationError
from saga.streams._secrets import redact_url, remember, url_password
from saga.streams.log import Log


def _default_db(prefix: str) -> str:
    """A SQLite file in the user's state folder (a temporary one if that is not writable)."""
    try:
        state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
        base = Path(state) / "saga"
        base.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # no home folder, or one that cannot be written
        base = Path(tempfile.gettempdir())
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", prefix)
    return f"sqlite:///{base / f'console-{safe}.db'}"


def _check_topics(kafka: Log, status_topic: str) -> None:
    """Fail with one sentence when the status topic is missing (a wrong --prefix, mostly)."""
    probe = kafka.consumer(None, client_id="saga.console.probe")
    try:
        probe.list_partitions(status_topic)
    except ConfigurationError:
        fail(
            f"there is no topic {status_topic}: check --prefix (or SAGA_TOPIC_PREFIX), or "
            "create the topics with `saga topics create`",
            2,
        )
    finally:
        probe.close()


@click.command("console")
@kafka_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    help="Port to listen on (0: any free port, printed at start).",
)
@click.option(
    "--db",
    envvar="SAGA_CONSOLE_DB",
    default=None,
    help="Where the view of the status topic lives: sqlite:///path/console.db, :memory:, or "
    "postgresql://user:password@host/db (needs psycopg; give a password through "
    "SAGA_CONSOLE_DB, not the command line) [env SAGA_CONSOLE_DB; default: a SQLite file "
    "in ~/.local/state/saga].",
)
@click.option(
    "--operator",
    default=None,
    help="Name recorded with every action [default: the login user].",
)
@click.option(
    "--user-header",
    default=None,
    metavar="NAME",
    help="Behind an authenticating proxy: take each action's operator from this request "
    "header (e.g. X-Forwarded-User) instead of --operator.",
)
@click.option(
    "--public-host",
    multiple=True,
    metavar="NAME[:PORT]",
    help="Another host name browsers use to reach the console (a proxy's); repeatable.",
)
@click.option("--read-only", is_flag=True, help="Show everything, act on nothing.")
@keys_dir_option
@connect_timeout_option
def console(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    host: str,
    port: int,
    db: str | None,
    operator: str | None,
    user_header: str | None,
    public_host: tuple[str, ...],
    read_only: bool,
    keys_dir: str | None,
    connect_timeout: float,
) -> None:
    """A web console: a live table of sagas, each saga's history, the DLQ, and admin actions.

    It keeps a view of the status topic in a database (SQLite by default) and
    resumes where it stopped. It listens on 127.0.0.1 only unless --host says
    otherwise; put it behind an authenticating proxy to share it (see the README).
    Actions are sent as --operator (with --keys-dir: signed with the operator key).
    """
    from saga.coordinator._console import Console, Operations, StatusTable, ViewStore, make_server
    from saga.coordinator._console._actions import OPERATOR_PATTERN
    from saga.streams._signing import Keyring
    from saga.streams.kafka import KafkaLog, wait_for_broker

    try:
        name = operator or getpass.getuser()
    except (OSError, KeyError):  # no login name in a bare container
        fail("cannot tell who you are (no login name): pass --operator NAME", 2)
    if not re.fullmatch(OPERATOR_PATTERN, name):
        fail(f"--operator {name!r} is not a usable name: letters, digits and ._@+- only", 2)
    settings = settings_from(bootstrap, prefix, kafka_config)
    url = db or _default_db(settings.prefix)
    remember(url_password(url))
    verify_keys = signing_keys = None
    disabled = "the console runs with --read-only" if read_only else None
    if keys_dir:
        try:
            verify_keys = Keyring.load(keys_dir, None)
        except ConfigurationError as exc:
            fail(str(exc), 2)
        try:
            signing_keys = Keyring.load(keys_dir, "operator")
        except ConfigurationError:
            disabled = disabled or (
                "the console has no operator key in its --keys-dir, so it cannot sign actions"
            )
    # Everything that can be wrong on this side (database, port) fails before Kafka is
    # waited for, so a typo is reported at once.
    store = ViewStore(url)
    kafka = KafkaLog(settings)
    table = StatusTable(kafka, store, keys=verify_keys)
    operations = Operations(
        kafka,
        store,
        verify_keys=verify_keys,
        signing_keys=signing_keys,
        actions_disabled=disabled,
    )
    shared = Console(
        store=store,
        table=table,
        operations=operations,
        operator=name,
        prefix=settings.prefix,
        user_header=user_header,
        public_hosts=frozenset(h.lower() for h in public_host),
    )
    try:
        server = make_server(shared, host, port)
    except OSError as exc:
        store.close()
        fail(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port or --host", 2)
    try:
        wait_for_broker(settings, timeout=connect_timeout)
        _check_topics(kafka, settings.topics.status)
    except BaseException:
        server.server_close()
        store.close()
        raise
    table.start()

    def stop(_signum: int, _frame: object) -> None:
        # shutdown() waits for serve_forever to return: call it from another thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    click.echo(
        f"saga console ready: http://{shown}:{bound_port}/ (prefix {settings.prefix}, view in "
        f"{redact_url(url)}, operator {user_header + ' header' if user_header else name})",
        err=True,
    )
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
        table.stop()
        store.close()
