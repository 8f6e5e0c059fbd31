"""Test infrastructure: which services to use, and per-test factories on top of them.

``SAGA_INFRA`` = ``local`` | ``external`` | ``containers`` (see ``tests/_infra.py``).
The ``services`` fixture fails (never skips) with one sentence when a service is down.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# tests/ has no __init__.py: put the repository root on sys.path so that the shared
# helpers import as `tests._infra` whether or not PYTHONPATH=. is set.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests._infra import (  # noqa: E402
    Services,
    eventually,
    resolve_services,
    select_mode,
    sqlalchemy_url,
    unique_name,
    unreachable,
    unreachable_message,
)

if TYPE_CHECKING:
    from pymongo.database import Database

KafkaTopicFactory = Callable[..., list[str]]


@pytest.fixture(scope="session")
def infra_mode() -> str:
    """``local``, ``external`` or ``containers``: SAGA_INFRA, else chosen by `docker info`."""
    try:
        return select_mode()
    except pytest.UsageError as exc:
        problem = str(exc)
    pytest.fail(problem, pytrace=False)  # outside `except`: no chained traceback


@pytest.fixture(scope="session")
def services(infra_mode: str) -> Iterator[Services]:
    """The session's service addresses, each checked to answer within a few seconds."""
    with contextlib.ExitStack() as stack:
        problem = None
        try:
            found = resolve_services(infra_mode, stack)
        except pytest.UsageError as exc:
            problem = str(exc)
        except Exception as exc:  # e.g. no Docker engine, or a container that does not start
            problem = (
                f"SAGA_INFRA={infra_mode}: the services could not be started: "
                f"{type(exc).__name__}: {exc}"
            )
        if problem is not None:
            pytest.fail(problem, pytrace=False)  # outside `except`: no chained traceback
        down = unreachable(found)
        if down:
            pytest.fail(unreachable_message(down, infra_mode), pytrace=False)
        yield found


@pytest.fixture
def topic_prefix() -> str:
    """A fresh ``t<8 hex>`` token for this test; the other factories derive their names from it."""
    return unique_name("t")


@pytest.fixture
def kafka_topics(services: Services, topic_prefix: str) -> Iterator[KafkaTopicFactory]:
    """``make(names, partitions=1, compacted=False) -> list[str]``: creates the topics
    ``<topic_prefix>.<name>`` (ready to use: every partition has a leader) and deletes
    them after the test."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": services.kafka_bootstrap})
    created: list[str] = []

    def ready(topics: list[str], partitions: int) -> bool:
        metadata = admin.list_topics(timeout=10)
        for name in topics:
            topic = metadata.topics.get(name)
            if topic is None or topic.error is not None or len(topic.partitions) != partitions:
                return False
            if any(p.leader < 0 for p in topic.partitions.values()):
                return False
        return True

    def make(names: list[str], partitions: int = 1, compacted: bool = False) -> list[str]:
        topics = [f"{topic_prefix}.{name}" for name in names]
        config = {"cleanup.policy": "compact"} if compacted else {}
        futures = admin.create_topics(
            [
                NewTopic(t, num_partitions=partitions, replication_factor=1, config=config)
                for t in topics
            ],
            operation_timeout=30,
            request_timeout=30,
        )
        for topic, future in futures.items():
            future.result(timeout=60)
            created.append(topic)
        eventually(
            lambda: ready(topics, partitions),
            timeout=30,
            message=f"topics {topics} did not get partition leaders",
            retry_on=(KafkaException,),
        )
        return topics

    yield make

    if created:
        futures = admin.delete_topics(created, operation_timeout=30, request_timeout=30)
        for future in futures.values():
            try:
                future.result(timeout=60)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise


@pytest.fixture
def pg_schema(services: Services, topic_prefix: str) -> Iterator[tuple[str, str]]:
    """``(engine_url, schema_name)``: a fresh PostgreSQL schema named after ``topic_prefix``;
    ``engine_url`` is a ``postgresql+psycopg://`` SQLAlchemy URL. Dropped CASCADE after."""
    import sqlalchemy as sa

    url = sqlalchemy_url(services.postgres_url)
    schema = topic_prefix
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        yield url, schema
        with engine.begin() as conn:
            # A test that leaks a connection holding locks makes this fail, not hang.
            conn.execute(sa.text("SET LOCAL lock_timeout = '10s'"))
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    finally:
        engine.dispose()


@pytest.fixture
def mongo_db(services: Services, topic_prefix: str) -> Iterator[Database[dict[str, Any]]]:
    """A pymongo Database named after ``topic_prefix``; dropped after the test."""
    import pymongo

    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        services.mongo_url, serverSelectionTimeoutMS=10_000
    )
    try:
        yield client[topic_prefix]
        client.drop_database(topic_prefix)
    finally:
        client.close()


@pytest.fixture
def redis_prefix(services: Services, topic_prefix: str) -> Iterator[str]:
    """A key prefix ``<topic_prefix>:``; every key under it is deleted (SCAN) after the test."""
    import redis

    prefix = f"{topic_prefix}:"
    yield prefix
    client = redis.Redis.from_url(services.redis_url)
    try:
        batch = [key for key in client.scan_iter(match=f"{prefix}*", count=500)]
        if batch:
            client.delete(*batch)
    finally:
        client.close()
