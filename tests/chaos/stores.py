"""The three stores of one chaos run, read and written directly (never through saga).

One token names everything a run owns: the PostgreSQL schema, the Mongo
database and the Redis key prefix. The checker reads balances and ledgers here,
in each store's own layout, so it depends neither on the participants' code nor
on the reconciliation job.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import pymongo
import redis

from saga.participants.mongo._ledger import _decided, _decision_id
from tests._infra import Services
from tests.chaos.workload import FIELD, PARTICIPANTS, TARGET

LedgerKey = tuple[str, str, int]  # (participant, tx_id, step)


@dataclass(frozen=True)
class LedgerRow:
    status: str
    effect: bool


@dataclass
class Stores:
    services: Services
    token: str  # schema, database and key prefix

    # ------------------------------------------------------------ clients

    @contextmanager
    def _pg(self) -> Iterator[psycopg.Connection[Any]]:
        with psycopg.connect(self.services.postgres_url, connect_timeout=10, autocommit=True) as c:
            yield c

    @contextmanager
    def _mongo(self) -> Iterator[Any]:
        client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
            self.services.mongo_url, serverSelectionTimeoutMS=20_000
        )
        try:
            yield client[self.token]
        finally:
            client.close()

    @contextmanager
    def _redis(self) -> Iterator[redis.Redis]:
        client = redis.Redis.from_url(
            self.services.redis_url, decode_responses=True, socket_timeout=30
        )
        try:
            yield client
        finally:
            client.close()

    def _redis_key(self, key: str) -> str:
        return f"{self.token}:{TARGET}:{key}"

    # ------------------------------------------------------------ set-up

    def create(self, accounts: Mapping[str, Mapping[str, int]]) -> None:
        """Create the accounts with their opening balances (``store -> key -> balance``)."""
        with self._pg() as conn:
            conn.execute(f'CREATE SCHEMA "{self.token}"')
            conn.execute(
                f'CREATE TABLE "{self.token}".{TARGET} '
                f"(id text PRIMARY KEY, {FIELD} bigint NOT NULL)"
            )
            rows = accounts.get("sql", {})
            with (
                conn.cursor() as cur,
                cur.copy(f'COPY "{self.token}".{TARGET} (id, {FIELD}) FROM STDIN') as copy,
            ):
                for key, balance in rows.items():
                    copy.write_row((key, balance))
        with self._mongo() as db:
            docs = [{"_id": k, FIELD: v} for k, v in accounts.get("mongo", {}).items()]
            for i in range(0, len(docs), 1000):
                db[TARGET].insert_many(docs[i : i + 1000], ordered=False)
        with self._redis() as r:
            items = list(accounts.get("redis", {}).items())
            for i in range(0, len(items), 1000):
                with r.pipeline(transaction=False) as pipe:
                    for key, balance in items[i : i + 1000]:
                        pipe.hset(self._redis_key(key), FIELD, balance)
                    pipe.execute()

    def drop(self) -> None:
        """Remove everything the run created in the three stores."""
        with self._pg() as conn:
            conn.execute("SET lock_timeout = '20s'")
            conn.execute(f'DROP SCHEMA IF EXISTS "{self.token}" CASCADE')
        with self._mongo() as db:
            db.client.drop_database(self.token)
        with self._redis() as r:
            batch: list[str] = []
            for key in r.scan_iter(match=f"{self.token}:*", count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    r.delete(*batch)
                    batch = []
            if batch:
                r.delete(*batch)

    # ------------------------------------------------------------ reading

    def balances(self) -> dict[str, dict[str, int]]:
        """Every account's balance, per store."""
        found: dict[str, dict[str, int]] = {"sql": {}, "mongo": {}, "redis": {}}
        with self._pg() as conn:
            for key, balance in conn.execute(f'SELECT id, {FIELD} FROM "{self.token}".{TARGET}'):
                found["sql"][key] = int(balance)
        with self._mongo() as db:
            for doc in db[TARGET].find({}, {FIELD: 1}):
                found["mongo"][str(doc["_id"])] = int(doc.get(FIELD, 0))
        with self._redis() as r:
            keys = list(r.scan_iter(match=self._redis_key("*"), count=1000))
            head = len(self._redis_key(""))
            for i in range(0, len(keys), 1000):
                chunk = keys[i : i + 1000]
                with r.pipeline(transaction=False) as pipe:
                    for key in chunk:
                        pipe.hget(key, FIELD)
                    values = pipe.execute()
                for key, value in zip(chunk, values, strict=True):
                    if value is not None:
                        found["redis"][key[head:]] = int(value)
        return found

    def _pg_ledger_exists(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the SQL participant has created its ledger table (it does at start)."""
        found = conn.execute(
            "SELECT 1 FROM information_schema.tables WHERE table_schema = %s "
            "AND table_name = 'saga_ledger'",
            (self.token,),
        ).fetchone()
        return found is not None

    def rollback_recorded(self, store: str, tx_id: str) -> bool:
        """Whether the participant of ``store`` recorded a rollback for ``tx_id`` (its
        transaction-level marker: the rollback came before it knew any step)."""
        name = PARTICIPANTS[store]
        if store == "sql":
            with self._pg() as conn:
                if not self._pg_ledger_exists(conn):
                    return False
                row = conn.execute(
                    f'SELECT 1 FROM "{self.token}".saga_ledger '
                    "WHERE participant = %s AND tx_id = %s AND step = -1",
                    (name, tx_id),
                ).fetchone()
                return row is not None
        if store == "mongo":
            with self._mongo() as db:
                doc = db["saga_ledger_tx"].find_one({"_id": f"{name}:{tx_id}"})
                return doc is not None and bool(doc.get("rolled_back"))
        with self._redis() as r:
            return bool(r.hexists(f"{self.token}:ledger:{name}:tx:{tx_id}", "rolled_back"))

    def ledgers(self) -> dict[LedgerKey, LedgerRow]:
        """The step entries of the three participants' ledgers (markers left out)."""
        found: dict[LedgerKey, LedgerRow] = {}
        with self._pg() as conn:
            if self._pg_ledger_exists(conn):
                rows = conn.execute(
                    "SELECT participant, tx_id, step, status, effect "
                    f'FROM "{self.token}".saga_ledger WHERE step >= 0'
                )
                for participant, tx_id, step, status, effect in rows:
                    found[(participant, tx_id, int(step))] = LedgerRow(status, bool(effect))
        with self._mongo() as db:
            docs = list(db["saga_ledger"].find({}))
            # A decision recorded beside its step document (participants.mongo._ledger).
            decisions = {d["_id"]: d for d in docs if "decides" in d}
            for stored in docs:
                if "status" not in stored or int(stored.get("step", -1)) < 0:
                    continue
                doc = _decided(stored, decisions.get(_decision_id(stored["_id"])))
                key = (str(doc["participant"]), str(doc["tx_id"]), int(doc["step"]))
                found[key] = LedgerRow(str(doc["status"]), bool(doc.get("effect")))
        with self._redis() as r:
            name = PARTICIPANTS["redis"]
            head = f"{self.token}:ledger:{name}:tx:"
            keys = list(r.scan_iter(match=f"{head}*", count=1000))
            for i in range(0, len(keys), 500):
                chunk = keys[i : i + 500]
                with r.pipeline(transaction=False) as pipe:
                    for key in chunk:
                        pipe.hgetall(key)
                    hashes = pipe.execute()
                for key, fields in zip(chunk, hashes, strict=True):
                    tx_id = key[len(head) :]
                    for step, text in fields.items():
                        if step.isdigit():
                            entry = json.loads(text)
                            found[(name, tx_id, int(step))] = LedgerRow(
                                str(entry["status"]), bool(entry["effect"])
                            )
        return found
