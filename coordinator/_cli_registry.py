"""``saga participants``: who announced itself on the participant registry, and who is gone.

Also what ``saga status`` adds for a saga that still waits on participants
(:func:`waiting_notes`): the ones among them that are gone, or never announced
themselves, so that a compensation owed by a process that is not there shows as such.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

import click

from saga.coordinator._cli_common import (
    Seconds,
    fail,
    kafka_options,
    keys_dir_option,
    load_keys,
    settings_from,
)

if TYPE_CHECKING:
    from saga.streams import SagaStatus
    from saga.streams._registry import ParticipantRegistry
    from saga.streams._signing import Keyring
    from saga.streams.kafka import KafkaSettings

__all__ = ["age", "participants", "waiting_notes"]


def age(ms: int) -> str:
    """A duration for people: ``4s``, ``2m``, ``3h``, ``5d``."""
    seconds = max(0, ms) // 1000
    for unit, size, up_to in (("s", 1, 90), ("m", 60, 90 * 60), ("h", 3600, 36 * 3600)):
        if seconds < up_to:
            return f"{seconds // size}{unit}"
    return f"{seconds // 86400}d"


def _read(settings: KafkaSettings, timeout: float, keys: Keyring | None) -> ParticipantRegistry:
    from saga.streams._registry import read_registry

    return read_registry(settings, timeout, keys=keys)


@click.command("participants")
@kafka_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one array) for scripts.")
@click.option(
    "--forget",
    "forget",
    multiple=True,
    metavar="NAME[/INSTANCE]",
    help="Remove an instance from the registry (a tombstone), or every gone instance of "
    "NAME. A name whose every instance is forgotten is unknown again: the coordinator "
    "rolls back requests naming it. Repeatable.",
)
@click.option(
    "--wait",
    "wait_for",
    multiple=True,
    metavar="NAME",
    help="Wait until participant NAME is up (repeatable), then list; exit 4 if --timeout "
    "passes first. For scripts that submit right after starting participants.",
)
@click.option(
    "--timeout",
    type=Seconds(3600),
    default=10.0,
    show_default=True,
    help="Seconds to read the registry to its end (with --wait: to wait).",
)
@keys_dir_option
def participants(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    as_json: bool,
    forget: tuple[str, ...],
    wait_for: tuple[str, ...],
    timeout: float,
    keys_dir: str | None,
) -> None:
    """List the participants that announced themselves: storage, targets, version, instances,
    last heartbeat, and whether they are up or gone.

    A participant is gone when none of its processes is up: each stopped on
    purpose, or missed three heartbeats. With a key folder, only announcements
    signed by their participant count (and --forget signs as operator).
    """
    settings = settings_from(bootstrap, prefix, kafka_config)
    if forget:
        _forget(settings, forget, timeout, keys_dir)
        return
    keys = load_keys(keys_dir, None)
    registry = (
        _wait(settings, wait_for, timeout, keys) if wait_for else _read(settings, timeout, keys)
    )
    found = registry.participants()
    if as_json:
        click.echo(json.dumps([p.to_json() for p in found], indent=2))
        return
    if not found:
        click.echo(
            f"no participant has announced itself on {settings.topics.participants} "
            "(start one with `saga participant run`)"
        )
        return
    rows = [("NAME", "STORAGE", "STATE", "INSTANCES", "HEARTBEAT", "VERSION", "TARGETS")]
    for p in found:
        rows.append(
            (
                p.name,
                p.storage,
                "gone" if p.gone else "up",
                f"{len(p.live)} up / {len(p.instances)}",
                f"{age(p.heartbeat_age_ms)} ago",
                p.version,
                ",".join(p.targets),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        click.echo("  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]]))
    if registry.stats.skipped:
        click.echo(
            f"({registry.stats.skipped} record(s) of the registry were skipped: malformed "
            "or not signed by their participant)",
            err=True,
        )


def _wait(
    settings: KafkaSettings, names: Iterable[str], timeout: float, keys: Keyring | None
) -> ParticipantRegistry:
    import time

    from saga.streams import SagaTimeout

    deadline = time.monotonic() + timeout
    while True:
        registry = _read(settings, max(1.0, deadline - time.monotonic()), keys)
        missing = sorted(set(names) - {p.name for p in registry.participants() if not p.gone})
        if not missing:
            return registry
        if time.monotonic() >= deadline:
            raise SagaTimeout(
                f"participant(s) {', '.join(missing)} not up on {settings.topics.participants} "
                f"after {timeout:g}s: start them with `saga participant run --name ...`"
            )
        time.sleep(0.2)


def _forget(
    settings: KafkaSettings, targets: Iterable[str], timeout: float, keys_dir: str | None
) -> None:
    from saga.streams._signed_log import signing
    from saga.streams.log import KafkaLog

    keys = load_keys(keys_dir, "operator")
    registry = _read(settings, timeout, keys)
    instances = {(a.name, a.instance): a for a in registry.instances()}
    live = {(p.name, i) for p in registry.participants() for i in p.live}
    keys_to_drop: list[str] = []
    for target in targets:
        name, slash, instance = target.partition("/")
        if slash:
            if (name, instance) not in instances:
                fail(f"{target} is not in the registry; see `saga participants --json`", 2)
            keys_to_drop.append(target)
            continue
        chosen = [i for (n, i) in instances if n == name and (n, i) not in live]
        if not chosen and not any(n == name for n, _ in instances):
            fail(f"no participant {name!r} in the registry; see `saga participants`", 2)
        keys_to_drop += [f"{name}/{i}" for i in chosen]
    producer = signing(KafkaLog(settings), keys).producer(client_id=f"{settings.prefix}.operator")
    with producer:
        for key in keys_to_drop:
            producer.produce(settings.topics.participants, key, None)
        producer.flush(timeout)
    for key in keys_to_drop:
        click.echo(f"forgot {key}")
    if not keys_to_drop:
        click.echo("nothing to forget: every instance named is up")


def waiting_notes(
    settings: KafkaSettings, status: SagaStatus, keys: Keyring | None, timeout: float = 5.0
) -> list[str]:
    """For a saga still committing or rolling back: the participants it waits on that are
    gone or never announced themselves, one sentence each. Empty when the registry
    cannot be read (the status itself is what was asked for)."""
    from saga.streams import SagaError, SagaState, StepStatus

    if status.state is SagaState.ROLLING_BACK:
        done = {StepStatus.COMPENSATED, StepStatus.COMPENSATION_FAILED}
    elif status.state is SagaState.COMMITTING:
        done = {StepStatus.COMMITTED}
    else:
        return []
    waiting = sorted({s.participant for s in status.steps if s.status not in done})
    if not waiting:
        return []
    try:
        registry = _read(settings, timeout, keys)
    except SagaError:
        return []
    notes: list[str] = []
    for name in waiting:
        info = registry.get(name)
        if info is None:
            notes.append(
                f"waiting on {name!r}, which has never announced itself on "
                f"{settings.topics.participants}"
            )
        elif info.gone:
            notes.append(
                f"waiting on {name!r}, which has not been heard from for "
                f"{age(info.heartbeat_age_ms)}"
            )
    return notes
