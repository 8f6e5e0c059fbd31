"""The participants' stores as Spark DataFrames: their ledgers (for I4) and tables (for I5).

* PostgreSQL through Spark's JDBC source (the PostgreSQL driver jar is in the
  jars folder): the read runs on the executors, filters pushed down; MySQL and
  MariaDB the same way with MariaDB Connector/J (:mod:`streams.reconcile._mysql`).
* MongoDB and Redis through a partition reader written here, run by Spark as
  a Python task (``parallelize`` + ``flatMap``) that yields plain tuples, so
  the job needs no extra Python dependency (a Python ``DataSource`` would need
  pyarrow). The executors must have this package and the store's driver.

With a ``local`` master the executors are this process's JVM on this machine, so
the ledgers (and the MongoDB and Redis tables) are read right here, in the driver,
by the same readers (PostgreSQL's ledger with psycopg): a Python task would first
start a Python worker and import the store driver into it, which on the demo's
log cost more than reading its three ledgers, and the entries are counted on the
way (no Spark job just to count them). The job's ledger entries go to Spark as a
JSON-lines file in a scratch folder, which Spark reads itself (local data handed
to ``createDataFrame`` would be re-pickled by a Python task, starting a Python
worker after all); the tables are handed over as local data in chunks of
:data:`_CHUNK` rows.

Every ledger becomes rows of :data:`LEDGER_SCHEMA`, whatever its layout:

* SQL ``saga_ledger`` (``participants._sql``): one row per
  ``(participant, tx_id, step)``;
* MongoDB ``saga_ledger`` (``participants._mongo``): one document per step, with
  ``pending`` while a write's intent is unresolved (no transactions), and the
  decision documents that record some decisions beside their step documents
  (spooled to a temporary SQLite file while the steps stream past);
* Redis ``<prefix>:ledger:<participant>:tx:<tx_id>`` (``participants._redis``): a
  hash of step number to a JSON entry; the key layout is read from
  :mod:`participants._ledger`, where the adapter takes it from too.

The transaction-level markers are left out everywhere: the rollback marker
(``step = -1`` in SQL, ``rolled_back`` in MongoDB's transaction document and the
Redis hash) and the seen marker of a request without a step here (``step = -2``,
``seen``). Redis keys other than the ledger hashes (``in_flight``, ``finished``)
do not match the ``:tx:`` pattern. Entries a participant pruned after its
retention are absent here, as their transactions are from the coordinator's
memory.
This module imports the store drivers (psycopg, pymongo, redis) lazily, inside
the functions that need them.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial, reduce
from itertools import islice
from pathlib import Path
from typing import Any, Final
from urllib.parse import unquote, urlsplit

from saga.streams.reconcile import _mysql as mysql
from saga.streams.reconcile._config import LedgerSource, StoreSpec, TableSource
from saga.streams.reconcile._isolation import LEVEL_KEY, level_of
from saga.streams.reconcile._mongo_decisions import MongoDecisions
from saga.streams.reconcile._spark import ReconcileError

__all__ = [
    "LEDGER_SCHEMA",
    "LedgerFile",
    "ledger_frame",
    "ping",
    "read_ledger",
    "reads_here",
    "table_frame",
]

LEDGER_SCHEMA: Final = (
    "source STRING, participant STRING, tx_id STRING, step INT, status STRING, "
    "effect BOOLEAN, updated_ms BIGINT, pending BOOLEAN, level STRING"
)
_LEDGER_COLUMNS: Final = [
    "source",
    "participant",
    "tx_id",
    "step",
    "status",
    "effect",
    "updated_ms",
    "pending",
    "level",
]
_SAMPLE: Final = 500
_TIMEOUT_S: Final = 10
_CHUNK: Final = 100_000
"""Rows per local DataFrame when the driver reads a store: bounds this process's
memory whatever the ledger's size."""


# ---------------------------------------------------------------- PostgreSQL


