"""The public surface of streams.kafka: exactly these names, each importable.

Other packages import the Kafka layer only through ``streams.kafka``; its private
modules (``streams.kafka._*``) may change freely. Adding or removing a public name
is a decision: update this list with it.
"""

from __future__ import annotations

import saga.streams.kafka
import saga.streams.log

# In sorted() order: code points, so upper case before lower case.
EXPECTED = [
    "AclRule",
    "Consumer",
    "DeliveryCallback",
    "KafkaLog",
    "KafkaSettings",
    "Message",
    "OFFSET_BEGINNING",
    "OFFSET_END",
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


def test_all_is_pinned() -> None:
    assert sorted(EXPECTED) == EXPECTED
    assert sorted(saga.streams.kafka.__all__) == EXPECTED
    assert len(saga.streams.kafka.__all__) == len(set(saga.streams.kafka.__all__))


def test_every_public_name_exists() -> None:
    for name in saga.streams.kafka.__all__:
        assert hasattr(saga.streams.kafka, name), name


def test_the_log_protocols_module_re_exports_the_kafka_log() -> None:
    assert saga.streams.log.KafkaLog is saga.streams.kafka.KafkaLog
    assert saga.streams.log.RebalanceCallback is saga.streams.kafka.RebalanceCallback
