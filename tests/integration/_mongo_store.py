"""The MongoDB storage driven through its real API, for the isolation tests: work items
(requests and decisions), their reports, and a :class:`Store` with plain pymongo beside
it, as any reader of the store would use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pymongo
import pytest

from saga.participants._barrier import Requested
from saga.participants._storage import DecisionArrived, Report
from saga.participants.mongo import MongoStorage
from saga.participants.mongo._holds import RESERVED_PROJECTION, Reservation, reservations
from saga.streams import Isolation, Outcome, StepStatus
from tests._infra import Services
from tests.integration.test_sql_storage import NOW, requested

RC = Isolation.READ_COMMITTED
NONE = Isolation.NONE
Db = pymongo.database.Database[dict[str, Any]]


def step(
    tx_id: str,
    action: str,
    args: dict[str, Any],
    *,
    level: Isolation = RC,
    step: int = 0,
    n_steps: int = 1,
) -> Requested:
    return requested(tx_id, action, args, step=step, n_steps=n_steps, isolation=level)


def inc(tx_id: str, key: Any, by: int, **extra: Any) -> Requested:
    level = extra.pop("level", RC)
    args = {"target": "accounts", "key": key, "field": "balance", "by": by, **extra}
    return step(tx_id, "increment", args, level=level)


def update(tx_id: str, key: Any, qty: int, level: Isolation = RC) -> Requested:
    return step(tx_id, "update", {"target": "orders", "key": key, "set": {"qty": qty}}, level=level)


def commit(tx_id: str) -> DecisionArrived:
    return DecisionArrived(tx_id, Outcome.COMMIT, NOW + 1_000)


def rollback(tx_id: str) -> DecisionArrived:
    return DecisionArrived(tx_id, Outcome.ROLLBACK, NOW + 1_000)


def status(reports: list[Report]) -> list[tuple[str, int, StepStatus]]:
    return [(r.tx_id, r.step, r.status) for r in reports]


def one(reports: list[Report]) -> Report:
    [got] = reports
    return got


class Store:
    """One participant ``bank`` on a fresh database, and plain pymongo beside it."""

    def __init__(self, url: str, db: Db) -> None:
        self.url = url
        self.db = db
        self.made: list[MongoStorage] = []
        self.storage = self.make()
        self.storage.setup()
        db["accounts"].insert_many([{"_id": "x", "balance": 0}, {"_id": "y", "balance": 50}])
        db["orders"].insert_one({"_id": "k", "item": "book", "qty": 5})

    def make(self, **options: Any) -> MongoStorage:
        storage = MongoStorage(
            "bank", self.url, ["accounts", "orders"], database=self.db.name, **options
        )
        self.made.append(storage)
        return storage

    def run(self, *items: Any) -> list[Report]:
        return self.storage.execute(list(items))

    def find(self, target: str, key: Any) -> dict[str, Any] | None:
        """What a plain reader of the collection sees, business fields only."""
        return self.db[target].find_one({"_id": key}, RESERVED_PROJECTION)

    def balance(self, key: Any) -> Any:
        doc = self.db["accounts"].find_one({"_id": key})
        return None if doc is None else doc["balance"]

    def reserved(self, key: Any) -> list[Reservation]:
        """The open reservations on ``accounts/key`` (a release or commit made without a
        read may leave an empty group behind)."""
        return reservations(self.db["accounts"].find_one({"_id": key}))

    def qty(self) -> Any:
        doc = self.db["orders"].find_one({"_id": "k"})
        return None if doc is None else doc["qty"]


@pytest.fixture
def store(services: Services, mongo_db: Db) -> Iterator[Store]:
    made = Store(services.mongo_url, mongo_db)
    try:
        yield made
    finally:
        for storage in made.made:
            storage.close()


APPLIED = StepStatus.APPLIED
COMMITTED = StepStatus.COMMITTED
COMPENSATED = StepStatus.COMPENSATED