def jdbc_address(url: str) -> tuple[str, dict[str, str]]:
    """``postgresql://user:pw@host:port/db?opts`` as a JDBC URL and its user/password
    (``mariadb://`` and ``mysql://``: :func:`streams.reconcile._mysql.jdbc_address`)."""
    if mysql.is_mysql(url):
        return mysql.jdbc_address(url)
    parts = urlsplit(url)
    if not parts.hostname:
        raise ReconcileError(
            f"the PostgreSQL URL {parts.scheme}://{parts.path} names no host; JDBC needs "
            "postgresql://user:password@host:port/database"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    database = parts.path.lstrip("/") or unquote(parts.username or "postgres")
    query = f"?{parts.query}" if parts.query else ""
    jdbc = f"jdbc:postgresql://{host}:{parts.port or 5432}/{database}{query}"
    props = {"driver": "org.postgresql.Driver"}
    if parts.username:
        props["user"] = unquote(parts.username)
    if parts.password:
        props["password"] = unquote(parts.password)
    return jdbc, props


def _qualified(schema: str | None, table: str) -> str:
    return f'"{schema}"."{table}"' if schema else f'"{table}"'


def jdbc_level(before: Any) -> Any:
    """The column of a ledger entry's level (:func:`._isolation.level_of`) from its
    ``before`` column as JDBC reads it (PostgreSQL ``json`` as text)."""
    from pyspark.sql import functions as F

    mark = F.get_json_object(before.cast("string"), f"$['{LEVEL_KEY}']")
    return F.when(mark == "read_committed", "read_committed").otherwise("none")


def _jdbc(spark: Any, store: StoreSpec, table: str) -> Any:
    jdbc, props = jdbc_address(store.url)
    reader = spark.read.format("jdbc").option("url", jdbc).option("fetchsize", "10000")
    for key, value in props.items():
        reader = reader.option(key, value)
    quote = mysql.qualified if mysql.is_mysql(store.url) else _qualified
    return reader.option("dbtable", quote(store.options.get("schema"), table)).load()


def _sql_ledger_rows(url: str, name: str, label: str) -> Iterator[tuple[Any, ...]]:
    """The step entries of the SQL ledger ``name`` (quoted), streamed by a server-side cursor."""
    import psycopg

    query = (
        "SELECT participant, tx_id, step, status, effect, updated_ms, "  # noqa: S608 (quoted)
        f"before ->> '{LEVEL_KEY}' FROM {name} WHERE step >= 0"
    )
    with (
        psycopg.connect(url, connect_timeout=_TIMEOUT_S) as conn,
        conn.cursor(name="saga_reconcile_ledger") as cursor,
    ):
        cursor.itersize = 10_000
        cursor.execute(query)
        for participant, tx_id, step, status, effect, updated_ms, level in cursor:
            yield (
                label,
                str(participant),
                str(tx_id),
                int(step),
                status,
                bool(effect),
                int(updated_ms or 0),
                False,
                level_of({LEVEL_KEY: level}),
            )


# ---------------------------------------------------------------- MongoDB


def _mongo_database(store: StoreSpec) -> str:
    path = urlsplit(store.url).path.lstrip("/")
    return store.options.get("database") or path.split("?")[0] or "saga"


def _mongo_client(url: str) -> Any:
    from pymongo import MongoClient

    timeout = _TIMEOUT_S * 1000
    return MongoClient(url, serverSelectionTimeoutMS=timeout, connectTimeoutMS=timeout)


def _mongo_ledger_rows(
    url: str, database: str, collection: str, label: str
) -> Iterator[tuple[Any, ...]]:
    client = _mongo_client(url)
    try:
        ledger = client[database][collection]
        with MongoDecisions(ledger) as decisions:
            names = ("participant", "tx_id", "step", "status", "effect", "updated_ms", "before")
            fields = {n: 1 for n in (*names, "rev")}
            fields["pending.at_ms"] = 1
            cursor = ledger.find({"step": {"$gte": 0}}, fields, batch_size=5000)
            for doc in cursor:
                pending = doc.get("pending") is not None
                before = doc.get("before")  # JSON text (MongoDB field names may not hold a dot)
                status, effect, updated_ms = (
                    doc.get("status"),
                    doc.get("effect"),
                    doc.get("updated_ms"),
                )
                if status == "applied" and not pending:
                    decided = decisions.get(str(doc["_id"]), doc.get("rev"))
                    if decided is not None:
                        status, effect, updated_ms = (
                            old if new is None else new
                            for old, new in zip((status, effect, updated_ms), decided, strict=True)
                        )
                yield (
                    label,
                    str(doc.get("participant")),
                    str(doc.get("tx_id")),
                    int(doc.get("step", -1)),
                    status or ("pending" if pending else None),
                    bool(effect or False),
                    int(updated_ms or 0),
                    pending,
                    level_of(json.loads(before) if isinstance(before, str) else before),
                )
    finally:
        client.close()


def _bson_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "BOOLEAN"
    if isinstance(value, int):
        return "BIGINT"
    if isinstance(value, float):
        return "DOUBLE"
    return "STRING"


def _widen(kinds: Iterable[str]) -> str:
    found = set(kinds)
    if len(found) == 1:
        return found.pop()
    if found <= {"BIGINT", "DOUBLE"}:
        return "DOUBLE"
    return "STRING"


def _cell(value: Any, kind: str) -> Any:
    if value is None:
        return None
    if kind == "BOOLEAN":
        return bool(value)
    if kind == "BIGINT":
        return int(value)
    if kind == "DOUBLE":
        return float(value)
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list):
        from bson import json_util

        return json_util.dumps(value)
    return str(value)


