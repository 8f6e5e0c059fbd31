"""The bench's data in the stores: checks, preparation, totals and clean-up.

Each participant's records live in the store the layout gives it: a table
``<schema>.<target>`` (``id``, the field) in PostgreSQL (in MariaDB: the database
``<schema>``, touched only when a layout puts a participant there), a collection ``<target>``
of database ``<schema>`` in the MongoDB-wire server, hashes
``<schema>:<target>:<account>`` in Redis; targets are ``accounts`` (bank),
``wallets`` (wallet) and ``points`` (rewards).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from rich.console import Console

from saga.streams import TransientError
from saga.tools.bench.config import (
    FIELD_OF,
    OPENING_BALANCE,
    PARTICIPANTS,
    STORES,
    TARGET_OF,
    BenchConfig,
    Layout,
    account,
)


def sa_url(url: str) -> str:
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    for scheme in ("mariadb://", "mysql://"):
        if url.startswith(scheme):
            return url.replace("://", "+pymysql://", 1)
    return url


def mongo_client(url: str) -> Any:
    """A client that gives up on a server that stops answering, instead of waiting forever."""
    import pymongo

    return pymongo.MongoClient(url, serverSelectionTimeoutMS=10_000, socketTimeoutMS=60_000)


# --------------------------------------------------------------------------- services


def check_services(cfg: BenchConfig, console: Console) -> None:
    """One line per service: it answers, or the bench stops with a sentence saying which."""
    from saga.tools.demo import DemoConfig
    from saga.tools.demo import check_services as check

    check(DemoConfig(cfg.kafka, cfg.postgres_url, cfg.mongo_url, cfg.redis_url), console)
    # A stuck MongoDB-wire server still answers the handshake; ask it for real work.
    import pymongo

    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        cfg.mongo_url, serverSelectionTimeoutMS=5_000, socketTimeoutMS=10_000
    )
    try:
        client[cfg.schema].list_collection_names()
    except pymongo.errors.PyMongoError as exc:
        raise TransientError(
            f"the MongoDB-wire server at {cfg.mongo_url} accepts connections but does not "
            "answer database commands within 10 s: is it stuck? (restart it)"
        ) from exc
    finally:
        client.close()
    if cfg.mariadb_url and any("mariadb" in x.stores.values() for x in cfg.layouts):
        with _store(cfg, "mariadb") as engine, engine.connect() as conn:
            version = conn.execute(sa.text("SELECT VERSION()")).scalar()
        console.print(f"  mariadb    {version}  [green]answers[/]")


@contextmanager
def _store(cfg: BenchConfig, which: str) -> Iterator[Any]:
    """A connection to one store; its failures read as one sentence naming the store."""
    import pymongo
    import redis

    urls = {"postgres": cfg.postgres_url, "mongo": cfg.mongo_url, "redis": cfg.redis_url}
    urls["mariadb"] = cfg.mariadb_url
    names = {"postgres": "PostgreSQL", "mongo": "the MongoDB-wire server", "redis": "Redis"}
    names["mariadb"] = "MariaDB"
    handle: Any = None
    try:
        if which in ("postgres", "mariadb"):
            handle = sa.create_engine(sa_url(urls[which]))
        elif which == "mongo":
            handle = mongo_client(cfg.mongo_url)
        else:
            handle = redis.Redis.from_url(cfg.redis_url, socket_timeout=60)
        yield handle
    except (sa.exc.OperationalError, pymongo.errors.PyMongoError, redis.RedisError) as exc:
        detail = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise TransientError(f"{names[which]} at {urls[which]} failed: {detail}") from exc
    finally:
        if handle is not None:
            handle.dispose() if which in ("postgres", "mariadb") else handle.close()


def opening(participant: str) -> int:
    """Each record's opening value: the bank is debited, the others credited from 0."""
    return OPENING_BALANCE if participant == "bank" else 0


