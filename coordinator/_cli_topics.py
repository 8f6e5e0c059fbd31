"""``saga topics create|delete`` and ``saga schema``: the commands about the log's layout.

Registered on the ``saga`` group by :mod:`coordinator.cli`.
"""

from __future__ import annotations

import json
import sys

import click

from saga.coordinator._cli_common import fail, kafka_options, retention_option, settings_from
from saga.streams import schema
from saga.streams.kafka import create_topics

__all__ = ["schema_cmd", "topics"]


@click.group()
def topics() -> None:
    """Create or delete the saga topics."""


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
    """Create requests, events, decisions, status (compacted), dlq and participants
    (compacted: the participant registry), all with one partition count.

    Run it again after an upgrade: it adds the topics that are missing and leaves the
    others alone."""
    settings = settings_from(bootstrap, prefix, kafka_config)
    created = create_topics(settings, partitions, replication_factor, retention_ms=retention_ms)
    for name in settings.topics.all:
        click.echo(
            f"{name}: {'created' if name in created else 'exists'} ({partitions} partitions)"
        )


@topics.command("delete")
@kafka_options
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (for scripts).")
def topics_delete(
    bootstrap: str | None, prefix: str | None, kafka_config: str | None, yes: bool
) -> None:
    """Delete every saga topic of one prefix, with all its records (asks first unless --yes).

    Topics that do not exist are skipped, so running it twice is harmless.
    """
    from saga.streams.kafka import delete_topics

    settings = settings_from(bootstrap, prefix, kafka_config)
    names = list(settings.topics.all)
    if not yes:
        if not sys.stdin.isatty():
            fail(f"nothing deleted: confirm the deletion of {', '.join(names)} with --yes", 2)
        if not click.confirm(
            f"delete {', '.join(names)} on {settings.bootstrap} with all their records?",
            err=True,
        ):
            fail("nothing deleted; pass --yes to delete without asking", 1)
    deleted = delete_topics(settings, names)
    for name in names:
        click.echo(f"{name}: {'deleted' if name in deleted else 'absent'}")


@click.command("schema")
@click.argument("record_type", required=False)
def schema_cmd(record_type: str | None) -> None:
    """Print the JSON Schema of a record type (saga.request, saga.step, ...), or list them.

    saga.committed is the events topic's record of several steps one participant committed
    at once: each step it lists stands for that step's saga.step event `committed`."""
    from saga.streams import SCHEMA_NAMES

    if record_type is None:
        for name in SCHEMA_NAMES:
            click.echo(name)
        return
    if record_type not in SCHEMA_NAMES:
        fail(f"unknown record type {record_type!r}; one of: {', '.join(SCHEMA_NAMES)}", 2)
    click.echo(json.dumps(schema(record_type), indent=2))
