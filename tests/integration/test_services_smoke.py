"""Each service does what the coordinator relies on, against the real services.

Kafka: transactions and read_committed isolation. PostgreSQL: commit and rollback through
SQLAlchemy 2.0 + psycopg 3. Redis: strings, hashes and AOF. MongoDB wire (FerretDB):
single-document writes and unique _id. Spark: a batch read of a Kafka topic with the
connector jars provisioned by infra/services.sh.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from tests._infra import Services, eventually

if TYPE_CHECKING:
    from pymongo.database import Database
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.integration

KafkaTopicFactory = Callable[..., list[str]]


def read_values(services: Services, topic: str, isolation: str, until: str) -> list[str]:
    """Values of partition 0 of ``topic`` from the beginning, as seen with ``isolation``,
    read until ``until`` has arrived (with a deadline)."""
    consumer = Consumer(
        {
            "bootstrap.servers": services.kafka_bootstrap,
            "group.id": f"{topic}.{isolation}",
            "isolation.level": isolation,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    seen: list[str] = []

    def arrived() -> bool:
        message = consumer.poll(0.5)
        if message is not None:
            error = message.error()
            if error is not None and error.code() != KafkaError._PARTITION_EOF:
                raise AssertionError(f"consumer error: {error}")
            if error is None:
                seen.append(message.value().decode())
        return until in seen

    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        eventually(arrived, timeout=30, interval=0, message=f"{until!r} never arrived on {topic}")
    finally:
        consumer.close()
    return seen


def test_kafka_read_committed_skips_aborted_transactions(
    services: Services, kafka_topics: KafkaTopicFactory, topic_prefix: str
) -> None:
    """A read_committed consumer sees the records of committed transactions only (a1, a2,
    c1, in order) and never those of an aborted one (b1), which read_uncommitted does see."""
    (topic,) = kafka_topics(["txn"])
    producer = Producer(
        {
            "bootstrap.servers": services.kafka_bootstrap,
            "transactional.id": f"{topic_prefix}.producer",
            "enable.idempotence": True,
            "acks": "all",
        }
    )
    producer.init_transactions(30)

    def transaction(values: list[str], commit: bool) -> None:
        producer.begin_transaction()
        for value in values:
            producer.produce(topic, key=value.encode(), value=value.encode())
        if commit:
            producer.commit_transaction(30)
        else:
            producer.flush(30)  # the records reach the log, then the abort marker follows
            producer.abort_transaction(30)

    transaction(["a1", "a2"], commit=True)
    transaction(["b1"], commit=False)
    transaction(["c1"], commit=True)

    assert read_values(services, topic, "read_committed", until="c1") == ["a1", "a2", "c1"]
    assert read_values(services, topic, "read_uncommitted", until="c1") == [
        "a1",
        "a2",
        "b1",
        "c1",
    ]


def test_postgres_commit_is_visible_and_rollback_is_not(pg_schema: tuple[str, str]) -> None:
    """In a fresh schema, a committed insert is read back from another connection and a
    rolled-back insert (visible inside its own transaction) leaves no trace."""
    import sqlalchemy as sa

    url, schema = pg_schema
    assert url.startswith("postgresql+psycopg://")
    table = f'"{schema}".accounts'
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"CREATE TABLE {table} (id text PRIMARY KEY, balance int NOT NULL)")
            )
            conn.execute(sa.text(f"INSERT INTO {table} VALUES ('acc-1', 100)"))

        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT id, balance FROM {table}")).all()
        assert [tuple(r) for r in rows] == [("acc-1", 100)]

        with engine.connect() as conn:
            tx = conn.begin()
            conn.execute(sa.text(f"INSERT INTO {table} VALUES ('acc-2', 5)"))
            inside = conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()
            tx.rollback()
        assert inside == 2

        with engine.connect() as conn:
            ids = conn.execute(sa.text(f"SELECT id FROM {table} ORDER BY id")).scalars().all()
        assert ids == ["acc-1"]
    finally:
        engine.dispose()


def test_redis_strings_hashes_and_append_only_file(services: Services, redis_prefix: str) -> None:
    """Strings and hashes round-trip under the test's key prefix, and the server runs with
    the append-only file on (the durability the Redis participant assumes)."""
    import redis

    client = redis.Redis.from_url(services.redis_url, decode_responses=True)
    try:
        assert client.set(f"{redis_prefix}greeting", "hello")
        assert client.get(f"{redis_prefix}greeting") == "hello"

        client.hset(f"{redis_prefix}account", mapping={"balance": "10", "currency": "EUR"})
        assert client.hgetall(f"{redis_prefix}account") == {"balance": "10", "currency": "EUR"}

        assert client.config_get("appendonly") == {"appendonly": "yes"}
    finally:
        client.close()


def test_mongo_single_document_writes_and_unique_id(
    mongo_db: Database[dict[str, Any]],
) -> None:
    """Over the MongoDB wire protocol: insert, find, $inc update, and a second insert with
    the same _id is refused with DuplicateKeyError."""
    from pymongo.errors import DuplicateKeyError

    accounts = mongo_db["accounts"]
    accounts.insert_one({"_id": "acc-1", "balance": 10})
    assert accounts.find_one({"_id": "acc-1"}) == {"_id": "acc-1", "balance": 10}

    result = accounts.update_one({"_id": "acc-1"}, {"$inc": {"balance": 5}})
    assert (result.matched_count, result.modified_count) == (1, 1)
    assert accounts.find_one({"_id": "acc-1"}) == {"_id": "acc-1", "balance": 15}

    with pytest.raises(DuplicateKeyError):
        accounts.insert_one({"_id": "acc-1", "balance": 0})
    assert accounts.count_documents({}) == 1


@pytest.fixture(scope="module")
def spark(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    """A local[2] SparkSession with the provisioned Kafka connector jars (slow to start,
    so one per module)."""
    from pyspark.sql import SparkSession

    jars = services.spark_jars
    assert jars, f"no jars in {services.spark_jars_dir}"
    session = (
        SparkSession.builder.master("local[2]")
        .appName("saga-smoke")
        .config("spark.jars", ",".join(str(j) for j in jars))
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.memory", "1g")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.warehouse.dir", str(tmp_path_factory.mktemp("spark-warehouse")))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("WARN")
    yield session
    session.stop()


@pytest.mark.timeout(600)
def test_spark_reads_a_kafka_topic_as_a_batch(
    services: Services, kafka_topics: KafkaTopicFactory, spark: SparkSession
) -> None:
    """Spark's Kafka source, with the jars from infra/services.sh, reads all 50 records of a
    topic as a batch, and from_json with an explicit schema recovers their amounts."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    (topic,) = kafka_topics(["audit"], partitions=2)
    failures: list[str] = []

    def delivered(err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            failures.append(str(err))

    producer = Producer({"bootstrap.servers": services.kafka_bootstrap, "acks": "all"})
    for i in range(1, 51):
        record = {"id": f"r{i}", "amount": i}
        producer.produce(topic, key=f"k{i}", value=json.dumps(record), on_delivery=delivered)
    assert producer.flush(30) == 0
    assert failures == []

    frame = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", services.kafka_bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .load()
    )
    assert frame.count() == 50

    schema = StructType([StructField("id", StringType()), StructField("amount", LongType())])
    parsed = frame.select(F.from_json(F.col("value").cast("string"), schema).alias("r"))
    row = parsed.agg(F.sum("r.amount").alias("total"), F.countDistinct("r.id").alias("ids")).first()
    assert row is not None
    assert (row["total"], row["ids"]) == (sum(range(1, 51)), 50)
