"""librdkafka errors translated to saga's error tree.

* :class:`~streams._errors.FatalKafkaError`: a fenced transactional producer
  (``fenced`` set) or any error librdkafka flags as fatal; the client cannot be
  used again (a new one may be made: see coordinator._txn).
* :class:`TransactionAborted` (a :class:`~streams._errors.TransientError`): the
  current Kafka transaction cannot commit; abort it and re-process from the last
  committed offsets.
* :class:`~streams._errors.TransientError`: unreachable, slow or rebalancing.
* :class:`~streams._errors.ConfigurationError`: a missing topic, authentication
  or authorisation refused.

``KafkaException`` never leaves the package: every client call goes through here.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import confluent_kafka as ck

from saga.streams._errors import ConfigurationError, FatalKafkaError, SagaError, TransientError

_log = logging.getLogger("saga.kafka")

_E = ck.KafkaError
_FENCED_CODES: Final = frozenset({_E._FENCED, _E.PRODUCER_FENCED, _E.INVALID_PRODUCER_EPOCH})
_UNKNOWN_TOPIC_CODES: Final = frozenset(
    {_E.UNKNOWN_TOPIC_OR_PART, _E._UNKNOWN_TOPIC, _E._UNKNOWN_PARTITION}
)
_AUTH_CODES: Final = frozenset(
    {
        _E._AUTHENTICATION,
        _E.SASL_AUTHENTICATION_FAILED,
        _E.TOPIC_AUTHORIZATION_FAILED,
        _E.GROUP_AUTHORIZATION_FAILED,
        _E.CLUSTER_AUTHORIZATION_FAILED,
        _E.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    }
)


class TransactionAborted(TransientError):
    """The current Kafka transaction failed and cannot be committed.

    Nothing it produced becomes visible to ``read_committed`` readers and its
    offsets are not committed. The caller calls :meth:`TransactionalProducer.abort`,
    rewinds its consumer to the last committed offsets and processes the records
    again in a new transaction.
    """


def _error_of(exc: ck.KafkaException) -> ck.KafkaError | None:
    first = exc.args[0] if exc.args else None
    return first if isinstance(first, ck.KafkaError) else None


def _fenced_sentence(transactional_id: str) -> str:
    return (
        f"this process's transactional producer ({transactional_id!r}) was fenced by a "
        "newer instance with the same transactional.id"
    )


def _translate(
    err: ck.KafkaError | None,
    doing: str,
    *,
    text: str,
    topic: str | None = None,
    transactional_id: str | None = None,
) -> SagaError:
    """Map one librdkafka error to saga's error tree (see this module's docstring)."""
    if err is None:
        return TransientError(f"{doing} failed: {text}")
    code = err.code()
    # Abortable first: librdkafka (KIP-360) reports an epoch it bumped itself, e.g.
    # INVALID_PRODUCER_EPOCH from a partition leader after a broker failover, as an
    # abortable error. Taken for a fence, it stopped coordinators that no newer
    # instance had replaced (found by the three-broker chaos profile).
    if err.txn_requires_abort() and not err.fatal():
        return TransactionAborted(
            f"{doing} failed: {err.str()}; the transaction must be aborted and the "
            "records re-processed from the last committed offsets"
        )
    if code in _FENCED_CODES and transactional_id is not None:
        return FatalKafkaError(_fenced_sentence(transactional_id), fenced=True)
    if err.fatal() or code == _E._FATAL:
        return FatalKafkaError(f"{doing} failed with a fatal Kafka error: {err.str()}; exiting")
    if code in _UNKNOWN_TOPIC_CODES and topic is not None:
        return ConfigurationError(
            f"topic {topic} does not exist: create the topics with `saga topics create`"
        )
    if code in _AUTH_CODES:
        return ConfigurationError(
            f"{doing} was refused by Kafka: {err.str()}; check the security settings "
            "(security.protocol, sasl.*, ssl.*) and the ACLs"
        )
    return TransientError(f"{doing} failed: {err.str()}")


def _severity(error: SagaError) -> int:
    if isinstance(error, FatalKafkaError):
        return 2
    if isinstance(error, ConfigurationError):
        return 1
    return 0


def _log_client_error(err: ck.KafkaError) -> None:
    # librdkafka logs these errors itself (through saga.kafka.librdkafka) at the
    # level it finds right; repeating them louder here would double the noise.
    if err.fatal():
        _log.error("Kafka client: fatal error: %s", err.str())
    else:
        _log.debug("Kafka client: %s", err.str())


def _partition_count(metadata: Any, topic: str) -> int:
    described = metadata.topics.get(topic)
    if described is None or (
        described.error is not None and described.error.code() in _UNKNOWN_TOPIC_CODES
    ):
        raise ConfigurationError(
            f"topic {topic} does not exist: create the topics with `saga topics create`"
        )
    if described.error is not None:
        raise TransientError(f"describing topic {topic} failed: {described.error.str()}")
    return len(described.partitions)