def _mongo_table_rows(
    url: str, database: str, collection: str, columns: list[tuple[str, str]]
) -> Iterator[tuple[Any, ...]]:
    client = _mongo_client(url)
    try:
        for doc in client[database][collection].find({}, batch_size=5000):
            yield tuple(_cell(doc.get(name), kind) for name, kind in columns)
    finally:
        client.close()


def _mongo_columns(store: StoreSpec, collection: str) -> list[tuple[str, str]]:
    client = _mongo_client(store.url)
    try:
        kinds: dict[str, list[str]] = {"_id": []}
        for doc in client[_mongo_database(store)][collection].find({}).limit(_SAMPLE):
            for name, value in doc.items():
                if value is not None and not name.startswith("_saga"):
                    kinds.setdefault(name, []).append(_bson_kind(value))
    finally:
        client.close()
    return [(name, _widen(found) if found else "STRING") for name, found in kinds.items()]


# ---------------------------------------------------------------- Redis


def _redis_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=_TIMEOUT_S)


def _redis_batches(client: Any, pattern: str) -> Iterator[list[tuple[str, dict[str, str]]]]:
    """Hashes whose key matches ``pattern``, read 500 at a time."""
    keys: list[bytes] = []

    def read(names: list[bytes]) -> list[tuple[str, dict[str, str]]]:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        out = []
        for name, fields in zip(names, pipe.execute(), strict=True):
            out.append((name.decode(), {k.decode(): v.decode() for k, v in (fields or {}).items()}))
        return out

    for key in client.scan_iter(match=pattern, count=1000, _type="HASH"):
        keys.append(key)
        if len(keys) >= 500:
            yield read(keys)
            keys = []
    if keys:
        yield read(keys)


def _redis_ledger_rows(url: str, prefix: str, label: str) -> Iterator[tuple[Any, ...]]:
    from saga.participants._ledger import redis_ledger_pattern, redis_tx_key_parts, step_of_field

    client = _redis_client(url)
    try:
        for batch in _redis_batches(client, redis_ledger_pattern(prefix)):
            for name, fields in batch:
                parts = redis_tx_key_parts(prefix, name)
                if parts is None:
                    continue
                participant, tx_id = parts
                for field, text in fields.items():
                    step = step_of_field(field)
                    if step is None:
                        continue  # a marker
                    entry = json.loads(text)
                    yield (
                        label,
                        participant,
                        tx_id,
                        step,
                        entry.get("status"),
                        bool(entry.get("effect", False)),
                        int(entry.get("updated_ms") or 0),
                        False,
                        level_of(entry.get("before")),
                    )
    finally:
        client.close()


def _redis_table_rows(url: str, prefix: str, fields: list[str]) -> Iterator[tuple[Any, ...]]:
    client = _redis_client(url)
    try:
        for batch in _redis_batches(client, f"{prefix}*"):
            for name, record in batch:
                yield (name[len(prefix) :], *(record.get(f) for f in fields))
    finally:
        client.close()