def prepare_data(cfg: BenchConfig, layout: Layout) -> None:
    """Fresh records for every participant in the store ``layout`` gives it (no ledgers).

    Whatever the layout, the PostgreSQL schema, the MongoDB database and the Redis
    keys under the schema name are dropped first, so nothing of an earlier phase stays.
    """
    on = {store: [p for p in PARTICIPANTS if layout.stores[p] == store] for store in STORES}
    with _store(cfg, "postgres") as engine:
        with engine.begin() as conn:
            conn.execute(sa.schema.DropSchema(cfg.schema, cascade=True, if_exists=True))
            conn.execute(sa.schema.CreateSchema(cfg.schema))
            for participant in on["postgres"]:
                table = target_table(cfg.schema, participant)
                table.create(conn)
                value, field = opening(participant), FIELD_OF[participant]
                conn.execute(
                    table.insert(), [{"id": account(i), field: value} for i in range(cfg.accounts)]
                )
        # Now, not during the phase: autovacuum's first pass over the fresh rows (hint
        # bits, visibility map, statistics) competed with the measured window.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for participant in on["postgres"]:
                table = target_table(cfg.schema, participant)
                conn.execute(sa.text(f'VACUUM (ANALYZE) "{cfg.schema}"."{table.name}"'))
    if on["mariadb"]:
        _prepare_mariadb(cfg, on["mariadb"])
    with _store(cfg, "mongo") as mongo:
        mongo.drop_database(cfg.schema)
        for participant in on["ferretdb"]:
            docs = mongo[cfg.schema][TARGET_OF[participant]]
            value, field = opening(participant), FIELD_OF[participant]
            for start in range(0, cfg.accounts, 5000):
                end = min(cfg.accounts, start + 5000)
                docs.insert_many([{"_id": account(i), field: value} for i in range(start, end)])
    with _store(cfg, "redis") as r:
        _drop_redis(r, cfg.schema)
        with r.pipeline(transaction=False) as pipe:
            for participant in on["redis"]:
                value, field = opening(participant), FIELD_OF[participant]
                for i in range(cfg.accounts):
                    pipe.hset(redis_key(cfg.schema, participant, account(i)), field, value)
            pipe.execute()


def _prepare_mariadb(cfg: BenchConfig, participants: list[str]) -> None:
    """The database ``<schema>`` afresh, with the tables of ``participants``."""
    with _store(cfg, "mariadb") as engine, engine.begin() as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{cfg.schema}`"))
        conn.execute(sa.text(f"CREATE DATABASE `{cfg.schema}`"))
        for participant in participants:
            table = target_table(cfg.schema, participant, "mariadb")
            table.create(conn)
            value, field = opening(participant), FIELD_OF[participant]
            for start in range(0, cfg.accounts, 5000):
                end = min(cfg.accounts, start + 5000)
                rows = [{"id": account(i), field: value} for i in range(start, end)]
                conn.execute(table.insert(), rows)


def drop_data(cfg: BenchConfig) -> None:
    """Remove what :func:`prepare_data` and the participants created."""
    with _store(cfg, "postgres") as engine, engine.begin() as conn:
        conn.execute(sa.schema.DropSchema(cfg.schema, cascade=True, if_exists=True))
    if cfg.mariadb_url:
        with _store(cfg, "mariadb") as engine, engine.begin() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{cfg.schema}`"))
    with _store(cfg, "mongo") as mongo:
        mongo.drop_database(cfg.schema)
    with _store(cfg, "redis") as r:
        _drop_redis(r, cfg.schema)


def redis_key(schema: str, participant: str, key: str) -> str:
    """The hash of ``participant``'s record ``key`` (the Redis participant's key layout)."""
    return f"{schema}:{TARGET_OF[participant]}:{key}"


def _drop_redis(r: Any, prefix: str) -> None:
    batch: list[bytes] = []
    for key in r.scan_iter(match=f"{prefix}:*", count=5000):
        batch.append(key)
        if len(batch) >= 5000:
            r.unlink(*batch)
            batch = []
    if batch:
        r.unlink(*batch)


def target_table(schema: str, participant: str, store: str = "postgres") -> sa.Table:
    """``participant``'s table on PostgreSQL (or MariaDB, whose keys need a length, and
    binary: ``a000001`` is one account only): ``id`` and its one numeric field."""
    key: Any = sa.Text if store == "postgres" else sa.String(16, collation="utf8mb4_bin")
    return sa.Table(
        TARGET_OF[participant],
        sa.MetaData(schema=schema),
        sa.Column("id", key, primary_key=True),
        sa.Column(FIELD_OF[participant], sa.BigInteger, nullable=False),
    )


def store_totals(cfg: BenchConfig, layout: Layout) -> dict[str, int]:
    """Money moved per participant: debited from the bank, credited to the others."""
    totals: dict[str, int] = {}
    for participant in PARTICIPANTS:
        store, field = layout.stores[participant], FIELD_OF[participant]
        if store in ("postgres", "mariadb"):
            table = target_table(cfg.schema, participant, store)
            with _store(cfg, store) as engine, engine.connect() as conn:
                total = int(conn.execute(sa.select(sa.func.sum(table.c[field]))).scalar() or 0)
        elif store == "ferretdb":
            with _store(cfg, "mongo") as mongo:
                docs = mongo[cfg.schema][TARGET_OF[participant]].find({}, {field: 1})
                total = sum(int(d.get(field, 0)) for d in docs)
        else:
            with _store(cfg, "redis") as r, r.pipeline(transaction=False) as pipe:
                for i in range(cfg.accounts):
                    pipe.hget(redis_key(cfg.schema, participant, account(i)), field)
                total = sum(int(v or 0) for v in pipe.execute())
        opened = cfg.accounts * opening(participant)
        totals[participant] = opened - total if participant == "bank" else total - opened
    return totals
