"""The client commands of ``saga``: ``submit``, ``status``, ``watch`` and ``abort``.

With a key folder (``--keys-dir`` or ``SAGA_KEYS_DIR``) ``submit`` signs its request
with the ``client`` key, ``abort`` with the ``client`` key (``operator`` with
``--as-operator``), and every command believes only status records and dead letters
the coordinator signed (``status`` and ``watch`` need only the public keys).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections import Counter
from typing import Any

import click

from coordinator._cli_common import (
    MAX_TIMEOUT_S,
    Seconds,
    fail,
    kafka_options,
    keys_dir_option,
    load_keys,
    settings_from,
)
from streams import ConfigurationError, InvalidRecord, to_dict


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


@click.command()
@kafka_options
@click.argument("source", default="-")
@click.option("--wait/--no-wait", default=False, help="Wait for the final status and print it.")
@click.option(
    "--timeout",
    type=Seconds(),
    default=None,
    help="Seconds until the saga's deadline (overrides the file's timeout_s; default 30).",
)
@keys_dir_option
def submit(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    source: str,
    wait: bool,
    timeout: float | None,
    keys_dir: str | None,
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
    keys = load_keys(keys_dir, "client")
    with SagaClient(settings, status_from_beginning=False, keys=keys) as client:
        client.send(request)
        tx_id = request.tx_id
        click.echo(tx_id)
        if wait:
            status = client.result(tx_id, timeout=deadline_s + 30)
            click.echo(json.dumps(to_dict(status), indent=2))
            if status.state != "committed":
                sys.exit(3)


@click.command()
@kafka_options
@click.argument("tx_id")
@keys_dir_option
def status(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    tx_id: str,
    keys_dir: str | None,
) -> None:
    """Print the latest status of a transaction (reads the status topic).

    For a saga still committing or rolling back, a line on standard error names each
    participant it waits on that is gone or never announced itself (see `saga participants`).
    """
    from coordinator._cli_registry import waiting_notes
    from coordinator._status_view import StatusView

    settings = settings_from(bootstrap, prefix, kafka_config)
    keys = load_keys(keys_dir, None)
    view = StatusView(settings, from_beginning=True, keys=keys)
    try:
        view.wait_caught_up(60)
        found = view.get(tx_id)
    finally:
        view.close()
    if found is None:
        fail(f"no status for transaction {tx_id}: the coordinator has not seen it (yet)")
    click.echo(json.dumps(to_dict(found), indent=2))
    for note in waiting_notes(settings, found, keys):  # on stderr: stdout stays JSON
        click.echo(f"saga: {note}", err=True)


@click.command()
@kafka_options
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds per refresh.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit (for scripts).")
@keys_dir_option
def watch(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    interval: float,
    once: bool,
    keys_dir: str | None,
) -> None:
    """A live view of the status topic: counts per state and the latest transactions."""
    from rich.console import Group
    from rich.live import Live
    from rich.table import Table

    from coordinator._status_view import StatusView

    settings = settings_from(bootstrap, prefix, kafka_config)
    view = StatusView(settings, from_beginning=True, keys=load_keys(keys_dir, None))

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


@click.command()
@kafka_options
@click.argument("tx_id")
@click.option("--reason", default="", help="Why (kept with the abort record).")
@click.option(
    "--as-operator",
    is_flag=True,
    help="Sign the abort with the operator key instead of the client key (with a key folder).",
)
@keys_dir_option
def abort(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    tx_id: str,
    reason: str,
    as_operator: bool,
    keys_dir: str | None,
) -> None:
    """Ask the coordinator to roll back a transaction that has no decision yet."""
    from coordinator._client import SagaClient
    from streams import TX_ID_PATTERN

    if not re.fullmatch(TX_ID_PATTERN, tx_id):
        fail(f"{tx_id!r} is not a transaction id (pattern {TX_ID_PATTERN})", 2)
    keys = load_keys(keys_dir, "operator" if as_operator else "client")
    settings = settings_from(bootstrap, prefix, kafka_config)
    with SagaClient(settings, status_from_beginning=False, keys=keys) as client:
        client.abort(tx_id, reason)
    click.echo(f"abort of {tx_id} sent")
