"""Kafka clients behind a thin typed layer: the only package of saga that imports confluent_kafka.

Everything else in the project sees :class:`KafkaSettings`, :class:`Message`,
``(topic, partition)`` tuples and saga's own errors (:mod:`streams._errors`);
confluent-kafka objects and ``KafkaException`` never leave this package.

Offsets: the off-by-one
-----------------------
Every offset this package takes or returns for committing, resuming or
positioning is **the next offset to read**, i.e. *the offset of the last record
processed + 1* (:attr:`Message.next_offset`). That is Kafka's convention for
committed offsets: a consumer that restarts from committed offset ``N`` reads the
record at ``N`` first. Committing ``message.offset`` instead of
``message.offset + 1`` re-delivers the last processed record after every
restart or rebalance; committing ``+ 2`` silently skips one. This applies to
:meth:`Consumer.commit`, :meth:`Consumer.committed`, :meth:`Consumer.position`,
:meth:`Consumer.assign`, :meth:`Consumer.seek` (which takes the offset of the
next record wanted) and :meth:`TransactionalProducer.send_offsets`.

Errors
------
* :class:`~streams._errors.FatalKafkaError` — the client cannot go on: a fenced
  transactional producer (another instance took over its ``transactional.id``)
  or any error librdkafka flags as fatal. The process should exit.
* :class:`TransactionAborted` (a :class:`~streams._errors.TransientError`) — the
  current Kafka transaction cannot commit; abort it and re-process from the last
  committed offsets.
* :class:`~streams._errors.TransientError` — the broker is unreachable, slow or
  rebalancing; retrying later can help.
* :class:`~streams._errors.ConfigurationError` — bad settings, a missing topic,
  authentication or authorisation refused.

Partitioning: every producer here hashes keys with murmur2 (``murmur2_random``),
the Java client's partitioner, so a record re-published by a JVM client (the
Spark reconciliation job) lands on the same partition as one produced from
Python. librdkafka's own default (CRC32) would not.

Modules (private; import from here): ``_settings`` (:class:`KafkaSettings`,
client configuration), ``_message`` (:class:`Message`, partitions, offsets),
``_translate`` (librdkafka errors to saga's), ``_acls`` (the ACLs of each saga
role: :func:`saga_acls`, :func:`apply_acls`), ``_producer`` (the two producers
and the transactional watchdog), ``_consumer``, ``_admin`` (topics, broker
readiness), ``_dlq`` (:func:`partition_for`, :func:`send_to_dlq`) and ``_log``
(:class:`KafkaLog`, the production :class:`streams.log.Log`).
"""

from saga.streams.kafka._acls import AclRule, apply_acls, delete_acls, format_acls, saga_acls
from saga.streams.kafka._admin import (
    create_topics,
    delete_topics,
    describe_partitions,
    topic_config,
    wait_for_broker,
)
from saga.streams.kafka._consumer import Consumer
from saga.streams.kafka._dlq import partition_for, send_to_dlq
from saga.streams.kafka._log import KafkaLog
from saga.streams.kafka._message import (
    OFFSET_BEGINNING,
    OFFSET_END,
    DeliveryCallback,
    Message,
    Partition,
    RebalanceCallback,
)
from saga.streams.kafka._producer import Producer
from saga.streams.kafka._settings import KafkaSettings
from saga.streams.kafka._translate import TransactionAborted
from saga.streams.kafka._txn_producer import TransactionalProducer

__all__ = [
    "OFFSET_BEGINNING",
    "OFFSET_END",
    "AclRule",
    "Consumer",
    "DeliveryCallback",
    "KafkaLog",
    "KafkaSettings",
    "Message",
    "Partition",
    "Producer",
    "RebalanceCallback",
    "TransactionAborted",
    "TransactionalProducer",
    "apply_acls",
    "create_topics",
    "delete_acls",
    "delete_topics",
    "describe_partitions",
    "format_acls",
    "partition_for",
    "saga_acls",
    "send_to_dlq",
    "topic_config",
    "wait_for_broker",
]
