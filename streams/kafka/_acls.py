"""Kafka ACLs: the least each saga role needs, as data, and applied with the admin client.

Behind a broker whose authorizer denies what no ACL allows
(``allow.everyone.if.no.acl.found=false``), each role gets only its own job:

* ``User:client`` writes requests, reads status, dead letters and the participant
  registry, describes the topics;
* ``User:operator`` writes requests (aborts go there), reads status, dead letters and
  the registry, and writes the registry (``saga participants --forget``);
* ``User:participant-<name>`` reads requests, events and decisions, writes events
  and its announcements (the participants topic), and reads through its own group
  ``<prefix>.participant.<name>``;
* ``User:coordinator`` reads every topic, writes decisions, status and dead letters
  (and, for a step of a participant that never announced itself, its event),
  owns the transactional ids ``<prefix>.coordinator.*`` and the group
  ``<prefix>.coordinator``;
* ``User:reconcile`` reads every topic; with ``replay`` it also writes requests and
  decisions (``saga reconcile --replay``).

Every role that reads through a plain reader (:class:`~streams.kafka.Consumer` without
a group: ``<prefix>.reader.<random>``) may use the groups under ``<prefix>.reader.``;
the reconciliation job also the groups of Spark's Kafka source (``spark-kafka-``).
No role gets a cluster-wide permission: idempotent and transactional producers need
none since Kafka 2.8 (KIP-679), and only an administrator creates topics.

:func:`saga_acls` is pure; :func:`apply_acls` and :func:`delete_acls` talk to Kafka.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final, Literal

import confluent_kafka as ck
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._acl import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
)
from confluent_kafka.admin._resource import ResourcePatternType, ResourceType

from saga.streams._errors import ConfigurationError, SagaError, TransientError
from saga.streams._topics import Topics
from saga.streams.kafka._settings import KafkaSettings, _client_config
from saga.streams.kafka._translate import _AUTH_CODES, _E, _error_of, _log_client_error, _translate

Resource = Literal["topic", "group", "transactional-id"]
Pattern = Literal["literal", "prefixed"]
Operation = Literal["read", "write", "describe"]

_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,100}")

_RESOURCE_TYPES: Final = {
    "topic": ResourceType.TOPIC,
    "group": ResourceType.GROUP,
    "transactional-id": ResourceType.TRANSACTIONAL_ID,
}
_PATTERNS: Final = {
    "literal": ResourcePatternType.LITERAL,
    "prefixed": ResourcePatternType.PREFIXED,
}
_OPERATIONS: Final = {
    "read": AclOperation.READ,
    "write": AclOperation.WRITE,
    "describe": AclOperation.DESCRIBE,
}

# The group prefix of Spark's Kafka source (its default ``groupIdPrefix``s start so).
SPARK_GROUP_PREFIX: Final = "spark-kafka-"


@dataclass(frozen=True, order=True)
class AclRule:
    """One allow rule: ``principal`` may ``operation`` the ``resource`` named ``name``
    (exactly, or every name starting with it when ``pattern`` is ``prefixed``), from
    any host."""

    principal: str
    resource: Resource
    pattern: Pattern
    name: str
    operation: Operation

    def __str__(self) -> str:
        return _row(self.principal, self.operation, self.resource, self.pattern, self.name)


def _row(principal: str, operation: str, resource: str, pattern: str, name: str) -> str:
    return f"{principal:<28} {operation:<9} {resource:<17} {pattern:<9} {name}"


def participant_principal(name: str) -> str:
    """The Kafka principal of the participant ``name``: ``User:participant-<name>``."""
    return f"User:participant-{name}"


def saga_acls(
    prefix: str, participants: Sequence[str] = (), *, replay: bool = False
) -> list[AclRule]:
    """The ACLs of one deployment (topics under ``prefix``), sorted, without duplicates.

    Raises:
        ConfigurationError: a bad prefix or participant name.
    """
    topics = Topics(prefix)
    for name in participants:
        if _NAME.fullmatch(name) is None:
            raise ConfigurationError(
                f"participant name {name!r} is not allowed: use 1 to 100 characters "
                "of A-Z, a-z, 0-9, '.', '_' and '-'"
            )
    rules: set[AclRule] = set()

    def allow(
        principal: str,
        operations: Iterable[Operation],
        names: Iterable[str],
        resource: Resource = "topic",
        pattern: Pattern = "literal",
    ) -> None:
        for name in names:
            for operation in operations:
                rules.add(AclRule(principal, resource, pattern, name, operation))

    readers = f"{prefix}.reader."

    client = "User:client"
    allow(client, ["describe"], topics.all)
    allow(client, ["write"], [topics.requests])
    allow(client, ["read"], [topics.status, topics.dlq, topics.participants])
    allow(client, ["read"], [readers], "group", "prefixed")

    operator = "User:operator"
    allow(operator, ["describe"], topics.all)
    allow(operator, ["write"], [topics.requests])
    allow(operator, ["read"], [topics.status, topics.dlq, topics.participants])
    allow(operator, ["write"], [topics.participants])
    allow(operator, ["read"], [readers], "group", "prefixed")

    for name in participants:
        principal = participant_principal(name)
        allow(principal, ["read"], [topics.requests, topics.events, topics.decisions])
        allow(principal, ["write"], [topics.events, topics.participants])
        allow(principal, ["read"], [f"{prefix}.participant.{name}"], "group")

    coordinator = "User:coordinator"
    allow(coordinator, ["read"], topics.all)
    allow(coordinator, ["write"], [topics.decisions, topics.status, topics.dlq, topics.events])
    allow(coordinator, ["read"], [f"{prefix}.coordinator"], "group")
    allow(coordinator, ["read"], [readers], "group", "prefixed")
    allow(
        coordinator,
        ["write", "describe"],
        [f"{prefix}.coordinator."],
        "transactional-id",
        "prefixed",
    )

    reconcile = "User:reconcile"
    allow(reconcile, ["read"], topics.all)
    allow(
        reconcile,
        ["read"],
        [readers, f"{prefix}.reconcile", SPARK_GROUP_PREFIX],
        "group",
        "prefixed",
    )
    if replay:
        allow(reconcile, ["write"], [topics.requests, topics.decisions])
    return sorted(rules)


def format_acls(rules: Iterable[AclRule]) -> str:
    """The rules as a table: a header line, then one line per rule."""
    header = _row("PRINCIPAL", "OPERATION", "RESOURCE", "PATTERN", "NAME")
    return "\n".join([header, *(str(rule) for rule in rules)])


def _binding(rule: AclRule) -> AclBinding:
    return AclBinding(
        _RESOURCE_TYPES[rule.resource],
        rule.name,
        _PATTERNS[rule.pattern],
        rule.principal,
        "*",
        _OPERATIONS[rule.operation],
        AclPermissionType.ALLOW,
    )


def _filter(rule: AclRule) -> AclBindingFilter:
    return AclBindingFilter(
        _RESOURCE_TYPES[rule.resource],
        rule.name,
        _PATTERNS[rule.pattern],
        rule.principal,
        "*",
        _OPERATIONS[rule.operation],
        AclPermissionType.ALLOW,
    )


def _refused(exc: ck.KafkaException, doing: str) -> SagaError:
    err = _error_of(exc)
    if err is not None and err.code() == _E.SECURITY_DISABLED:
        return ConfigurationError(
            f"{doing} failed: the broker has no authorizer (authorizer.class.name), so it "
            "keeps no ACLs; connect to a broker or listener that has one"
        )
    if err is not None and err.code() == _E.CLUSTER_AUTHORIZATION_FAILED:
        return ConfigurationError(
            f"{doing} was refused by Kafka: this principal may not change ACLs (that needs "
            "Alter on the cluster, or a super user); use an administrator's --kafka-config"
        )
    return _translate(err, doing, text=str(exc))


def _run(
    settings: KafkaSettings,
    doing: str,
    timeout: float,
    call: Callable[[AdminClient], Mapping[Any, Future[Any]]],
) -> list[Any]:
    """Run one admin call and wait for all its futures; a refused login fails at once
    (librdkafka reports it to the error callback only, the request would time out)."""
    login_errors: list[str] = []

    def on_error(err: ck.KafkaError) -> None:
        if err.code() in _AUTH_CODES:
            login_errors.append(err.str())
        _log_client_error(err)

    config = _client_config(settings)
    config["error_cb"] = on_error
    try:
        admin = AdminClient(config)
        futures = list(call(admin).values())
    except (ck.KafkaException, ValueError, TypeError) as exc:
        raise ConfigurationError(f"{doing} failed: {exc}") from exc
    deadline = time.monotonic() + timeout
    while not all(f.done() for f in futures):
        admin.poll(0.2)
        if login_errors:
            raise ConfigurationError(
                f"{doing} was refused by Kafka: {login_errors[-1]}; check the security "
                "settings (security.protocol, sasl.*, ssl.*)"
            )
        if time.monotonic() >= deadline:
            raise TransientError(f"{doing} failed: no answer within {timeout:g}s")
    results: list[Any] = []
    for future in futures:
        try:
            results.append(future.result())
        except ck.KafkaException as exc:
            raise _refused(exc, doing) from exc
    return results


def apply_acls(settings: KafkaSettings, rules: Sequence[AclRule], timeout: float = 30.0) -> int:
    """Create ``rules`` on the cluster (existing ones stay as they are); returns their count.

    Needs a principal allowed to alter the cluster's ACLs (a super user, or
    ``Alter`` on the cluster).

    Raises:
        ConfigurationError: refused (login, no permission, no authorizer).
        TransientError: the broker did not answer in time.
    """
    if not rules:
        return 0
    bindings = [_binding(r) for r in rules]
    _run(
        settings,
        f"creating the Kafka ACLs on {settings.bootstrap}",
        timeout,
        lambda admin: admin.create_acls(bindings, request_timeout=timeout),
    )
    return len(rules)


def delete_acls(settings: KafkaSettings, rules: Sequence[AclRule], timeout: float = 30.0) -> int:
    """Delete exactly ``rules`` from the cluster; returns how many ACLs were deleted.

    Raises:
        ConfigurationError: refused (login, no permission, no authorizer).
        TransientError: the broker did not answer in time.
    """
    if not rules:
        return 0
    filters = [_filter(r) for r in rules]
    results = _run(
        settings,
        f"deleting the Kafka ACLs on {settings.bootstrap}",
        timeout,
        lambda admin: admin.delete_acls(filters, request_timeout=timeout),
    )
    return sum(len(deleted) for deleted in results)
