"""The isolation tier's hot records, read and written directly, and the concurrent reader.

:func:`create` lays out the records of :mod:`tests.chaos.iso_workload` in the three
stores (a schema, a database and a key prefix named by the run's token, as
:class:`tests.chaos.stores.Stores` does for the transfer workload). :class:`Sampler`
is the reader the issue asks for: one thread per store reads every hot record the
way any program would (an SQL ``SELECT``, a pymongo ``find``, Redis ``HGET`` in one
``MULTI``), never through saga, over and over, and keeps each value with the wall
clock just before the read was sent and just after its answer came back.

Only the business fields are read (``balance``, ``writer``): whatever a participant
keeps beside a record (holds, reservations) is not what a reader of the record sees.
A slot that exists without a ``writer`` reads as :data:`NO_WRITER`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pymongo
import redis

from tests._infra import Services
from tests.chaos.iso_workload import (
    ACCOUNTS,
    BALANCE,
    SLOTS,
    WRITER,
    Record,
    accounts,
    opening_accounts,
    opening_slots,
    slots,
)

Value = int | str | None
NO_WRITER = "(a record without a writer)"
"""What a slot reads as when the record exists but has no ``writer``: no committed state
of the workload looks like that, so the checker counts it as a dirty read."""
Reading = dict[Record, Value]
Sample = tuple[int, int, Value]
"""``(before_ms, after_ms, value)``: read no earlier than ``before_ms`` (rounded down)
and no later than ``after_ms`` (rounded up), wall clock."""

INTERVAL_S = 0.02
"""Pause between two reads of one store."""


def _pg(services: Services) -> psycopg.Connection[Any]:
    return psycopg.connect(services.postgres_url, connect_timeout=10, autocommit=True)


def _mongo(services: Services) -> pymongo.MongoClient[dict[str, Any]]:
    return pymongo.MongoClient(
        services.mongo_url, serverSelectionTimeoutMS=10_000, socketTimeoutMS=30_000
    )


def _redis(services: Services) -> redis.Redis:
    return redis.Redis.from_url(services.redis_url, decode_responses=True, socket_timeout=30)


def redis_key(token: str, target: str, key: str) -> str:
    """The Redis participant's key of a record (``<prefix>:<target>:<key>``)."""
    return f"{token}:{target}:{key}"


def create(services: Services, token: str, stores: tuple[str, ...]) -> None:
    """The hot records of ``stores`` at their opening values."""
    money, writers = opening_accounts(stores), opening_slots(stores)
    if "sql" in stores:
        with _pg(services) as conn:
            conn.execute(f'CREATE SCHEMA "{token}"')
            conn.execute(
                f'CREATE TABLE "{token}".{ACCOUNTS} '
                f"(id text PRIMARY KEY, {BALANCE} bigint NOT NULL)"
            )
            conn.execute(f'CREATE TABLE "{token}".{SLOTS} (id text PRIMARY KEY, {WRITER} text)')
            for (s, _, key), value in money.items():
                if s == "sql":
                    conn.execute(
                        f'INSERT INTO "{token}".{ACCOUNTS} (id, {BALANCE}) VALUES (%s, %s)',
                        (key, value),
                    )
            for (s, _, key), writer in writers.items():
                if s == "sql" and writer is not None:
                    conn.execute(
                        f'INSERT INTO "{token}".{SLOTS} (id, {WRITER}) VALUES (%s, %s)',
                        (key, writer),
                    )
    if "mongo" in stores:
        client = _mongo(services)
        try:
            db = client[token]
            db[ACCOUNTS].insert_many(
                [{"_id": k, BALANCE: v} for (s, _, k), v in money.items() if s == "mongo"]
            )
            docs = [{"_id": k, WRITER: w} for (s, _, k), w in writers.items() if s == "mongo" and w]
            db[SLOTS].insert_many(docs)
        finally:
            client.close()
    if "redis" in stores:
        r = _redis(services)
        try:
            for (s, t, k), v in money.items():
                if s == "redis":
                    r.hset(redis_key(token, t, k), BALANCE, v)
            for (s, t, k), w in writers.items():
                if s == "redis" and w is not None:
                    r.hset(redis_key(token, t, k), WRITER, w)
        finally:
            r.close()


