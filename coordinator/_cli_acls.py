"""``saga acls``: the Kafka ACLs each saga role needs, printed or applied.

``print`` shows them (no Kafka needed); ``apply`` creates them with the admin
client (as a principal allowed to alter ACLs: ``--kafka-config`` with the admin
user's SASL settings, or a listener whose principal is a super user); ``delete``
removes exactly those ACLs again. The principals are ``User:client``,
``User:operator``, ``User:coordinator``, ``User:reconcile`` and
``User:participant-<name>`` (see :func:`streams.kafka.saga_acls`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import click

from saga.coordinator._cli_common import kafka_options, settings_from
from saga.streams import Topics
from saga.streams.kafka import apply_acls, delete_acls, format_acls, saga_acls

F = TypeVar("F", bound=Callable[..., Any])


def _participant_names(_ctx: click.Context, _param: click.Parameter, value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def _role_options(fn: F) -> F:
    fn = click.option(
        "--replay",
        is_flag=True,
        help="Let the reconciliation job write requests and decisions (saga reconcile --replay).",
    )(fn)
    fn = click.option(
        "--participants",
        default="",
        callback=_participant_names,
        help="Participant names, comma-separated: each gets User:participant-<name>.",
    )(fn)
    return fn


def _timeout_option(fn: F) -> F:
    return click.option(
        "--timeout",
        type=click.FloatRange(1, 600),
        default=30.0,
        show_default=True,
        help="Seconds to wait for Kafka's answer.",
    )(fn)


@click.group("acls")
def acls() -> None:
    """Kafka ACLs: the least each saga role needs (behind an authorizer that denies the rest)."""


@acls.command("print")
@click.option("--prefix", default=None, help="Topic prefix [env SAGA_TOPIC_PREFIX; default: saga].")
@_role_options
def acls_print(prefix: str | None, participants: list[str], replay: bool) -> None:
    """Print the ACLs, one per line: principal, operation, resource, pattern, name."""
    topic_prefix = Topics(prefix or os.environ.get("SAGA_TOPIC_PREFIX") or "saga").prefix
    click.echo(format_acls(saga_acls(topic_prefix, participants, replay=replay)))


@acls.command("apply")
@kafka_options
@_role_options
@_timeout_option
def acls_apply(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    participants: list[str],
    replay: bool,
    timeout: float,
) -> None:
    """Create the ACLs on the cluster (those that exist already stay as they are)."""
    settings = settings_from(bootstrap, prefix, kafka_config)
    rules = saga_acls(settings.prefix, participants, replay=replay)
    count = apply_acls(settings, rules, timeout=timeout)
    click.echo(f"{count} ACLs in place for the topics {settings.prefix}.* on {settings.bootstrap}")


@acls.command("delete")
@kafka_options
@_role_options
@_timeout_option
def acls_delete(
    bootstrap: str | None,
    prefix: str | None,
    kafka_config: str | None,
    participants: list[str],
    replay: bool,
    timeout: float,
) -> None:
    """Delete exactly the ACLs `apply` creates with the same options."""
    settings = settings_from(bootstrap, prefix, kafka_config)
    rules = saga_acls(settings.prefix, participants, replay=replay)
    count = delete_acls(settings, rules, timeout=timeout)
    click.echo(f"{count} ACLs deleted for the topics {settings.prefix}.* on {settings.bootstrap}")