def _redis_fields(url: str, prefix: str) -> list[str]:
    client = _redis_client(url)
    try:
        seen: dict[str, None] = {}
        sampled = 0
        for batch in _redis_batches(client, f"{prefix}*"):
            for _, record in batch:
                seen.update(dict.fromkeys(record))
            sampled += len(batch)
            if sampled >= _SAMPLE:
                break
        return list(seen)
    finally:
        client.close()


# ---------------------------------------------------------------- frames


def reads_here(spark: Any) -> bool:
    """Whether stores are read in this process (a ``local`` master) rather than by tasks."""
    return str(spark.sparkContext.master or "").startswith("local")


def _local_frame(spark: Any, rows: Iterable[tuple[Any, ...]], schema: str) -> Any:
    """A DataFrame of ``rows``, read here, handed to Spark :data:`_CHUNK` rows at a time."""
    frames = []
    it = iter(rows)
    while True:
        chunk = list(islice(it, _CHUNK))
        frames.append(spark.createDataFrame(chunk, schema))
        if len(chunk) < _CHUNK:
            break
    return reduce(lambda a, b: a.unionByName(b), frames)


def _python_frame(spark: Any, rows: Any, schema: str) -> Any:
    """A DataFrame of what ``rows()`` yields: read by a Spark task (one partition), or
    here with a ``local`` master (:func:`reads_here`)."""
    if reads_here(spark):
        return _local_frame(spark, rows(), schema)
    return spark.createDataFrame(
        spark.sparkContext.parallelize([0], 1).flatMap(lambda _: rows()), schema
    )


@dataclass(frozen=True)
class LedgerFile:
    """One ledger read here (:func:`read_ledger`): its entries' JSON-lines file and the
    entries per participant."""

    path: str
    counts: Counter[str]


def _rows_here(source: LedgerSource, counts: Counter[str]) -> Iterator[tuple[Any, ...]]:
    """A ledger's step entries read here (of its ``participants`` when given), counted
    per participant into ``counts``."""
    store = source.store
    label = source.label
    wanted = set(source.participants) if source.participants is not None else None
    if store.kind == "sql" and mysql.is_mysql(store.url):
        name = mysql.qualified(store.options.get("schema"), store.option("table", "saga_ledger"))
        rows = mysql.ledger_rows(store.url, name, label)
    elif store.kind == "sql":
        name = _qualified(store.options.get("schema"), store.option("table", "saga_ledger"))
        rows = _sql_ledger_rows(store.url, name, label)
    elif store.kind == "mongo":
        collection = store.option("collection", "saga_ledger")
        rows = _mongo_ledger_rows(store.url, _mongo_database(store), collection, label)
    else:
        rows = _redis_ledger_rows(store.url, store.option("prefix", "saga"), label)
    for row in rows:
        if wanted is None or row[1] in wanted:
            counts[row[1]] += 1
            yield row


def read_ledger(source: LedgerSource, scratch: Path) -> LedgerFile:
    """Read a ledger's step entries here (no Spark: it may still be starting) into a
    JSON-lines file in the folder ``scratch``, counting them per participant.

    Spark reads the file itself (:func:`ledger_frame`): the same rows handed to
    ``createDataFrame`` as a local list would be re-pickled by a Python task, which
    starts a Python worker (on the demo's log that cost more than the three
    ledgers' rows). This process holds one row at a time.
    """
    counts: Counter[str] = Counter()
    handle, path = tempfile.mkstemp(suffix=".jsonl", dir=scratch)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        for row in _rows_here(source, counts):
            out.write(json.dumps(dict(zip(_LEDGER_COLUMNS, row, strict=True))))
            out.write("\n")
    return LedgerFile(path, counts)


