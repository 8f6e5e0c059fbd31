"""The bench's data in the three stores: checks, preparation, totals and clean-up.

Accounts live in PostgreSQL (``<schema>.accounts``), the MongoDB-wire server
(database ``<schema>``, collection ``wallets``) and Redis (hashes
``<schema>:points:<account>``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from rich.console import Console

from sagatools.bench.config import OPENING_BALANCE, TARGET_OF, BenchConfig, account
from streams import TransientError


def sa_url(url: str) -> str:
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def mongo_client(url: str) -> Any:
    """A client that gives up on a server that stops answering, instead of waiting forever."""
    import pymongo

    return pymongo.MongoClient(url, serverSelectionTimeoutMS=10_000, socketTimeoutMS=60_000)


# --------------------------------------------------------------------------- services


def check_services(cfg: BenchConfig, console: Console) -> None:
    """One line per service: it answers, or the bench stops with a sentence saying which."""
    from sagatools.demo import DemoConfig
    from sagatools.demo import check_services as check

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


@contextmanager
def _store(cfg: BenchConfig, which: str) -> Iterator[Any]:
    """A connection to one store; its failures read as one sentence naming the store."""
    import pymongo
    import redis

    urls = {"postgres": cfg.postgres_url, "mongo": cfg.mongo_url, "redis": cfg.redis_url}
    names = {"postgres": "PostgreSQL", "mongo": "the MongoDB-wire server", "redis": "Redis"}
    handle: Any = None
    try:
        if which == "postgres":
            handle = sa.create_engine(sa_url(cfg.postgres_url))
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
            handle.dispose() if which == "postgres" else handle.close()


def prepare_data(cfg: BenchConfig) -> None:
    """Fresh accounts in the three stores (and no ledgers): the schema, database and keys."""
    with _store(cfg, "postgres") as engine, engine.begin() as conn:
        conn.execute(sa.schema.DropSchema(cfg.schema, cascade=True, if_exists=True))
        conn.execute(sa.schema.CreateSchema(cfg.schema))
        table = accounts_table(cfg.schema)
        table.create(conn)
        conn.execute(
            table.insert(),
            [{"id": account(i), "balance": OPENING_BALANCE} for i in range(cfg.accounts)],
        )
    with _store(cfg, "mongo") as mongo:
        mongo.drop_database(cfg.schema)
        wallets = mongo[cfg.schema][TARGET_OF["wallet"]]
        for start in range(0, cfg.accounts, 5000):
            end = min(cfg.accounts, start + 5000)
            wallets.insert_many([{"_id": account(i), "balance": 0} for i in range(start, end)])
    with _store(cfg, "redis") as r:
        _drop_redis(r, cfg.schema)
        with r.pipeline(transaction=False) as pipe:
            for i in range(cfg.accounts):
                pipe.hset(points_key(cfg.schema, account(i)), "points", 0)
            pipe.execute()


def drop_data(cfg: BenchConfig) -> None:
    """Remove what :func:`prepare_data` and the participants created."""
    with _store(cfg, "postgres") as engine, engine.begin() as conn:
        conn.execute(sa.schema.DropSchema(cfg.schema, cascade=True, if_exists=True))
    with _store(cfg, "mongo") as mongo:
        mongo.drop_database(cfg.schema)
    with _store(cfg, "redis") as r:
        _drop_redis(r, cfg.schema)


def points_key(schema: str, key: str) -> str:
    return f"{schema}:{TARGET_OF['rewards']}:{key}"


def _drop_redis(r: Any, prefix: str) -> None:
    batch: list[bytes] = []
    for key in r.scan_iter(match=f"{prefix}:*", count=5000):
        batch.append(key)
        if len(batch) >= 5000:
            r.unlink(*batch)
            batch = []
    if batch:
        r.unlink(*batch)


def accounts_table(schema: str) -> sa.Table:
    return sa.Table(
        TARGET_OF["bank"],
        sa.MetaData(schema=schema),
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("balance", sa.BigInteger, nullable=False),
    )


def store_totals(cfg: BenchConfig) -> dict[str, int]:
    """Money moved per store: debited from PostgreSQL, credited to MongoDB and Redis."""
    table = accounts_table(cfg.schema)
    with _store(cfg, "postgres") as engine, engine.connect() as conn:
        left = conn.execute(sa.select(sa.func.sum(table.c.balance))).scalar()
    with _store(cfg, "mongo") as mongo:
        docs = mongo[cfg.schema][TARGET_OF["wallet"]].find({}, {"balance": 1})
        wallets = sum(int(d.get("balance", 0)) for d in docs)
    with _store(cfg, "redis") as r, r.pipeline(transaction=False) as pipe:
        for i in range(cfg.accounts):
            pipe.hget(points_key(cfg.schema, account(i)), "points")
        points = sum(int(v or 0) for v in pipe.execute())
    return {
        "bank": cfg.accounts * OPENING_BALANCE - int(left or 0),
        "wallet": wallets,
        "rewards": points,
    }