class Reader:
    """Reads every hot record of one store, as an outside program would."""

    def __init__(self, services: Services, token: str, store: str) -> None:
        self.services = services
        self.token = token
        self.store = store
        self._handle: Any = None

    def close(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(Exception):
                self._handle.close()
            self._handle = None

    def read(self) -> Reading:
        """One reading; raises the driver's error when the store does not answer."""
        try:
            return {"sql": self._sql, "mongo": self._mongo, "redis": self._redis}[self.store]()
        except Exception:
            self.close()  # a fresh connection next time
            raise

    def _sql(self) -> Reading:
        if self._handle is None:
            self._handle = _pg(self.services)
        t = self.token
        rows = self._handle.execute(
            f"SELECT 'a', id, {BALANCE}::text FROM \"{t}\".{ACCOUNTS} "
            f"UNION ALL SELECT 's', id, {WRITER} FROM \"{t}\".{SLOTS}"
        ).fetchall()
        return _reading(
            "sql",
            {key: int(v) for kind, key, v in rows if kind == "a"},
            {key: NO_WRITER if v is None else v for kind, key, v in rows if kind == "s"},
        )

    def _mongo(self) -> Reading:
        if self._handle is None:
            self._handle = _mongo(self.services)
        db = self._handle[self.token]
        money = {str(d["_id"]): d.get(BALANCE) for d in db[ACCOUNTS].find({}, {BALANCE: 1})}
        writers = {str(d["_id"]): d.get(WRITER, NO_WRITER) for d in db[SLOTS].find({}, {WRITER: 1})}
        return _reading("mongo", money, writers)

    def _redis(self) -> Reading:
        if self._handle is None:
            self._handle = _redis(self.services)
        t = self.token
        with self._handle.pipeline(transaction=True) as pipe:  # MULTI: one moment
            for k in accounts():
                pipe.hget(redis_key(t, ACCOUNTS, k), BALANCE)
            for k in slots():
                pipe.hget(redis_key(t, SLOTS, k), WRITER)
                pipe.exists(redis_key(t, SLOTS, k))
            values = pipe.execute()
        n = len(accounts())
        money = {k: v for k, v in zip(accounts(), values[:n], strict=True)}
        pairs = zip(values[n::2], values[n + 1 :: 2], strict=True)
        writers = {
            k: (NO_WRITER if w is None and there else w)
            for k, (w, there) in zip(slots(), pairs, strict=True)
        }
        return _reading("redis", money, writers)


def _reading(store: str, money: Mapping[str, Any], writers: Mapping[str, Any]) -> Reading:
    """The hot records only (anything else a store holds is not a business record here)."""
    out: Reading = {}
    for k in accounts():
        v = money.get(k)
        out[(store, ACCOUNTS, k)] = None if v is None else int(v)
    for k in slots():
        w = writers.get(k)
        out[(store, SLOTS, k)] = None if w is None else str(w)
    return out


def read_all(services: Services, token: str, stores: tuple[str, ...]) -> Reading:
    """Every hot record of ``stores`` now (at quiescence: the final values)."""
    out: Reading = {}
    for store in stores:
        reader = Reader(services, token, store)
        try:
            out.update(reader.read())
        finally:
            reader.close()
    return out


def _now_floor_ms() -> int:
    return time.time_ns() // 1_000_000


def _now_ceil_ms() -> int:
    return -(-time.time_ns() // 1_000_000)


@dataclass
class Sampler:
    """One reading thread per store until :meth:`stop`; the samples per record."""

    services: Services
    token: str
    stores: tuple[str, ...]
    interval_s: float = INTERVAL_S
    samples: dict[Record, list[Sample]] = field(default_factory=dict)
    reads: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Sampler:
        for store in self.stores:
            self.reads[store] = self.errors[store] = 0
            t = threading.Thread(
                target=self._run, args=(store,), name=f"sample-{store}", daemon=True
            )
            self._threads.append(t)
            t.start()
        return self

    def _run(self, store: str) -> None:
        reader = Reader(self.services, self.token, store)
        own: dict[Record, list[Sample]] = {}
        try:
            while not self._stop.is_set():
                before = _now_floor_ms()
                try:
                    reading = reader.read()
                except Exception:
                    self.errors[store] += 1
                    self._stop.wait(0.2)
                    continue
                after = _now_ceil_ms()
                for rec, value in reading.items():
                    own.setdefault(rec, []).append((before, after, value))
                self.reads[store] += 1
                self._stop.wait(self.interval_s)
        finally:
            reader.close()
            with self._lock:
                self.samples.update(own)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def count(self) -> int:
        return sum(len(v) for v in self.samples.values())