def ledger_frame(
    spark: Any, source: LedgerSource, scratch: Path | None = None, read: LedgerFile | None = None
) -> tuple[Any, Counter[str] | None]:
    """The step entries of one ledger as rows of :data:`LEDGER_SCHEMA`, and the entries
    per participant when they were read here (:func:`reads_here`), else None.

    ``read``: the ledger already read here (:func:`read_ledger`); else, when it is to be
    read here, it is read now into ``scratch`` (a temporary folder of the caller's,
    which must outlive every use of the frame), or without one handed over as local
    data (:func:`_local_frame`)."""
    store = source.store
    label = source.label
    if read is None and reads_here(spark):
        if scratch is None:
            counts: Counter[str] = Counter()
            return _local_frame(spark, _rows_here(source, counts), LEDGER_SCHEMA), counts
        read = read_ledger(source, scratch)
    if read is not None:
        frame = spark.read.schema(LEDGER_SCHEMA).option("mode", "FAILFAST").json(read.path)
        return frame, read.counts
    if store.kind == "sql":
        from pyspark.sql import functions as F

        frame = _jdbc(spark, store, store.option("table", "saga_ledger")).where("step >= 0")
        frame = frame.select(
            F.lit(label).alias("source"),
            "participant",
            "tx_id",
            F.col("step").cast("int").alias("step"),
            "status",
            F.col("effect").cast("boolean").alias("effect"),
            F.col("updated_ms").cast("bigint").alias("updated_ms"),
            F.lit(False).alias("pending"),
            jdbc_level(F.col("before")).alias("level"),
        )
    elif store.kind == "mongo":
        reader = partial(
            _mongo_ledger_rows,
            store.url,
            _mongo_database(store),
            store.option("collection", "saga_ledger"),
            label,
        )
        frame = _python_frame(spark, reader, LEDGER_SCHEMA)
    else:
        reader = partial(_redis_ledger_rows, store.url, store.option("prefix", "saga"), label)
        frame = _python_frame(spark, reader, LEDGER_SCHEMA)
    if source.participants is not None:
        frame = frame.where(frame.participant.isin(list(source.participants)))
    return frame, None


def table_frame(spark: Any, table: TableSource) -> Any:
    """A store's table (SQL table, Mongo collection, Redis hash records) as a DataFrame.

    Columns: SQL — the table's; MongoDB — ``_id`` and every field seen in the first
    500 documents (numbers as BIGINT or DOUBLE, booleans, the rest as text);
    Redis — ``key`` (the part after ``<prefix>:<target>:``) and every hash field seen,
    as text (cast in the query).
    """
    store = table.store
    if store.kind == "sql":
        return _jdbc(spark, store, store.option("table", table.name))
    if store.kind == "mongo":
        collection = store.option("collection", table.name)
        columns = _mongo_columns(store, collection)
        schema = ", ".join(f"`{name}` {kind}" for name, kind in columns)
        reader = partial(_mongo_table_rows, store.url, _mongo_database(store), collection, columns)
        return _python_frame(spark, reader, schema)
    prefix = f"{store.option('prefix', 'saga')}:{store.option('target', table.name)}:"
    fields = _redis_fields(store.url, prefix)
    schema = ", ".join(["key STRING", *(f"`{f}` STRING" for f in fields)])
    return _python_frame(spark, partial(_redis_table_rows, store.url, prefix, fields), schema)


# ---------------------------------------------------------------- reachability


def ping(store: StoreSpec, ledger_table: str | None = None) -> None:
    """Fail fast, before Spark starts, when a store does not answer (or lacks its ledger).

    Raises:
        ReconcileError: one sentence naming the store and the problem.
    """
    try:
        if store.kind == "sql" and mysql.is_mysql(store.url):
            mysql.ping(store, ledger_table)
        elif store.kind == "sql":
            _ping_postgres(store, ledger_table)
        elif store.kind == "mongo":
            client = _mongo_client(store.url)
            try:
                client.admin.command("ping")
            finally:
                client.close()
        else:
            client = _redis_client(store.url)
            try:
                client.ping()
            finally:
                client.close()
    except ReconcileError:
        raise
    except Exception as exc:  # any driver's failure to answer
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ReconcileError(f"cannot reach {store.where}: {detail}") from None


def _ping_postgres(store: StoreSpec, ledger_table: str | None) -> None:
    import psycopg

    with psycopg.connect(store.url, connect_timeout=_TIMEOUT_S) as conn:
        if ledger_table is None:
            return
        name = _qualified(store.options.get("schema"), ledger_table)
        found = conn.execute("SELECT to_regclass(%s)", (name,)).fetchone()
        if found is None or found[0] is None:
            raise ReconcileError(f"{store.where} has no table {name}")
