"""The client commands of ``saga``: ``submit``, ``status``, ``watch`` and ``abort``.

With a key folder (``--keys-dir`` or ``SAGA_KEYS_DIR``) ``submit`` signs its request
with the ``client`` key, ``abort`` with the ``client`` key (``operator`` with
``--as-operator``), and every command believes only status records and dead letters
the coordinator signed (``status`` and ``watch`` need only the public keys).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections import Counter
from typing import Any

import click

from saga.coordinator._cli_common import (
    MAX_TIMEOUT_S,
    Seconds,
    fail,
    kafka_options,
    keys_dir_option,
    load_keys,
    settings_from,
)
from saga.streams import (
    ConfigurationError,
    InvalidRecord,
    SagaState,
    SagaStatus,
    SagaTimeout,
    to_dict,
)

# The exit status of `saga submit --wait` and `saga status` for a transaction's state
# (README "Command line"): final states get their own, anything else is "not final yet",
# as a --wait that timed out (SagaTimeout, exit 4 in coordinator.cli.run).
EXIT_COMMITTED = 0
EXIT_ROLLED_BACK = 3
EXIT_NOT_FINAL = 4
EXIT_FAILED = 5
_EXIT_BY_STATE = {
    SagaState.COMMITTED: EXIT_COMMITTED,
    SagaState.ROLLED_BACK: EXIT_ROLLED_BACK,
    SagaState.FAILED: EXIT_FAILED,
}


def exit_code_of(state: SagaState) -> int:
    """0 committed, 3 rolled back, 5 failed (an operator must act), 4 not final yet."""
    return _EXIT_BY_STATE.get(state, EXIT_NOT_FINAL)


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
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print only JSON on stdout: {"tx_id": ...}, or with --wait the final status.',
)
@click.option(
    "--isolation",
    type=click.Choice(["read_committed", "none"]),
    default=None,
    help="What others may see before the decision (overrides the file's isolation; "
    "default read_committed: records change only at commit).",
)
@keys_dir_option
def submit(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    source: str,
    wait: bool,
    timeout: float | None,
    as_json: bool,
    isolation: str | None,
    keys_dir: str | None,
) -> None:
    """Submit a saga from a JSON file (or - for stdin); prints its tx_id.

    The JSON object has `steps` (list of {participant, action, args}) and
    optionally `saga`, `mode` (parallel|sequential), `isolation` (read_committed|none),
    `timeout_s`, `tx_id`, `meta`.
    With --wait the exit status tells the outcome: 0 committed, 3 rolled back,
    5 failed (an operator must act), 4 still running when the wait ended. A participant
    that never announced itself is named on standard error, with the nearest announced
    name; the saga is sent all the same.
    """
    from saga.coordinator._client import DEFAULT_TIMEOUT_S, SagaClient, build_request

    data = _read_submission(source)
    deadline_s = timeout if timeout is not None else float(data.get("timeout_s", DEFAULT_TIMEOUT_S))
    settings = settings_from(bootstrap, prefix, kafka_config)
    try:
        # Checked before connecting: bad input is a usage error, whatever Kafka's state.
        request = build_request(
            data["steps"],
            saga=str(data.get("saga", "saga")),
            mode=data.get("mode", "parallel"),
            isolation=isolation or data.get("isolation", "read_committed"),
            timeout=deadline_s,
            tx_id=data.get("tx_id"),
            meta=data.get("meta"),
        )
    except InvalidRecord as exc:
        where = "standard input" if source == "-" else source
        raise ConfigurationError(f"{where}: {exc.reason}") from exc
    keys = load_keys(keys_dir, "client")
    with SagaClient(settings, status_from_beginning=False, keys=keys) as client:
        # A name never announced is most often a typo: said, but sent all the same (the
        # coordinator waits for a participant that is still starting).
        for hint in client.unannounced(request):
            click.echo(f"saga: warning: {hint}", err=True)
        client.send(request)
        tx_id = request.tx_id
        if not as_json:
            click.echo(tx_id)
        elif not wait:
            click.echo(json.dumps({"tx_id": tx_id}))
        else:
            # stdout stays one JSON document (`| jq`); the id is in it, and on stderr
            # for a wait that ends without a status.
            click.echo(f"submitted {tx_id}", err=True)
        if wait:
            waited = deadline_s + 30
            try:
                status = client.result(tx_id, timeout=waited)
            except SagaTimeout:
                # The library's sentence speaks to a program ("call result() again");
                # this one to the shell user. Exit 4 (coordinator.cli.run).
                current = client.status(tx_id)
                state = current.state.value if current is not None else "no status yet"
                raise SagaTimeout(
                    f"transaction {tx_id} is still running after {waited:g} s (state: "
                    f"{state}); check it later with `saga status {tx_id}`"
                ) from None
            click.echo(json.dumps(to_dict(status), indent=2))
            sys.exit(exit_code_of(status.state))


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
    """Print the latest status of a transaction (reads the status topic) as JSON.

    Exit status as `saga submit --wait`: 0 committed, 3 rolled back, 5 failed (an
    operator must act), 4 not final yet (or no status yet). For a saga still committing
    or rolling back, a line on standard error names each participant it waits on that
    is gone or never announced itself (see `saga participants`).
    """
    from saga.coordinator._cli_registry import waiting_notes
    from saga.coordinator._status_view import StatusView

    settings = settings_from(bootstrap, prefix, kafka_config)
    keys = load_keys(keys_dir, None)
    view = StatusView(settings, from_beginning=True, keys=keys)
    try:
        view.wait_caught_up(60)
        found = view.get(tx_id)
    finally:
        view.close()
    if found is None:
        fail(
            f"no status for transaction {tx_id}: the coordinator has not seen it (yet); "
            "check the id and the --prefix, or try again",
            EXIT_NOT_FINAL,
        )
    click.echo(json.dumps(to_dict(found), indent=2))
    for note in waiting_notes(settings, found, keys):  # on stderr: stdout stays JSON
        click.echo(f"saga: {note}", err=True)
    sys.exit(exit_code_of(found.state))


class _Board:
    """What ``saga watch`` shows, kept up to date from the status records as they come:
    the state of each transaction (counted per state) and the latest few in full."""

    LATEST: int = 15

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, SagaState] = {}
        self._counts: Counter[str] = Counter()
        self._latest: dict[str, SagaStatus] = {}

    def take(self, status: SagaStatus, older: bool = False) -> None:
        """Note ``status``; ``older``: from the first read, so what the listener has already
        noted of the same transaction is newer and stays."""
        with self._lock:
            before = self._states.get(status.tx_id)
            if older and before is not None:
                return
            if before is not None:
                self._counts[before.value] -= 1
            self._states[status.tx_id] = status.state
            self._counts[status.state.value] += 1
            self._latest[status.tx_id] = status
            if len(self._latest) > 4 * self.LATEST:
                self._latest = dict(self._newest(self.LATEST))

    def _newest(self, n: int) -> list[tuple[str, SagaStatus]]:
        return sorted(self._latest.items(), key=lambda kv: kv[1].updated_ms, reverse=True)[:n]

    def read(self) -> tuple[Counter[str], list[SagaStatus]]:
        """The counts per state and the latest statuses, newest first."""
        with self._lock:
            return +self._counts, [s for _, s in self._newest(self.LATEST)]


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

    from saga.coordinator._status_view import StatusView

    settings = settings_from(bootstrap, prefix, kafka_config)
    view = StatusView(settings, from_beginning=True, keys=load_keys(keys_dir, None))
    board = _Board()
    view.listen(board.take)  # what is published from now on...
    for status in view.snapshot().values():  # ...over the topic read once
        board.take(status, older=True)
    states = ("pending", "committing", "committed", "rolling_back", "rolled_back", "failed")

    def render() -> Group:
        counts, latest = board.read()
        summary = Table(title=f"saga status ({sum(counts.values())} transactions)")
        for state in states:
            summary.add_column(state, justify="right")
        summary.add_row(*(str(counts.get(s, 0)) for s in states))
        table = Table(title="latest")
        for col in ("tx_id", "saga", "state", "steps", "reason"):
            table.add_column(col)
        for s in latest:
            steps = " ".join(f"{p.participant}:{p.status.value}" for p in s.steps)
            table.add_row(s.tx_id, s.saga, s.state.value, steps, s.reason or "")
        return Group(summary, table)

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
@click.option("--by", default=None, help="Who aborts, kept with the record [default: $USER@host].")
@click.option(
    "--wait",
    "wait_s",
    type=Seconds(3600),
    default=10.0,
    show_default=True,
    help="Seconds to wait for the coordinator's decision.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON only (for scripts).")
@keys_dir_option
def abort(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    tx_id: str,
    reason: str,
    as_operator: bool,
    by: str | None,
    wait_s: float,
    as_json: bool,
    keys_dir: str | None,
) -> None:
    """Roll back a transaction that has no decision yet, and say whether it was honoured.

    Prints `rolled back`, `already rolled back`, `already committed — not
    honoured`, `unknown transaction` or `not decided yet`. Exit 0 rolled back (now
    or before), 3 not honoured (committed), 4 no decision within --wait, 2 unknown.

    Example: saga abort tx-42 --reason "customer cancelled"
    """
    from saga.coordinator._admin_actions import abort as send_abort
    from saga.coordinator._cli_admin import _report, _tx_id

    keys = load_keys(keys_dir, "operator" if as_operator else "client")
    settings = settings_from(bootstrap, prefix, kafka_config)
    result = send_abort(settings, _tx_id(tx_id), reason=reason, by=by, wait_s=wait_s, keys=keys)
    _report(result, as_json)
