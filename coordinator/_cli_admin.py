"""The operator commands of ``saga``: ``list``, ``history``, ``resolve`` and ``dlq``.

Each reads the log (or appends an operator record) through :mod:`coordinator._admin`
and :mod:`coordinator._admin_actions`; with ``--json`` only JSON goes to standard
output (for scripts), otherwise a table. ``abort`` lives with the client commands
(:mod:`coordinator._cli_client`) and shares the actions module. Expected failures
are one sentence and an exit code (2: bad usage or nothing to act on).
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import click

from saga.coordinator._cli_common import (
    Seconds,
    fail,
    kafka_options,
    keys_dir_option,
    load_keys,
    settings_from,
)

F = TypeVar("F", bound=Callable[..., Any])


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON only (for scripts).")(
        fn
    )


def by_option(fn: F) -> F:
    return click.option(
        "--by",
        default=None,
        help="Who acts, kept with the record [default: $USER@hostname].",
    )(fn)


def _tx_id(tx_id: str) -> str:
    from saga.streams import TX_ID_PATTERN

    if not re.fullmatch(TX_ID_PATTERN, tx_id):
        fail(f"{tx_id!r} is not a transaction id (1 to 128 of A-Z a-z 0-9 . _ : -)", 2)
    return tx_id


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _age(ms: int, now_ms: int) -> str:
    seconds = max(0, (now_ms - ms) // 1000)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _duration(option: str) -> Callable[[click.Context, click.Parameter, str | None], int | None]:
    def parse(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | None:
        if value is None:
            return None
        from saga.streams._duration import parse_duration_ms

        try:
            return parse_duration_ms(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=option) from None

    return parse


def _print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, ensure_ascii=False))


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    # A pipe gets whole lines (no folding at 80 columns): scripts grep them.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


# ------------------------------------------------------------------ list


@click.command("list")
@kafka_options
@click.option(
    "--state",
    "states",
    default=None,
    help="Comma-separated states: pending, committing, committed, rolling_back, "
    "rolled_back, failed.",
)
@click.option(
    "--older-than",
    default=None,
    callback=_duration("--older-than"),
    help="Only sagas created longer ago than this (90s, 5m, 2h, 1d): finds stuck ones.",
)
@click.option("--saga", "saga_name", default=None, help="Only sagas of this name.")
@click.option("--participant", default=None, help="Only sagas with a step of this participant.")
@click.option("--limit", type=click.IntRange(1), default=None, help="At most this many rows.")
@json_option
@keys_dir_option
def list_cmd(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    states: str | None,
    older_than: int | None,
    saga_name: str | None,
    participant: str | None,
    limit: int | None,
    as_json: bool,
    keys_dir: str | None,
) -> None:
    """List sagas from the status topic, newest update first, filtered.

    Example: saga list --state pending --older-than 5m
    """
    from saga.coordinator._admin import list_sagas

    wanted = [s.strip() for s in states.split(",") if s.strip()] if states else None
    settings = settings_from(bootstrap, prefix, kafka_config)
    rows = list_sagas(
        settings,
        states=wanted,
        older_than_ms=older_than,
        saga=saga_name,
        participant=participant,
        limit=limit,
        keys=load_keys(keys_dir, None),
    )
    if as_json:
        _print_json([r.to_json() for r in rows])
        return
    now = int(time.time() * 1000)
    _table(
        f"sagas ({len(rows)})",
        ("tx_id", "saga", "state", "age", "updated", "steps", "reason"),
        [
            (
                r.tx_id,
                r.saga,
                r.state,
                _age(r.created_ms, now),
                _when(r.updated_ms),
                " ".join(f"{s.index}:{s.participant}:{s.status}" for s in r.steps),
                r.reason or "",
            )
            for r in rows
        ],
    )


# ------------------------------------------------------------------ history


@click.command()
@kafka_options
@click.argument("tx_id")
@json_option
@keys_dir_option
def history(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    tx_id: str,
    as_json: bool,
    keys_dir: str | None,
) -> None:
    """Every record of one transaction, from every topic, in order.

    Shows partition, offset, time, kind, signer and a one-line summary; with
    --keys-dir the signatures are verified.

    Example: saga history tx-42
    """
    from saga.coordinator._admin import history as read_history

    settings = settings_from(bootstrap, prefix, kafka_config)
    entries = read_history(settings, _tx_id(tx_id), keys=load_keys(keys_dir, None))
    if as_json:
        _print_json([e.to_json() for e in entries])
        return
    if not entries:
        fail(f"no record of transaction {tx_id} in the log; check the id and the --prefix", 2)
    cut = len(settings.topics.prefix) + 1
    _table(
        f"history of {tx_id} (partition {entries[0].partition})",
        ("time", "topic", "offset", "kind", "signer", "summary"),
        [
            (
                _when(e.timestamp_ms),
                e.topic[cut:],
                str(e.offset),
                e.kind,
                e.signer or "",
                e.summary,
            )
            for e in entries
        ],
    )


# ------------------------------------------------------------------ resolve


@click.command()
@kafka_options
@click.argument("tx_id")
@click.option("--step", type=click.IntRange(0, 63), required=True, help="Index of the step.")
@click.option("--note", required=True, help="What was done by hand (kept in the log).")
@by_option
@click.option(
    "--wait",
    "wait_s",
    type=Seconds(3600),
    default=10.0,
    show_default=True,
    help="Seconds to wait for the coordinator to take it.",
)
@json_option
@keys_dir_option
def resolve(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    tx_id: str,
    step: int,
    note: str,
    by: str | None,
    wait_s: float,
    as_json: bool,
    keys_dir: str | None,
) -> None:
    """Record that a failed compensation was handled by hand.

    For a saga in state failed: step STEP's compensation failed and an operator
    put it right. The record (saga.resolve, signed with the operator key when a
    key folder is used) is kept in the log; once no failed step is left the saga
    is rolled_back. Exit 0 done, 2 nothing to resolve, 4 not taken in time.

    Example: saga resolve tx-42 --step 1 --note "refunded by hand, ticket 7"
    """
    from saga.coordinator._admin_actions import resolve as send_resolve

    settings = settings_from(bootstrap, prefix, kafka_config)
    result = send_resolve(
        settings,
        _tx_id(tx_id),
        step,
        note=note,
        by=by,
        wait_s=wait_s,
        keys=load_keys(keys_dir, "operator"),
    )
    _report(result, as_json)


def _report(result: Any, as_json: bool) -> None:
    """Print an :class:`~coordinator._admin_actions.ActionResult`; exit with its code."""
    code = result.verdict.exit_code
    if as_json:
        _print_json(result.to_json())
    elif code in (0, 3):
        click.echo(result.message)
    else:
        fail(result.message, code)
    sys.exit(code)


# ------------------------------------------------------------------ dlq


@click.group()
def dlq() -> None:
    """Look into the dead-letter topic and redrive records from it."""


def _where(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d{1,9}):(\d{1,18})", text.strip())
    if match is None:
        fail(f"{text!r} is not PARTITION:OFFSET of a dead letter, such as 0:17", 2)
    return int(match.group(1)), int(match.group(2))


@dlq.command("list")
@kafka_options
@click.option("--topic", default=None, help="Only dead letters from this topic (requests, ...).")
@click.option(
    "--since",
    default=None,
    callback=_duration("--since"),
    help="Only dead letters written within this long (30m, 2h, 1d).",
)
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True)
@json_option
def dlq_list(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    topic: str | None,
    since: int | None,
    limit: int,
    as_json: bool,
) -> None:
    """List dead letters, newest first.

    Example: saga dlq list --topic requests --since 1h
    """
    from saga.coordinator._admin import dead_letters

    settings = settings_from(bootstrap, prefix, kafka_config)
    since_ms = int(time.time() * 1000) - since if since is not None else None
    letters = dead_letters(settings, source_topic=topic, since_ms=since_ms, limit=limit)
    if as_json:
        _print_json([d.to_json() for d in letters])
        return
    _table(
        f"dead letters ({len(letters)})",
        ("dlq", "time", "tx_id", "from", "component", "reason"),
        [
            (
                d.where,
                _when(d.timestamp_ms),
                str(d.to_json()["tx_id"] or ""),
                f"{d.source_topic}/{d.source_partition}@{d.source_offset}",
                d.component or "",
                d.reason,
            )
            for d in letters
        ],
    )


@dlq.command("show")
@kafka_options
@click.argument("where")
@json_option
def dlq_show(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    where: str,
    as_json: bool,
) -> None:
    """Show one dead letter (PARTITION:OFFSET): why, from where, its headers and bytes.

    Example: saga dlq show 0:17
    """
    from saga.coordinator._admin import dead_letter

    partition, offset = _where(where)
    letter = dead_letter(settings_from(bootstrap, prefix, kafka_config), partition, offset)
    if letter is None:
        fail(f"there is no dead letter at {where}; `saga dlq list` shows them", 2)
    shown = letter.to_json(full=True)
    if as_json:
        _print_json(shown)
        return
    for name in (
        "dlq",
        "tx_id",
        "reason",
        "component",
        "source_topic",
        "source_partition",
        "source_offset",
        "truncated",
    ):
        click.echo(f"{name}: {shown[name]}")
    click.echo(f"time: {_when(letter.timestamp_ms)}")
    click.echo("headers:")
    for name, value in letter.headers.items():
        click.echo(f"  {name}: {value}")
    click.echo(f"key ({shown['key_encoding']}): {shown['key']}")
    click.echo(f"value ({shown['value_encoding']}): {shown['value']}")


@dlq.command("redrive")
@kafka_options
@click.argument("where")
@by_option
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
def dlq_redrive(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    where: str,
    by: str | None,
    yes: bool,
    as_json: bool,
) -> None:
    """Produce a dead letter's original record to its source topic again.

    The copy carries the headers saga.redriven.from (the dead letter's
    PARTITION:OFFSET) and saga.redriven.by, and shows in `saga history`. The
    coordinator or participant handles it again (and dead-letters it again if it
    is still bad). A truncated dead letter cannot be redriven.

    Example: saga dlq redrive 0:17 --yes
    """
    from saga.coordinator._admin import dead_letter, redrive
    from saga.coordinator._admin_actions import default_operator

    partition, offset = _where(where)
    settings = settings_from(bootstrap, prefix, kafka_config)
    letter = dead_letter(settings, partition, offset)
    if letter is None:
        fail(f"there is no dead letter at {where}; `saga dlq list` shows them", 2)
    if not yes and not click.confirm(
        f"Redrive dead letter {where} (tx {letter.to_json()['tx_id']}) to {letter.source_topic}?",
        err=True,
    ):
        fail("not redriven", 1)
    who = by or default_operator()
    topic, new_partition, new_offset = redrive(settings, letter, by=who)
    if as_json:
        _print_json(
            {
                "dlq": letter.where,
                "topic": topic,
                "partition": new_partition,
                "offset": new_offset,
                "by": who,
            }
        )
        return
    click.echo(
        f"dead letter {letter.where} redriven to {topic}/{new_partition}@{new_offset} by {who}"
    )


COMMANDS = (list_cmd, history, resolve, dlq)
"""The commands this module adds to ``saga``."""
