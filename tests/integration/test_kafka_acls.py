"""The ACLs of `saga acls apply` on the real broker's SASL_SSL listener.

With the ACLs of a fresh topic prefix applied (by the real command, as the admin
user), each role logs in with its own SCRAM credentials and can do its own job
but not another role's: a participant writes events and reads requests through
its group, yet cannot write decisions or status; a client writes requests and
reads status, yet cannot write events or decisions. The topics are created over
the PLAINTEXT listener, whose principal (User:ANONYMOUS) is a super user.

Needs Kafka's SASL listener (``KAFKA_SASL=on`` in infra/config.env, the default):
``SAGA_SASL_BOOTSTRAP``, ``SAGA_SASL_CA`` and ``SAGA_SASL_USERS``, or
``infra/services.sh env`` printing them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from saga.streams import ConfigurationError
from saga.streams.kafka import Consumer, KafkaSettings, Producer, delete_acls, saga_acls
from tests._infra import ROOT, KafkaSasl, Services, eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PARTICIPANT = "bank"


@pytest.fixture
def sasl(services: Services) -> KafkaSasl:
    if services.kafka_sasl is None:
        pytest.skip(
            "Kafka's SASL_SSL listener is not configured: set SAGA_SASL_BOOTSTRAP, "
            "SAGA_SASL_CA and SAGA_SASL_USERS (infra/services.sh env prints them with "
            "KAFKA_SASL=on)"
        )
    return services.kafka_sasl


def settings_as(sasl: KafkaSasl, user: str, prefix: str) -> KafkaSettings:
    return KafkaSettings(bootstrap=sasl.bootstrap, prefix=prefix, extra=sasl.client_config(user))


def saga_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def acl_prefix(sasl: KafkaSasl, kafka_topics: Any, topic_prefix: str) -> Iterator[str]:
    """The saga topics under a fresh prefix, with `saga acls apply`'s ACLs; removed after."""
    kafka_topics(["requests", "events", "decisions", "dlq"])
    kafka_topics(["status"], compacted=True)
    ran = saga_cli(
        "acls", "apply", "--bootstrap", sasl.bootstrap, "--prefix", topic_prefix,
        "--participants", PARTICIPANT, "--kafka-config", str(sasl.config_file("admin")),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert sasl.password("admin") not in ran.stdout + ran.stderr
    try:
        yield topic_prefix
    finally:
        delete_acls(
            settings_as(sasl, "admin", topic_prefix), saga_acls(topic_prefix, [PARTICIPANT])
        )


def produce_one(settings: KafkaSettings, topic: str) -> None:
    """One record to ``topic``, delivered (flush raises if it was not)."""
    with Producer(settings, client_id=f"acl-test-{uuid.uuid4().hex[:6]}") as producer:
        producer.produce(topic, b"k", b"{}")
        producer.flush(30)


def assert_refused(settings: KafkaSettings, topic: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        produce_one(settings, topic)
    text = str(refused.value)
    assert "refused by Kafka" in text, text
    assert "authoriz" in text.lower(), text


def read_one(consumer: Consumer, topic: str) -> bytes | None:
    def got() -> bytes | None:
        for message in consumer.poll_batch(10, 0.5):
            if message.topic == topic:
                return message.value or b"(empty)"
        return None

    return eventually(got, timeout=60, message=f"nothing read from {topic}")


def test_a_participant_cannot_write_decisions_or_status(sasl: KafkaSasl, acl_prefix: str) -> None:
    settings = settings_as(sasl, f"participant-{PARTICIPANT}", acl_prefix)
    assert_refused(settings, f"{acl_prefix}.decisions")
    assert_refused(settings, f"{acl_prefix}.status")


def test_a_client_cannot_write_events_or_decisions(sasl: KafkaSasl, acl_prefix: str) -> None:
    settings = settings_as(sasl, "client", acl_prefix)
    assert_refused(settings, f"{acl_prefix}.events")
    assert_refused(settings, f"{acl_prefix}.decisions")


def test_another_participant_is_refused_the_participants_group(
    sasl: KafkaSasl, acl_prefix: str
) -> None:
    """`User:participant-wallet` has no ACL for this deployment at all (it was not listed)."""
    assert_refused(settings_as(sasl, "participant-wallet", acl_prefix), f"{acl_prefix}.events")


def test_each_role_does_its_own_job(sasl: KafkaSasl, acl_prefix: str) -> None:
    """The client writes a request; the participant reads it through its group and writes
    an event; the client reads the status topic (written here by the coordinator's user)."""
    client = settings_as(sasl, "client", acl_prefix)
    participant = settings_as(sasl, f"participant-{PARTICIPANT}", acl_prefix)
    coordinator = settings_as(sasl, "coordinator", acl_prefix)

    produce_one(client, f"{acl_prefix}.requests")
    consumer = Consumer(
        participant,
        group_id=f"{acl_prefix}.participant.{PARTICIPANT}",
        client_id=f"{acl_prefix}.participant.{PARTICIPANT}",
    )
    try:
        consumer.subscribe([f"{acl_prefix}.requests"])
        assert read_one(consumer, f"{acl_prefix}.requests") == b"{}"
    finally:
        consumer.close()
    produce_one(participant, f"{acl_prefix}.events")

    produce_one(coordinator, f"{acl_prefix}.status")
    reader = Consumer(client, client_id="acl-test.status")
    try:
        reader.assign([(f"{acl_prefix}.status", 0, 0)])
        assert read_one(reader, f"{acl_prefix}.status") == b"{}"
    finally:
        reader.close()


def test_print_lists_each_role() -> None:
    ran = saga_cli("acls", "print", "--prefix", "p1", "--participants", "bank,wallet")
    assert ran.returncode == 0, ran.stderr
    principals = {line.split()[0] for line in ran.stdout.splitlines()[1:]}
    assert principals == {
        "User:client",
        "User:operator",
        "User:coordinator",
        "User:reconcile",
        "User:participant-bank",
        "User:participant-wallet",
    }
    writes = {
        (line.split()[0], line.split()[-1])
        for line in ran.stdout.splitlines()
        if line.split()[1] == "write" and line.split()[2] == "topic"
    }
    assert writes == {
        ("User:client", "p1.requests"),
        ("User:operator", "p1.requests"),
        ("User:operator", "p1.participants"),  # saga participants --forget
        ("User:participant-bank", "p1.events"),
        ("User:participant-bank", "p1.participants"),  # its announcements
        ("User:participant-wallet", "p1.events"),
        ("User:participant-wallet", "p1.participants"),
        ("User:coordinator", "p1.decisions"),
        ("User:coordinator", "p1.status"),
        ("User:coordinator", "p1.dlq"),
        ("User:coordinator", "p1.events"),  # steps of participants that never announced
    }


def test_only_an_administrator_applies_acls(
    sasl: KafkaSasl, topic_prefix: str, tmp_path: Path
) -> None:
    """The client's credentials are refused (no Alter on the cluster); a wrong admin
    password is refused at login. One sentence each, exit 2, no password shown."""
    as_client = saga_cli(
        "acls", "apply", "--bootstrap", sasl.bootstrap, "--prefix", topic_prefix,
        "--kafka-config", str(sasl.config_file("client")), "--timeout", "20",
    )  # fmt: skip
    assert as_client.returncode == 2, as_client.stdout + as_client.stderr
    assert "may not change ACLs" in as_client.stderr, as_client.stderr
    assert "Traceback" not in as_client.stderr
    assert sasl.password("client") not in as_client.stdout + as_client.stderr

    wrong = f"Wrong-{uuid.uuid4().hex}"
    config = tmp_path / "admin-wrong.properties"
    config.write_text(
        "".join(
            f"{k}={v}\n" for k, v in {**sasl.client_config("admin"), "sasl.password": wrong}.items()
        ),
        encoding="utf-8",
    )
    bad_login = saga_cli(
        "acls", "apply", "--bootstrap", sasl.bootstrap, "--prefix", topic_prefix,
        "--kafka-config", str(config), "--timeout", "20",
    )  # fmt: skip
    assert bad_login.returncode == 2, bad_login.stdout + bad_login.stderr
    assert "refused by Kafka" in bad_login.stderr.splitlines()[-1], bad_login.stderr
    assert "SASL authentication" in bad_login.stderr, bad_login.stderr
    assert "Traceback" not in bad_login.stderr
    assert wrong not in bad_login.stdout + bad_login.stderr
