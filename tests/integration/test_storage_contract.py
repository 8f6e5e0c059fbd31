"""The storage contract, against every real storage.

Why this module is over 600 lines: it is one contract, run against four real
storages through one parametrised class; splitting it would split the contract.

Built-in actions: docs/architecture.md §3; the barrier: §4.

``TestStorageContract`` talks to a storage only through :class:`participants.Storage`
and a backend-neutral :class:`Harness` (seed, record, snapshot, remove, a custom
handler, an unreachable twin); the ``storage`` fixture is parametrised indirectly over
``sql`` (PostgreSQL), ``sql-sqlite``, ``sql-mariadb``, ``mongo`` (the MongoDB wire
server: FerretDB locally) and ``redis``. Each test gets a fresh PostgreSQL schema, SQLite
file, MariaDB database, Mongo database or Redis key prefix, removed afterwards.

Storages differ in how they *represent* a record (SQL columns with types and
defaults, BSON fields, Redis hash text), so :meth:`Harness.record` compares in one
form: fields that are null or absent are left out, and the numeric fields of the
demo (``balance``, ``credit``, ``qty``, ``price``) become :class:`~decimal.Decimal`.
:meth:`Harness.snapshot` is the raw data, so "restored exactly" means exactly.
What only one storage has (SQL column types, Mongo's write protocol, Redis keys
and WATCH) is tested in its own class below or in ``test_sql_storage.py``.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import pymongo
import pymongo.monitoring
import pytest
import redis
import sqlalchemy as sa
from _mariadb import UNREACHABLE_URL, mariadb_database
from test_sql_storage import (
    DEADLINE,
    NOW,
    TARGETS,
    Fields,
    SqlHarness,
    commit,
    only_status,
    postgres_database,
    report,
    rollback,
    sql_harness,
    sqlite_database,
)
from test_sql_storage import requested as _requested

from saga.participants._barrier import (
    LedgerStatus,
    PredecessorApplied,
    Requested,
    SuccessorCompensated,
)
from saga.participants._handlers import Handler, Reject
from saga.participants._open import open_storage
from saga.participants._storage import RequestSeen, Storage
from saga.participants.mongo import _adapter as _mongo
from saga.participants.mongo import _recovery as _mongo_recovery
from saga.participants.mongo._adapter import DocumentWrite, MongoSession, MongoStorage
from saga.participants.mongo._shared import SharedState
from saga.participants.mongo._unit import _MongoUnit
from saga.participants.redis._adapter import RedisSession, RedisStorage
from saga.participants.sql._adapter import SqlSession, SqlStorage
from saga.streams import (
    ConfigurationError,
    Isolation,
    Mode,
    Outcome,
    StepStatus,
    TransientError,
)
from tests._infra import Services

pytestmark = pytest.mark.integration


def requested(*args: Any, isolation: Isolation = Isolation.NONE, **kwargs: Any) -> Requested:
    """A request at level ``none`` unless ``isolation`` says otherwise: the contract here is
    the one of writing at apply and compensating on rollback (each storage's
    ``read_committed`` has tests of its own)."""
    return replace(_requested(*args, **kwargs), isolation=isolation)


NUMERIC_FIELDS = frozenset({"balance", "credit", "qty", "price"})
SEEDS: list[tuple[str, Any, Fields]] = [
    ("accounts", 1, {"owner": "alice", "balance": 100, "credit": Decimal("10.50")}),
    ("accounts", 2, {"owner": "bob", "balance": 50, "credit": None}),
    ("orders", "o-1", {"item": "book", "qty": 1, "price": Decimal("9.99")}),
    ("secrets", 1, {"value": "do not touch"}),
]
BUSINESS = ("accounts", "orders", "secrets")


def normal(fields: Mapping[str, Any] | None, drop: frozenset[str] = frozenset()) -> Fields | None:
    """A record in the form every storage is compared in (see the module doc)."""
    if fields is None:
        return None
    out: Fields = {}
    for name, value in fields.items():
        if name in drop or value is None:
            continue
        if name in NUMERIC_FIELDS and not isinstance(value, bool):
            out[name] = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
        else:
            out[name] = value
    return out


# ---------------------------------------------------------------- harnesses


class Harness(ABC):
    """A storage under test plus direct access to its business data."""

    kind: str
    storage: Storage

    def __init__(self) -> None:
        self.made: list[Storage] = []

    @abstractmethod
    def _build(self, name: str, targets: tuple[str, ...], **options: Any) -> Storage: ...

    def make(self, **overrides: Any) -> Storage:
        """Another storage on the same data (``name``, ``targets`` and adapter options)."""
        name = overrides.pop("name", "bank")
        targets = overrides.pop("targets", TARGETS)
        storage = self._build(name, tuple(targets), **overrides)
        self.made.append(storage)
        return storage

    def close(self) -> None:
        for storage in self.made:
            storage.close()

    @abstractmethod
    def seed(self, target: str, key: Any, fields: Fields) -> None: ...

    @abstractmethod
    def raw(self, target: str, key: Any) -> Fields | None:
        """The record as stored, without its key and the adapter's bookkeeping."""

    def record(self, target: str, key: Any) -> Fields | None:
        return normal(self.raw(target, key))

    def image(self, before: Any) -> Fields | None:
        """A whole-record before-image in the compared form."""
        return normal(before)

    @abstractmethod
    def remove(self, target: str, key: Any) -> None:
        """Delete a record behind the participant's back."""

    @abstractmethod
    def snapshot(self) -> Any:
        """Every business record, raw (the ledger excluded)."""

    @abstractmethod
    def reserve_handler(self) -> Handler:
        """``reserve {order}``: set the order's qty to 0 (``explode``: then reject), keep the
        old qty; cancel puts it back; confirm sets ``item`` to ``confirmed`` (``refuse_confirm``:
        then reject)."""

    @abstractmethod
    def unreachable(self) -> Storage:
        """A storage of this kind whose server does not answer."""


class SqlContractHarness(Harness):
    def __init__(self, inner: SqlHarness, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inner = inner
        self.storage = inner.storage
        self.folder = Path(inner.db.url.removeprefix("sqlite:///")).parent

    def _build(self, name: str, targets: tuple[str, ...], **options: Any) -> Storage:
        return self.inner.make(name=name, targets=targets, **options)

    def close(self) -> None:
        pass  # sql_harness closes what its make() built

    def seed(self, target: str, key: Any, fields: Fields) -> None:
        self.inner.seed(target, key, fields)

    def raw(self, target: str, key: Any) -> Fields | None:
        return self.inner.record(target, key)

    def image(self, before: Any) -> Fields | None:
        return normal(before, frozenset({"id"}))

    def remove(self, target: str, key: Any) -> None:
        self.inner.remove(target, key)

    def snapshot(self) -> Any:
        return self.inner.snapshot()

    def reserve_handler(self) -> Handler:
        def reserve(session: SqlSession, args: Mapping[str, Any]) -> Any:
            orders = session.table("orders")
            where = orders.c.id == args["order"]
            found = session.execute(sa.select(orders.c.qty).where(where)).first()
            if found is None:
                raise Reject(f"order {args['order']} does not exist")
            session.execute(sa.update(orders).where(where).values(qty=0))
            if args.get("explode"):
                raise Reject("the handler changed its mind")
            return {"qty": found.qty}

        def release(session: SqlSession, args: Mapping[str, Any], before: Any) -> None:
            orders = session.table("orders")
            where = orders.c.id == args["order"]
            session.execute(sa.update(orders).where(where).values(qty=before["qty"]))

        def confirm(session: SqlSession, args: Mapping[str, Any]) -> None:
            orders = session.table("orders")
            where = orders.c.id == args["order"]
            session.execute(sa.update(orders).where(where).values(item="confirmed"))
            if args.get("refuse_confirm"):
                raise Reject("the confirmation changed its mind")

        return Handler(reserve, release, confirm)

    def unreachable(self) -> Storage:
        if self.kind == "sql-sqlite":
            url = f"sqlite:///{self.folder / 'no' / 'such' / 'folder.db'}"
        elif self.kind == "sql-mariadb":
            url = UNREACHABLE_URL
        else:
            url = "postgresql://saga:saga@127.0.0.1:1/saga"
        return SqlStorage("bank", url, ["accounts"])


class MongoHarness(Harness):
    kind = "mongo"

    def __init__(self, url: str, db: pymongo.database.Database[dict[str, Any]]) -> None:
        super().__init__()
        self.url = url
        self.db = db
        self.storage = self.make()
        self.storage.setup()
        for target, key, fields in SEEDS:
            self.seed(target, key, fields)

    def _build(self, name: str, targets: tuple[str, ...], **options: Any) -> Storage:
        return MongoStorage(name, self.url, targets, database=self.db.name, **options)

    def seed(self, target: str, key: Any, fields: Fields) -> None:
        values = {k: float(v) if isinstance(v, Decimal) else v for k, v in fields.items()}
        self.db[target].insert_one({"_id": key, **values})

    def raw(self, target: str, key: Any) -> Fields | None:
        doc = self.db[target].find_one({"_id": key})
        if doc is None:
            return None
        # ``_saga`` and the other ``_saga_*`` fields are bookkeeping, not business data.
        return {k: v for k, v in doc.items() if k != "_id" and not k.startswith("_saga")}

    def remove(self, target: str, key: Any) -> None:
        self.db[target].delete_one({"_id": key})

    def snapshot(self) -> Any:
        # ``_saga`` names the last saga write: bookkeeping, not business data (so are
        # the bounds ``_saga_bounds`` records).
        return {
            name: sorted(
                (
                    sorted((k, v) for k, v in doc.items() if not k.startswith("_saga"))
                    for doc in self.db[name].find()
                ),
                key=repr,
            )
            for name in BUSINESS
        }

    def reserve_handler(self) -> Handler:
        def reserve(session: MongoSession, args: Mapping[str, Any]) -> Any:
            doc = session.read("orders", args["order"])
            if doc is None:
                raise Reject(f"order {args['order']} does not exist")
            session.stage(
                DocumentWrite("orders", args["order"], "update", doc.get("_saga"), set={"qty": 0})
            )
            if args.get("explode"):
                raise Reject("the handler changed its mind")
            return {"qty": doc["qty"]}

        def release(session: MongoSession, args: Mapping[str, Any], before: Any) -> None:
            doc = session.read("orders", args["order"])
            assert doc is not None
            session.stage(
                DocumentWrite(
                    "orders", args["order"], "update", doc.get("_saga"), set={"qty": before["qty"]}
                )
            )

        def confirm(session: MongoSession, args: Mapping[str, Any]) -> None:
            doc = session.read("orders", args["order"])
            assert doc is not None
            session.stage(
                DocumentWrite(
                    "orders", args["order"], "update", doc.get("_saga"), set={"item": "confirmed"}
                )
            )
            if args.get("refuse_confirm"):
                raise Reject("the confirmation changed its mind")

        return Handler(reserve, release, confirm)

    def unreachable(self) -> Storage:
        return MongoStorage("bank", "mongodb://127.0.0.1:1/", ["accounts"], server_timeout_ms=300)


class RedisHarness(Harness):
    kind = "redis"

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__()
        self.url = url
        self.prefix = prefix
        self.client: redis.Redis = redis.Redis.from_url(url, decode_responses=True)
        self.storage = self.make()
        self.storage.setup()
        for target, key, fields in SEEDS:
            self.seed(target, key, fields)

    def _build(self, name: str, targets: tuple[str, ...], **options: Any) -> Storage:
        return RedisStorage(name, self.url, targets, prefix=self.prefix, **options)

    def close(self) -> None:
        super().close()
        self.client.close()

    def key(self, target: str, key: Any) -> str:
        return f"{self.prefix}:{target}:{key}"

    def seed(self, target: str, key: Any, fields: Fields) -> None:
        values = {k: str(v) for k, v in fields.items() if v is not None}
        self.client.hset(self.key(target, key), mapping=values)

    def raw(self, target: str, key: Any) -> Fields | None:
        record: Fields = dict(self.client.hgetall(self.key(target, key)))
        return record or None

    def remove(self, target: str, key: Any) -> None:
        self.client.delete(self.key(target, key))

    def snapshot(self) -> Any:
        ledger = f"{self.prefix}:ledger:"
        return {
            name: self.client.hgetall(name)
            for name in sorted(self.client.scan_iter(match=f"{self.prefix}:*"))
            if not name.startswith(ledger)
        }

    def reserve_handler(self) -> Handler:
        def reserve(session: RedisSession, args: Mapping[str, Any]) -> Any:
            record = session.read("orders", args["order"])
            if record is None:
                raise Reject(f"order {args['order']} does not exist")
            session.queue("HSET", session.key("orders", args["order"]), "qty", "0")
            if args.get("explode"):
                raise Reject("the handler changed its mind")
            return {"qty": int(record["qty"])}

        def release(session: RedisSession, args: Mapping[str, Any], before: Any) -> None:
            session.queue("HSET", session.key("orders", args["order"]), "qty", str(before["qty"]))

        def confirm(session: RedisSession, args: Mapping[str, Any]) -> None:
            session.queue("HSET", session.key("orders", args["order"]), "item", "confirmed")
            if args.get("refuse_confirm"):
                raise Reject("the confirmation changed its mind")

        return Handler(reserve, release, confirm)

    def unreachable(self) -> Storage:
        return RedisStorage("bank", "redis://127.0.0.1:1/0", ["accounts"], timeout_s=1)


@contextmanager
def mongo_harness(
    url: str, db: pymongo.database.Database[dict[str, Any]]
) -> Iterator[MongoHarness]:
    harness = MongoHarness(url, db)
    try:
        yield harness
    finally:
        harness.close()


@contextmanager
def redis_harness(url: str, prefix: str) -> Iterator[RedisHarness]:
    harness = RedisHarness(url, prefix.rstrip(":"))
    try:
        yield harness
    finally:
        harness.close()


@contextmanager
def harness_of(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    if kind in ("sql", "sql-sqlite", "sql-mariadb"):
        if kind == "sql-mariadb":
            database = mariadb_database()
        else:
            database = postgres_database() if kind == "sql" else sqlite_database(tmp_path)
        with database as db, sql_harness(db) as inner:
            yield SqlContractHarness(inner, kind)
    elif kind == "mongo":
        services: Services = request.getfixturevalue("services")
        with mongo_harness(services.mongo_url, request.getfixturevalue("mongo_db")) as harness:
            yield harness
    elif kind == "redis":
        services = request.getfixturevalue("services")
        with redis_harness(services.redis_url, request.getfixturevalue("redis_prefix")) as harness:
            yield harness
    else:
        raise ValueError(f"no storage kind {kind!r}")


STORAGES = ["sql", "sql-sqlite", "sql-mariadb", "mongo", "redis"]


@pytest.fixture
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """The storage under test (indirect parameter: one of :data:`STORAGES`)."""
    with harness_of(request.param, request, tmp_path) as harness:
        yield harness


@pytest.fixture
def mongo(
    services: Services, mongo_db: pymongo.database.Database[dict[str, Any]]
) -> Iterator[MongoHarness]:
    with mongo_harness(services.mongo_url, mongo_db) as harness:
        yield harness


@pytest.fixture
def redis_store(services: Services, redis_prefix: str) -> Iterator[RedisHarness]:
    with redis_harness(services.redis_url, redis_prefix) as harness:
        yield harness


# ---------------------------------------------------------------- the contract

ACTION_CASES = [
    pytest.param(
        "insert",
        {"target": "accounts", "key": 3, "value": {"owner": "carol", "balance": 5}},
        ("accounts", 3, {"owner": "carol", "balance": 5}),
        id="insert",
    ),
    pytest.param(
        "insert",
        {"target": "orders", "key": "o-2", "value": {"item": "pen", "price": 1.5}},
        ("orders", "o-2", {"item": "pen", "price": Decimal("1.50")}),
        id="insert-text-key",
    ),
    pytest.param(
        "put",
        {"target": "accounts", "key": 1, "value": {"balance": 7, "credit": 1.25}},
        ("accounts", 1, {"owner": "alice", "balance": 7, "credit": Decimal("1.25")}),
        id="put-existing",
    ),
    pytest.param(
        "put",
        {"target": "accounts", "key": "9", "value": {"owner": "dan", "balance": 0}},
        ("accounts", 9, {"owner": "dan", "balance": 0}),
        id="put-new-with-a-numeric-string-key",
    ),
    pytest.param(
        "update",
        {"target": "accounts", "key": 1, "set": {"owner": "alice b", "credit": None}},
        ("accounts", 1, {"owner": "alice b", "balance": 100}),
        id="update",
    ),
    pytest.param(
        "delete",
        {"target": "accounts", "key": 1},
        ("accounts", 1, None),
        id="delete",
    ),
    pytest.param(
        "delete",
        {"target": "orders", "key": "o-1"},
        ("orders", "o-1", None),
        id="delete-text-key",
    ),
    pytest.param(
        "increment",
        {"target": "accounts", "key": 1, "field": "balance", "by": -30, "min": 0},
        ("accounts", 1, {"owner": "alice", "balance": 70, "credit": Decimal("10.50")}),
        id="increment",
    ),
    pytest.param(
        "increment",
        {"target": "accounts", "key": 1, "field": "credit", "by": 0.1, "max": 100},
        ("accounts", 1, {"owner": "alice", "balance": 100, "credit": Decimal("10.60")}),
        id="increment-fraction",
    ),
]


@pytest.mark.parametrize("storage", STORAGES, indirect=True)
class TestStorageContract:
    @pytest.mark.parametrize(("action", "args", "expected"), ACTION_CASES)
    def test_action_applies_and_rollback_restores_exactly(
        self,
        storage: Harness,
        action: str,
        args: dict[str, Any],
        expected: tuple[str, Any, Fields | None],
    ) -> None:
        before = storage.snapshot()
        reports = storage.storage.execute([requested("tx-1", action, args)])
        assert reports == [report("tx-1", StepStatus.APPLIED)]
        target, key, record = expected
        assert storage.record(target, key) == record
        [entry] = storage.storage.ledger("tx-1")
        assert (entry.status, entry.effect, entry.action) == (LedgerStatus.APPLIED, True, action)

        assert storage.storage.execute([rollback("tx-1")]) == [
            report("tx-1", StepStatus.COMPENSATED)
        ]
        assert storage.snapshot() == before
        [entry] = storage.storage.ledger("tx-1")
        assert (entry.status, entry.effect) == (LedgerStatus.COMPENSATED, True)

    @pytest.mark.parametrize(("action", "args", "expected"), ACTION_CASES)
    def test_commit_leaves_a_builtin_step_as_it_is_and_keeps_the_change(
        self,
        storage: Harness,
        action: str,
        args: dict[str, Any],
        expected: tuple[str, Any, Fields | None],
    ) -> None:
        """A built-in step has nothing to confirm: its `applied` report says so, and a
        commit (repeated or not) changes nothing, writes nothing and reports nothing."""
        assert not storage.storage.has_confirm(action)
        # A commit decision may need work (a `read_committed` saga's commit writes).
        assert storage.storage.needs_decision(Outcome.COMMIT)
        assert storage.storage.needs_decision(Outcome.ROLLBACK)
        applied = storage.storage.execute([requested("tx-1", action, args)])
        assert applied == [report("tx-1", StepStatus.APPLIED)]
        ledger = storage.storage.ledger("tx-1")
        snapshot = storage.snapshot()
        assert storage.storage.execute([commit("tx-1")]) == []
        assert storage.storage.execute([commit("tx-1"), commit("tx-1")]) == []
        target, key, record = expected
        assert storage.record(target, key) == record
        assert storage.snapshot() == snapshot
        assert storage.storage.ledger("tx-1") == ledger
        [entry] = ledger
        assert entry.status is LedgerStatus.APPLIED

    def test_before_image_is_json_and_names_the_old_record(self, storage: Harness) -> None:
        storage.storage.execute(
            [requested("tx-1", "put", {"target": "accounts", "key": 1, "value": {"balance": 1}})]
        )
        [entry] = storage.storage.ledger("tx-1")
        assert json.loads(json.dumps(entry.before)) == entry.before
        assert storage.image(entry.before) == {
            "owner": "alice",
            "balance": 100,
            "credit": Decimal("10.50"),
        }

    @pytest.mark.parametrize(
        ("action", "args", "reason"),
        [
            (
                "increment",
                {"target": "accounts", "key": 2, "field": "balance", "by": -51, "min": 0},
                "accounts/2 balance would be -1, below the minimum 0",
            ),
            (
                "increment",
                {"target": "accounts", "key": 2, "field": "balance", "by": 51, "max": 100},
                "accounts/2 balance would be 101, above the maximum 100",
            ),
            (
                "increment",
                {"target": "accounts", "key": 7, "field": "balance", "by": 1},
                "accounts/7 does not exist",
            ),
            ("increment", {"target": "accounts", "key": 1, "field": "owner", "by": 1}, None),
            (
                "insert",
                {"target": "accounts", "key": 1, "value": {"owner": "x"}},
                "accounts/1 already exists",
            ),
            (
                "update",
                {"target": "accounts", "key": 7, "set": {"balance": 1}},
                "accounts/7 does not exist",
            ),
            ("delete", {"target": "orders", "key": "nope"}, "orders/nope does not exist"),
            ("update", {"target": "accounts", "key": "abc", "set": {"balance": 1}}, None),
            ("increment", {"target": "accounts", "key": 1, "field": "balance", "by": True}, None),
            ("put", {"target": "accounts", "key": 1, "value": {}}, None),
            ("delete", {"target": "accounts", "key": 1, "extra": 1}, None),
            ("reserve_seat", {"seat": "12A"}, None),
        ],
    )
    def test_rejected_steps_fail_and_change_nothing(
        self, storage: Harness, action: str, args: dict[str, Any], reason: str | None
    ) -> None:
        before = storage.snapshot()
        [got] = storage.storage.execute([requested("tx-1", action, args)])
        assert (got.status, got.step) == (StepStatus.FAILED, 0)
        assert got.reason
        if reason is not None:
            assert got.reason == reason
        assert storage.snapshot() == before
        [entry] = storage.storage.ledger("tx-1")
        assert (entry.status, entry.effect, entry.reason) == (
            LedgerStatus.FAILED,
            False,
            got.reason,
        )
        # The rollback that follows closes the step without touching anything.
        assert storage.storage.execute([rollback("tx-1")]) == [
            report("tx-1", StepStatus.COMPENSATED)
        ]
        assert storage.snapshot() == before

    def test_one_rejected_step_does_not_fail_its_neighbours(self, storage: Harness) -> None:
        reports = storage.storage.execute(
            [
                requested(
                    "tx-a",
                    "insert",
                    {"target": "accounts", "key": 3, "value": {"owner": "c", "balance": 0}},
                ),
                requested(
                    "tx-b",
                    "increment",
                    {"target": "accounts", "key": 2, "field": "balance", "by": -1000, "min": 0},
                ),
                requested(
                    "tx-c", "update", {"target": "accounts", "key": 2, "set": {"owner": "b"}}
                ),
            ]
        )
        assert only_status(reports) == [
            ("tx-a", 0, StepStatus.APPLIED),
            ("tx-b", 0, StepStatus.FAILED),
            ("tx-c", 0, StepStatus.APPLIED),
        ]
        assert storage.record("accounts", 3) == {"owner": "c", "balance": 0}
        assert storage.record("accounts", 2) == {"owner": "b", "balance": 50}
        statuses = {e.tx_id: e.status for e in storage.storage.ledger()}
        assert statuses == {
            "tx-a": LedgerStatus.APPLIED,
            "tx-b": LedgerStatus.FAILED,
            "tx-c": LedgerStatus.APPLIED,
        }

    def test_a_failed_compensation_is_reported_and_isolated(self, storage: Harness) -> None:
        # Two steps of one transaction at this participant; the first one's record
        # disappears behind our back, so only its compensation fails.
        steps = [
            requested(
                "tx-1",
                "update",
                {"target": "accounts", "key": 1, "set": {"owner": "z"}},
                step=0,
                n_steps=2,
            ),
            requested(
                "tx-1",
                "increment",
                {"target": "accounts", "key": 2, "field": "balance", "by": 5},
                step=1,
                n_steps=2,
            ),
        ]
        assert only_status(storage.storage.execute(steps)) == [
            ("tx-1", 0, StepStatus.APPLIED),
            ("tx-1", 1, StepStatus.APPLIED),
        ]
        storage.remove("accounts", 1)
        reports = storage.storage.execute([rollback("tx-1")])
        assert only_status(reports) == [
            ("tx-1", 0, StepStatus.COMPENSATION_FAILED),
            ("tx-1", 1, StepStatus.COMPENSATED),
        ]
        assert reports[0].reason == (
            "compensation failed: accounts/1 no longer exists, so its update cannot be undone"
        )
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 50}
        entries = {e.step: e.status for e in storage.storage.ledger("tx-1")}
        assert entries == {0: LedgerStatus.COMPENSATION_FAILED, 1: LedgerStatus.COMPENSATED}
        # A replayed rollback tries the failed compensation again (and fails again).
        again = storage.storage.execute([rollback("tx-1")])
        assert only_status(again) == [
            ("tx-1", 0, StepStatus.COMPENSATION_FAILED),
            ("tx-1", 1, StepStatus.COMPENSATED),
        ]
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 50}

    def test_redelivered_request_takes_effect_once(self, storage: Harness) -> None:
        step = requested(
            "tx-1", "increment", {"target": "accounts", "key": 2, "field": "balance", "by": 10}
        )
        # Twice in one batch, then again in a later batch: same report, one effect.
        assert storage.storage.execute([step, step]) == [
            report("tx-1", StepStatus.APPLIED),
            report("tx-1", StepStatus.APPLIED),
        ]
        assert storage.storage.execute([step]) == [report("tx-1", StepStatus.APPLIED)]
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 60}
        # The rollback, redelivered too, compensates once.
        assert storage.storage.execute([rollback("tx-1"), rollback("tx-1")]) == [
            report("tx-1", StepStatus.COMPENSATED),
            report("tx-1", StepStatus.COMPENSATED),
        ]
        assert storage.storage.execute([rollback("tx-1")]) == [
            report("tx-1", StepStatus.COMPENSATED)
        ]
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 50}

    def test_redelivered_request_after_a_restart_takes_effect_once(self, storage: Harness) -> None:
        step = requested(
            "tx-1", "increment", {"target": "accounts", "key": 2, "field": "balance", "by": 10}
        )
        assert storage.storage.execute([step]) == [report("tx-1", StepStatus.APPLIED)]
        restarted = storage.make()
        assert restarted.execute([step]) == [report("tx-1", StepStatus.APPLIED)]
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 60}

    def test_redelivered_rejection_repeats_its_reason(self, storage: Harness) -> None:
        step = requested("tx-1", "delete", {"target": "accounts", "key": 99})
        first = storage.storage.execute([step])
        assert first == [report("tx-1", StepStatus.FAILED, reason="accounts/99 does not exist")]
        assert storage.storage.execute([step]) == first

    def test_rollback_before_request_is_a_null_compensation(self, storage: Harness) -> None:
        before = storage.snapshot()
        assert storage.storage.execute([rollback("tx-1"), rollback("tx-1")]) == []
        assert storage.storage.ledger("tx-1") == []  # the marker is not a step entry
        late = requested(
            "tx-1", "insert", {"target": "accounts", "key": 3, "value": {"owner": "c"}}
        )
        assert storage.storage.execute([late]) == [report("tx-1", StepStatus.COMPENSATED)]
        assert storage.storage.execute([late]) == [report("tx-1", StepStatus.COMPENSATED)]
        assert storage.snapshot() == before
        [entry] = storage.storage.ledger("tx-1")
        assert (entry.status, entry.effect) == (LedgerStatus.COMPENSATED, False)

    def test_rollback_before_request_is_seen_by_a_restarted_worker(self, storage: Harness) -> None:
        """Hanging prevention survives a restart: the marker lives in the storage."""
        before = storage.snapshot()
        assert storage.storage.execute([rollback("tx-1")]) == []
        late = requested("tx-1", "delete", {"target": "accounts", "key": 1})
        assert storage.make().execute([late]) == [report("tx-1", StepStatus.COMPENSATED)]
        assert storage.snapshot() == before

    def test_request_after_its_deadline_is_never_applied(self, storage: Harness) -> None:
        before = storage.snapshot()
        late = requested(
            "tx-1",
            "insert",
            {"target": "accounts", "key": 3, "value": {"owner": "c"}},
            deadline_ms=NOW - 1,
        )
        assert storage.storage.execute([late]) == [
            report("tx-1", StepStatus.FAILED, reason="deadline passed before the step was applied")
        ]
        assert storage.snapshot() == before
        assert storage.storage.execute([rollback("tx-1")]) == [
            report("tx-1", StepStatus.COMPENSATED)
        ]
        assert storage.snapshot() == before

    def test_sequential_step_waits_for_its_predecessor(self, storage: Harness) -> None:
        step = requested(
            "tx-1",
            "increment",
            {"target": "accounts", "key": 2, "field": "balance", "by": 10},
            step=1,
            n_steps=2,
            mode=Mode.SEQUENTIAL,
        )
        assert storage.storage.execute([step, step]) == []
        [entry] = storage.storage.ledger("tx-1")
        assert entry.status is LedgerStatus.WAITING
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 50}
        assert "tx-1" in storage.storage.in_flight_sequential()

        go = PredecessorApplied("tx-1", 1, NOW + 10)
        # Twice in one batch (like a redelivered request): one effect, reported each time.
        assert storage.storage.execute([go, go]) == [
            report("tx-1", StepStatus.APPLIED, step=1),
            report("tx-1", StepStatus.APPLIED, step=1),
        ]
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 60}
        # Applied, it stays in flight until decided: after a crash that lost its report,
        # the predecessor's event (read again) reports it again.
        assert "tx-1" in storage.storage.in_flight_sequential()
        assert storage.storage.execute([go]) == [report("tx-1", StepStatus.APPLIED, step=1)]
        # A commit leaves it applied (nothing to confirm), and listed until it is pruned.
        assert storage.storage.execute([commit("tx-1")]) == []
        [entry] = storage.storage.ledger("tx-1")
        assert entry.status is LedgerStatus.APPLIED

    def test_sequential_request_after_its_predecessor_applies_at_once(
        self, storage: Harness
    ) -> None:
        step = requested(
            "tx-1",
            "increment",
            {"target": "accounts", "key": 2, "field": "balance", "by": 10},
            step=1,
            n_steps=2,
            mode=Mode.SEQUENTIAL,
            predecessor_applied=True,
        )
        assert storage.storage.execute([step]) == [report("tx-1", StepStatus.APPLIED, step=1)]

    def test_sequential_rollback_waits_for_the_successor(self, storage: Harness) -> None:
        first = requested(
            "tx-1",
            "update",
            {"target": "accounts", "key": 1, "set": {"balance": 0}},
            step=0,
            n_steps=2,
            mode=Mode.SEQUENTIAL,
        )
        assert storage.storage.execute([first]) == [report("tx-1", StepStatus.APPLIED)]
        assert "tx-1" in storage.storage.in_flight_sequential()

        assert storage.storage.execute([rollback("tx-1")]) == []
        [entry] = storage.storage.ledger("tx-1")
        assert (entry.status, entry.rollback_pending) == (LedgerStatus.APPLIED, True)
        assert storage.record("accounts", 1) == {
            "owner": "alice",
            "balance": 0,
            "credit": Decimal("10.50"),
        }

        done = SuccessorCompensated("tx-1", 0, NOW + 2_000)
        assert storage.storage.execute([done, done]) == [
            report("tx-1", StepStatus.COMPENSATED),
            report("tx-1", StepStatus.COMPENSATED),
        ]
        assert storage.record("accounts", 1) == {
            "owner": "alice",
            "balance": 100,
            "credit": Decimal("10.50"),
        }
        assert "tx-1" not in storage.storage.in_flight_sequential()

    def test_successor_compensated_before_the_rollback_is_remembered(
        self, storage: Harness
    ) -> None:
        first = requested(
            "tx-1",
            "increment",
            {"target": "accounts", "key": 2, "field": "balance", "by": 5},
            step=0,
            n_steps=3,
            mode=Mode.SEQUENTIAL,
        )
        storage.storage.execute([first])
        assert storage.storage.execute([SuccessorCompensated("tx-1", 0, NOW + 1)]) == []
        assert storage.storage.execute([rollback("tx-1")]) == [
            report("tx-1", StepStatus.COMPENSATED)
        ]
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 50}

    @pytest.mark.parametrize(
        ("args", "reason"),
        [
            (
                {"target": "secrets", "key": 1},
                "target 'secrets' is not in this participant's allow-list (accounts, orders)",
            ),
            ({"target": "accounts; DROP TABLE secrets", "key": 1}, None),
            ({"target": 'accounts"', "key": 1}, None),
            ({"target": "accounts:*", "key": 1}, None),
            ({"target": "$where", "key": 1}, None),
        ],
    )
    def test_targets_outside_the_allow_list_are_refused(
        self, storage: Harness, args: dict[str, Any], reason: str | None
    ) -> None:
        before = storage.snapshot()
        [got] = storage.storage.execute([requested("tx-1", "delete", args)])
        assert got.status is StepStatus.FAILED
        assert got.reason
        if reason is None:
            assert "is not a valid name" in got.reason
        else:
            assert got.reason == reason
        assert storage.snapshot() == before

    @pytest.mark.parametrize(
        "name",
        ['a"b', "balance = 0 --", "owner; DROP TABLE secrets", "balance\n", "a.b", "$set", "a:b"],
    )
    def test_field_names_that_are_not_identifiers_are_refused(
        self, storage: Harness, name: str
    ) -> None:
        before = storage.snapshot()
        steps = [
            requested("tx-1", "update", {"target": "accounts", "key": 1, "set": {name: 1}}),
            requested(
                "tx-2", "increment", {"target": "accounts", "key": 1, "field": name, "by": 1}
            ),
            requested("tx-3", "put", {"target": "accounts", "key": 1, "value": {name: "x"}}),
        ]
        reports = storage.storage.execute(steps)
        assert [r.status for r in reports] == [StepStatus.FAILED] * 3
        assert all("is not a valid name" in (r.reason or "") for r in reports)
        assert storage.snapshot() == before

    def test_ledger_is_per_participant(self, storage: Harness) -> None:
        other = storage.make(name="shop")
        other.setup()
        storage.storage.execute(
            [requested("tx-1", "update", {"target": "accounts", "key": 1, "set": {"balance": 1}})]
        )
        other.execute(
            [requested("tx-1", "update", {"target": "orders", "key": "o-1", "set": {"qty": 2}})]
        )
        assert [e.action for e in storage.storage.ledger()] == ["update"]
        assert [e.args for e in other.ledger("tx-1")] == [
            {"target": "orders", "key": "o-1", "set": {"qty": 2}}
        ]
        # A rollback reaches each participant's own step only.
        assert other.execute([rollback("tx-1")]) == [report("tx-1", StepStatus.COMPENSATED)]
        assert storage.record("accounts", 1) == {
            "owner": "alice",
            "balance": 1,
            "credit": Decimal("10.50"),
        }

    def test_custom_handlers_try_cancel_and_confirm(self, storage: Harness) -> None:
        shop = storage.make(name="shop", handlers={"reserve": storage.reserve_handler()})
        shop.setup()
        before = storage.snapshot()
        reports = shop.execute(
            [
                requested("tx-1", "reserve", {"order": "o-1", "explode": True}),
                requested("tx-2", "reserve", {"order": "o-1"}),
                requested(
                    "tx-3", "increment", {"target": "orders", "key": "o-1", "field": "qty", "by": 4}
                ),
                requested("tx-4", "reserve", {"order": "o-9"}),
            ]
        )
        # tx-1 wrote, then rejected: its write is undone with it.
        assert reports == [
            report("tx-1", StepStatus.FAILED, reason="the handler changed its mind"),
            report("tx-2", StepStatus.APPLIED, confirm=True),  # the handler has a confirm
            report("tx-3", StepStatus.APPLIED),
            report("tx-4", StepStatus.FAILED, reason="order o-9 does not exist"),
        ]
        assert storage.record("orders", "o-1") == {
            "item": "book",
            "qty": 4,
            "price": Decimal("9.99"),
        }
        assert [e.before for e in shop.ledger("tx-2")] == [{"qty": 1}]
        assert shop.execute([rollback("tx-3"), rollback("tx-2")]) == [
            report("tx-3", StepStatus.COMPENSATED),
            report("tx-2", StepStatus.COMPENSATED),
        ]
        assert storage.snapshot() == before

        # A handler with a confirm says so when applied; a commit confirms and reports it.
        assert shop.has_confirm("reserve") and shop.needs_decision(Outcome.COMMIT)
        assert shop.execute([requested("tx-5", "reserve", {"order": "o-1"})]) == [
            report("tx-5", StepStatus.APPLIED, confirm=True)
        ]
        assert shop.execute([commit("tx-5")]) == [report("tx-5", StepStatus.COMMITTED)]
        [entry] = shop.ledger("tx-5")
        assert entry.status is LedgerStatus.COMMITTED
        # A repeated commit reports it again, and a repeated request reports `committed`.
        assert shop.execute([commit("tx-5")]) == [report("tx-5", StepStatus.COMMITTED)]
        again = requested("tx-5", "reserve", {"order": "o-1"})
        assert shop.execute([again]) == [report("tx-5", StepStatus.COMMITTED)]
        assert storage.record("orders", "o-1") == {
            "item": "confirmed",
            "qty": 0,
            "price": Decimal("9.99"),
        }

    def test_a_rejected_confirmation_leaves_the_step_applied(self, storage: Harness) -> None:
        shop = storage.make(name="shop", handlers={"reserve": storage.reserve_handler()})
        shop.setup()
        args = {"order": "o-1", "refuse_confirm": True}
        assert shop.execute([requested("tx-1", "reserve", args)]) == [
            report("tx-1", StepStatus.APPLIED, confirm=True)
        ]
        assert shop.execute([commit("tx-1")]) == []
        [entry] = shop.ledger("tx-1")
        assert entry.status is LedgerStatus.APPLIED
        # The confirmation's own write was undone with it.
        assert storage.record("orders", "o-1") == {
            "item": "book",
            "qty": 0,
            "price": Decimal("9.99"),
        }

    def test_unreachable_server_is_a_transient_error(self, storage: Harness) -> None:
        down = storage.unreachable()
        try:
            with pytest.raises(TransientError) as info:
                down.execute([rollback("tx-1")])
        finally:
            down.close()
        assert str(info.value).startswith("participant 'bank' could not ")
        assert "retrying is safe" in str(info.value)
        assert "saga:saga" not in str(info.value)  # never a password
        assert info.value.retryable


# ---------------------------------------------------------------- fingerprints and retention

FP_A = "a" * 32
FP_B = "b" * 32
BY_10: Fields = {"target": "accounts", "key": 2, "field": "balance", "by": 10}


def fingerprinted(request: Requested, fingerprint: str) -> Requested:
    return replace(request, fingerprint=fingerprint)


def seen(tx_id: str, fingerprint: str = FP_A, deadline_ms: int = DEADLINE) -> RequestSeen:
    return RequestSeen(tx_id, fingerprint, deadline_ms, NOW)


@pytest.mark.parametrize("storage", STORAGES, indirect=True)
class TestFingerprintsAndRetention:
    """One payload per transaction id; ledger entries go once finished longer than the
    retention ago (``Storage.prune``), without letting a late duplicate apply."""

    def test_a_request_with_another_fingerprint_applies_nothing(self, storage: Harness) -> None:
        first = fingerprinted(requested("tx-1", "increment", BY_10), FP_A)
        assert storage.storage.execute([first]) == [report("tx-1", StepStatus.APPLIED)]
        assert storage.storage.execute([commit("tx-1")]) == []
        before = storage.snapshot()
        other = fingerprinted(requested("tx-1", "increment", {**BY_10, "by": 99}, n_steps=2), FP_B)
        unknown_step = replace(other, step=1, args={**BY_10, "key": 1})
        assert storage.storage.execute([other, unknown_step]) == []
        assert storage.make().execute([unknown_step, other]) == []  # a restarted worker too
        assert storage.snapshot() == before
        [entry] = storage.storage.ledger("tx-1")
        assert (entry.status, entry.fingerprint) == (LedgerStatus.APPLIED, FP_A)
        # The same request again keeps behaving as before: it reports its step again.
        assert storage.storage.execute([first]) == [report("tx-1", StepStatus.APPLIED)]
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 60}

    def test_a_request_without_a_local_step_leaves_a_seen_marker(self, storage: Harness) -> None:
        before = storage.snapshot()
        assert storage.storage.execute([seen("tx-2"), seen("tx-2")]) == []
        assert storage.storage.ledger("tx-2") == []  # a marker, not a step entry
        # The reproduction: the same tx_id again, now with a step here -- nothing happens.
        resubmitted = fingerprinted(requested("tx-2", "increment", BY_10, step=1, n_steps=2), FP_B)
        assert storage.storage.execute([resubmitted]) == []
        assert storage.make().execute([resubmitted]) == []
        # In one batch with its marker, the order of the log holds.
        assert storage.storage.execute([seen("tx-3"), replace(resubmitted, tx_id="tx-3")]) == []
        assert storage.storage.execute([rollback("tx-2"), commit("tx-3")]) == []
        assert storage.snapshot() == before
        assert storage.storage.ledger("tx-2") == storage.storage.ledger("tx-3") == []

    def test_a_seen_marker_does_not_change_what_a_known_transaction_matches(
        self, storage: Harness
    ) -> None:
        first = fingerprinted(requested("tx-1", "increment", BY_10), FP_A)
        assert storage.storage.execute([first]) == [report("tx-1", StepStatus.APPLIED)]
        assert storage.storage.execute([seen("tx-1", FP_B)]) == []
        assert storage.storage.execute([first]) == [report("tx-1", StepStatus.APPLIED)]
        assert storage.make().execute([first]) == [report("tx-1", StepStatus.APPLIED)]
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 60}

    def test_entries_without_a_fingerprint_match_every_request(self, storage: Harness) -> None:
        legacy = requested("tx-1", "increment", BY_10)  # as written before fingerprints
        assert storage.storage.execute([legacy]) == [report("tx-1", StepStatus.APPLIED)]
        again = fingerprinted(legacy, FP_A)
        assert storage.storage.execute([again]) == [report("tx-1", StepStatus.APPLIED)]
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 60}

    def _finished_and_unfinished(self, storage: Harness) -> None:
        """Entries finishing at DEADLINE (six), later (one) and never (one)."""
        later = DEADLINE + 100_000
        run = storage.storage.execute
        run([fingerprinted(requested("committed", "increment", BY_10), FP_A)])
        run([commit("committed")])
        run([fingerprinted(requested("compensated", "increment", BY_10), FP_A)])
        run([rollback("compensated")])
        run([fingerprinted(requested("applied", "increment", BY_10), FP_A)])  # parallel
        run([seen("seen")])
        run([rollback("marker")])  # finishes when written: NOW + 1_000
        run([fingerprinted(requested("young", "increment", BY_10, deadline_ms=later), FP_A)])
        run([commit("young", now_ms=later - 1)])
        waiting = requested("waiting", "increment", BY_10, step=1, n_steps=2, mode=Mode.SEQUENTIAL)
        run([fingerprinted(waiting, FP_A)])
        sequential = replace(waiting, tx_id="sequential", step=0)
        assert run([sequential]) == [report("sequential", StepStatus.APPLIED)]

    def test_pruning_removes_exactly_the_entries_past_the_horizon(self, storage: Harness) -> None:
        self._finished_and_unfinished(storage)
        everything = {(e.tx_id, e.step) for e in storage.storage.ledger()}
        assert storage.storage.prune(NOW, 1000) == 0
        assert {(e.tx_id, e.step) for e in storage.storage.ledger()} == everything
        # committed (left applied by its commit), compensated, applied (parallel and
        # sequential: decided by the deadline), the seen and the rollback marker
        assert storage.storage.prune(DEADLINE, 1000) == 6
        left = {(e.tx_id, e.step) for e in storage.storage.ledger()}
        assert left == {("young", 0), ("waiting", 1)}
        assert storage.storage.prune(DEADLINE, 1000) == 0
        # The young one goes later, a bounded number at a time; unfinished entries stay.
        removed = []
        for _ in range(5):
            removed.append(storage.make().prune(DEADLINE + 10**9, 1))
        assert sum(removed) == 1
        assert removed[0] == 1
        assert {(e.tx_id, e.step) for e in storage.storage.ledger()} == {("waiting", 1)}

    def test_a_duplicate_request_after_pruning_is_not_applied(self, storage: Harness) -> None:
        first = fingerprinted(requested("tx-1", "increment", BY_10), FP_A)
        storage.storage.execute([first])
        storage.storage.execute([commit("tx-1")])
        assert storage.storage.prune(DEADLINE, 1000) == 1
        assert storage.storage.ledger("tx-1") == []
        late = replace(first, now_ms=DEADLINE + 1)
        refused = [
            report("tx-1", StepStatus.FAILED, reason="deadline passed before the step was applied")
        ]
        assert storage.storage.execute([late]) == refused
        assert storage.make().execute([late]) == refused  # a restarted worker too
        assert storage.storage.execute([rollback("tx-1", now_ms=DEADLINE + 2)]) == [
            report("tx-1", StepStatus.COMPENSATED)
        ]
        assert storage.record("accounts", 2) == {"owner": "bob", "balance": 60}  # applied once


# ---------------------------------------------------------------- MongoDB specifics


class Crash(Exception):
    """The process dies here (raised once by :func:`crash_once`)."""


def crash_once(monkeypatch: pytest.MonkeyPatch, owner: type, name: str) -> list[int]:
    """Make ``owner.name`` raise :class:`Crash` on its first call; count the calls."""
    original = getattr(owner, name)
    calls: list[int] = []

    def crashing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise Crash(f"crash in {owner.__name__}.{name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, crashing)
    return calls


INCREMENT_BOB = requested(
    "tx-1", "increment", {"target": "accounts", "key": 2, "field": "balance", "by": 10}
)

BATCH = [
    requested("tx-1", "increment", {"target": "accounts", "key": 1, "field": "balance", "by": 1}),
    requested("tx-2", "increment", {"target": "accounts", "key": 2, "field": "balance", "by": 2}),
    requested("tx-3", "increment", {"target": "orders", "key": "o-1", "field": "qty", "by": 3}),
]
"""Three new steps on three documents: one batch of intents."""

FILTER_OF = {"find": "filter", "findAndModify": "query", "update": "updates", "delete": "deletes"}


def counting_storage(
    mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
) -> tuple[Storage, list[tuple[str, str, list[Any]]]]:
    """A storage whose document commands are recorded as ``(command, collection, _ids)``;
    a command filtering on anything but ``_id`` fails the test."""
    seen: list[tuple[str, str, list[Any]]] = []

    class Listener(pymongo.monitoring.CommandListener):
        def started(self, event: pymongo.monitoring.CommandStartedEvent) -> None:
            name, command = event.command_name, event.command
            if name == "insert":
                ids = [doc["_id"] for doc in command["documents"]]
            elif name in FILTER_OF:
                found = command[FILTER_OF[name]]
                filters = [s["q"] for s in found] if name in ("update", "delete") else [found]
                assert all(list(f) == ["_id"] for f in filters), f"{name} filters on {filters}"
                ids = [f["_id"] for f in filters]
            else:
                return
            seen.append((name, command[name], ids))

        def succeeded(self, event: pymongo.monitoring.CommandSucceededEvent) -> None:
            pass

        def failed(self, event: pymongo.monitoring.CommandFailedEvent) -> None:
            pass

    real = _mongo.MongoClient

    def client(*args: Any, **kwargs: Any) -> Any:
        return real(*args, event_listeners=[Listener()], **kwargs)

    monkeypatch.setattr(_mongo, "MongoClient", client)
    storage = mongo.make()
    storage.setup()
    seen.clear()
    return storage, seen


class TestMongo:
    """The single-document write protocol of :mod:`participants._mongo` (FerretDB here)."""

    def test_ferretdb_has_no_transactions_and_saying_otherwise_is_refused(
        self, mongo: MongoHarness
    ) -> None:
        storage = mongo.storage
        assert isinstance(storage, MongoStorage)
        assert storage.transactional is False
        insisting = mongo.make(transactions=True)
        with pytest.raises(ConfigurationError, match="has no multi-document transactions"):
            insisting.setup()

    def test_ledger_layout(self, mongo: MongoHarness) -> None:
        mongo.storage.execute([INCREMENT_BOB])
        doc = mongo.db["saga_ledger"].find_one({"_id": "bank:tx-1:0"})
        assert doc is not None
        assert (doc["status"], doc["rev"], "pending" in doc) == ("applied", 1, False)
        assert json.loads(doc["args"])["field"] == "balance"  # JSON text: no key restrictions
        assert mongo.db["accounts"].find_one({"_id": 2})["_saga"].startswith("bank:tx-1:0#1.")
        # The transaction document lists the step; its creation intent is spent.
        tx = mongo.db["saga_ledger_tx"].find_one({"_id": "bank:tx-1"})
        assert tx is not None
        assert (tx["participant"], tx["tx_id"], tx["steps"], "rolled_back" in tx) == (
            "bank",
            "tx-1",
            [0],
            False,
        )
        assert mongo.db["saga_ledger"].count_documents({"step": {"$exists": False}}) == 0
        names = {ix["name"] for ix in mongo.db["saga_ledger"].list_indexes()}
        assert {"saga_by_tx", "saga_by_status"} <= names
        assert "saga_pending" not in names

    def test_the_hot_path_addresses_documents_by_id_only(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A new step: read, then its intent, write and record each batched; a decision:
        one update."""
        storage, seen = counting_storage(mongo, monkeypatch)

        def bump(tx_id: str, target: str, key: Any, field: str) -> Any:
            return requested(
                tx_id, "increment", {"target": target, "key": key, "field": field, "by": 1}
            )

        steps = [
            bump("tx-1", "accounts", 2, "balance"),
            bump("tx-2", "orders", "o-1", "qty"),
            bump("tx-3", "accounts", 2, "balance"),
        ]
        assert [r.status for r in storage.execute(steps)] == [StepStatus.APPLIED] * 3
        assert seen == [
            ("find", "accounts", [2]),
            ("find", "orders", ["o-1"]),
            # tx-3 reads accounts/2, which tx-1's pending write holds: the batch's
            # transaction documents (with the intents) go in together, then their writes.
            ("insert", "saga_ledger_tx", ["bank:tx-1", "bank:tx-2"]),
            ("findAndModify", "accounts", [2]),
            ("findAndModify", "orders", ["o-1"]),
            ("find", "accounts", [2]),
            # accounts/2 carries tx-1's marker: the batch's records go in before it changes.
            ("insert", "saga_ledger", ["bank:tx-1:0", "bank:tx-2:0"]),
            ("insert", "saga_ledger_tx", ["bank:tx-3"]),
            ("findAndModify", "accounts", [2]),
            ("insert", "saga_ledger", ["bank:tx-3:0"]),
        ]
        seen.clear()
        # Commits of built-in steps: nothing to confirm, not one command.
        decisions = [commit("tx-1"), commit("tx-2"), commit("tx-3")]
        assert storage.execute(decisions) == []
        assert seen == []
        # A rollback costs one update of the step document and the compensating write.
        assert [r.status for r in storage.execute([rollback("tx-3")])] == [StepStatus.COMPENSATED]
        assert [c for c in seen if c[1] == "saga_ledger"] == [
            ("findAndModify", "saga_ledger", ["bank:tx-3:0"]),
            ("findAndModify", "saga_ledger", ["bank:tx-3:0"]),
        ]
        seen.clear()
        # A decision in the batch of its request: the record goes in before it changes.
        both = [bump("tx-4", "orders", "o-1", "qty"), rollback("tx-4")]
        assert [r.status for r in storage.execute(both)] == [
            StepStatus.APPLIED,
            StepStatus.COMPENSATED,
        ]
        assert ("insert", "saga_ledger", ["bank:tx-4:0"]) in seen
        assert seen.index(("insert", "saga_ledger", ["bank:tx-4:0"])) < seen.index(
            ("findAndModify", "saga_ledger", ["bank:tx-4:0"])
        )
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 51}
        assert mongo.record("orders", "o-1") == {"item": "book", "qty": 2, "price": Decimal("9.99")}
        statuses = [e.status for e in storage.ledger()]
        assert statuses == [LedgerStatus.APPLIED] * 2 + [LedgerStatus.COMPENSATED] * 2

    def test_a_write_that_finds_the_document_changed_is_put_back_and_retried(
        self, mongo: MongoHarness
    ) -> None:
        """A change made between a step's read and its write makes the write miss (on
        FerretDB: the write is undone at once), and the batch is run again."""
        meddled: list[int] = []

        def meddle(session: MongoSession, args: Mapping[str, Any]) -> Any:
            doc = session.read("accounts", 2)
            assert doc is not None
            if not meddled:  # another writer, between this step's read and its write
                meddled.append(1)
                mongo.db["accounts"].update_one({"_id": 2}, {"$set": {"balance": 55}})
            balance = doc["balance"]
            session.stage(
                DocumentWrite(
                    "accounts",
                    2,
                    "update",
                    doc.get("_saga"),
                    set={"balance": balance + 1},
                    guard={"balance": balance},
                )
            )
            return {"balance": balance}

        storage = mongo.make(handlers={"meddle": Handler(meddle, lambda *_: None)})
        step = requested("tx-1", "meddle", {})
        # The write of a batched intent misses: the document is put back, the intent
        # discarded, and the batch runs again, this time reading the new balance.
        assert storage.execute([step]) == [report("tx-1", StepStatus.APPLIED)]
        assert meddled == [1]
        assert mongo.raw("accounts", 2) == {"owner": "bob", "balance": 56, "credit": None}
        [entry] = storage.ledger("tx-1")
        assert entry.before == {"balance": 55}

    def test_crash_after_the_write_before_the_ledger_applies_once(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        crash_once(monkeypatch, _MongoUnit, "_finalise")
        with pytest.raises(Crash):
            mongo.storage.execute([INCREMENT_BOB])
        assert mongo.raw("accounts", 2) == {"owner": "bob", "balance": 60, "credit": None}
        assert mongo.storage.ledger("tx-1") == []  # only the intent is recorded
        # The restarted worker finds the intent, sees the marker on the document and
        # finishes the ledger record instead of applying the step again.
        restarted = mongo.make(intent_lease_ms=0)
        assert restarted.execute([INCREMENT_BOB]) == [report("tx-1", StepStatus.APPLIED)]
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 60}
        [entry] = restarted.ledger("tx-1")
        assert (entry.status, entry.before) == (LedgerStatus.APPLIED, {"balance": 50})
        assert restarted.execute([rollback("tx-1")]) == [report("tx-1", StepStatus.COMPENSATED)]
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 50}

    def test_crash_before_the_write_applies_once(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        crash_once(monkeypatch, DocumentWrite, "run")
        with pytest.raises(Crash):
            mongo.storage.execute([INCREMENT_BOB])
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 50}
        # Same process: its own intent is never live when found, so it is undone at once.
        assert mongo.storage.execute([INCREMENT_BOB]) == [report("tx-1", StepStatus.APPLIED)]
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 60}

    def test_crash_inside_a_compensation_compensates_once(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        mongo.storage.execute([INCREMENT_BOB])
        crash_once(monkeypatch, _MongoUnit, "_finalise")
        with pytest.raises(Crash):
            mongo.storage.execute([rollback("tx-1")])
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 50}
        [entry] = mongo.storage.ledger("tx-1")
        assert entry.status is LedgerStatus.APPLIED
        assert mongo.storage.execute([rollback("tx-1")]) == [report("tx-1", StepStatus.COMPENSATED)]
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 50}

    def test_crash_after_a_delete_keeps_its_before_image(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        before = mongo.snapshot()
        delete = requested("tx-1", "delete", {"target": "accounts", "key": 1})
        crash_once(monkeypatch, _MongoUnit, "_finalise")
        with pytest.raises(Crash):
            mongo.storage.execute([delete])
        # A delete marks the document, and removes it once the ledger has the step:
        # the mark proves the delete happened. The re-delivery reports it applied,
        # with the old document, and removes it.
        marked = mongo.db["accounts"].find_one({"_id": 1})
        assert marked is not None
        assert marked["_saga"].startswith("bank:tx-1:0#1.")
        assert marked["_saga"].endswith("!deleted")
        assert mongo.storage.execute([delete]) == [report("tx-1", StepStatus.APPLIED)]
        assert mongo.raw("accounts", 1) is None
        [entry] = mongo.storage.ledger("tx-1")
        assert entry.before == {"owner": "alice", "balance": 100, "credit": 10.5}
        assert mongo.storage.execute([rollback("tx-1")]) == [report("tx-1", StepStatus.COMPENSATED)]
        assert mongo.snapshot() == before

    def test_an_intent_of_another_live_worker_is_left_alone_until_its_lease_ends(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        crash_once(monkeypatch, _MongoUnit, "_finalise")
        with pytest.raises(Crash):
            mongo.storage.execute([INCREMENT_BOB])
        other = mongo.make()  # another process, default lease
        with pytest.raises(TransientError, match="in progress by another worker"):
            other.execute([INCREMENT_BOB])
        assert mongo.make(intent_lease_ms=0).execute([INCREMENT_BOB]) == [
            report("tx-1", StepStatus.APPLIED)
        ]
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 60}

    def test_another_step_on_the_document_finishes_the_interrupted_write_first(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        crash_once(monkeypatch, _MongoUnit, "_finalise")
        with pytest.raises(Crash):
            mongo.storage.execute([INCREMENT_BOB])
        restarted = mongo.make(intent_lease_ms=0)
        other = requested(
            "tx-2", "increment", {"target": "accounts", "key": 2, "field": "balance", "by": 5}
        )
        assert restarted.execute([other]) == [report("tx-2", StepStatus.APPLIED)]
        # tx-1's ledger record was completed on the way, before tx-2 wrote.
        [entry] = restarted.ledger("tx-1")
        assert entry.status is LedgerStatus.APPLIED
        assert restarted.execute([INCREMENT_BOB]) == [report("tx-1", StepStatus.APPLIED)]
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 65}

    def test_a_document_an_interrupted_delete_marked_reads_as_absent(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        delete = requested("tx-1", "delete", {"target": "accounts", "key": 1})
        crash_once(monkeypatch, _MongoUnit, "_finalise")
        with pytest.raises(Crash):
            mongo.storage.execute([delete])
        restarted = mongo.make(intent_lease_ms=0)
        insert = requested(
            "tx-2", "insert", {"target": "accounts", "key": 1, "value": {"owner": "zed"}}
        )
        # The insert finds the mark, records the delete, removes the document, inserts.
        assert restarted.execute([insert]) == [report("tx-2", StepStatus.APPLIED)]
        assert mongo.record("accounts", 1) == {"owner": "zed"}
        [entry] = restarted.ledger("tx-1")
        assert (entry.status, entry.before) == (
            LedgerStatus.APPLIED,
            {"owner": "alice", "balance": 100, "credit": 10.5},
        )
        # Undoing the delete now finds the key taken: the compensation fails, visibly.
        [got] = restarted.execute([rollback("tx-1")])
        assert got.status is StepStatus.COMPENSATION_FAILED
        assert mongo.record("accounts", 1) == {"owner": "zed"}

    def test_a_delete_recorded_but_not_yet_removed_is_removed_by_its_next_decision(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        delete = requested("tx-1", "delete", {"target": "accounts", "key": 1})
        crash_once(monkeypatch, _mongo_recovery, "_purge")
        with pytest.raises(Crash):
            mongo.storage.execute([delete])
        [entry] = mongo.storage.ledger("tx-1")
        assert entry.status is LedgerStatus.APPLIED
        marked = mongo.db["accounts"].find_one({"_id": 1})
        assert marked is not None and marked["_saga"].endswith("!deleted")
        # Nothing reads accounts/1 again, and a commit does not load the step (nothing to
        # confirm); the request, re-delivered after the crash, loads the step, which names it.
        restarted = mongo.make()
        assert restarted.execute([commit("tx-1")]) == []
        assert restarted.execute([delete]) == [report("tx-1", StepStatus.APPLIED)]
        assert mongo.db["accounts"].find_one({"_id": 1}) is None
        step = mongo.db["saga_ledger"].find_one({"_id": "bank:tx-1:0"})
        assert step is not None and "purge" not in step

    def test_applied_steps_whose_records_were_lost_are_recovered_from_their_intents(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The step documents of new steps are inserted in batches; a crash may lose one."""
        steps = [
            requested(
                "tx-1", "increment", {"target": "accounts", "key": 1, "field": "balance", "by": 1}
            ),
            requested(
                "tx-2", "increment", {"target": "accounts", "key": 2, "field": "balance", "by": 2}
            ),
            requested(
                "tx-3", "increment", {"target": "orders", "key": "o-1", "field": "qty", "by": 3}
            ),
        ]

        def lost(*args: Any, **kwargs: Any) -> None:
            raise Crash("the process dies before the batch of records is inserted")

        monkeypatch.setattr(SharedState, "insert_records", lost)
        with pytest.raises(Crash):
            mongo.storage.execute(steps)
        monkeypatch.undo()
        assert mongo.storage.ledger() == []  # only the intents record the writes
        assert (mongo.raw("accounts", 1) or {})["balance"] == 101
        # A new process: nothing in memory.
        restarted = mongo.make(intent_lease_ms=0, shared=SharedState())
        # A decision finds its step through the transaction document...
        assert restarted.execute([rollback("tx-1")]) == [report("tx-1", StepStatus.COMPENSATED)]
        # ...a re-delivered request through its own step...
        assert restarted.execute([steps[1]]) == [report("tx-2", StepStatus.APPLIED)]
        # ...and the next write of a document through the marker the document carries.
        other = requested(
            "tx-4", "increment", {"target": "orders", "key": "o-1", "field": "qty", "by": 10}
        )
        assert restarted.execute([other]) == [report("tx-4", StepStatus.APPLIED)]
        statuses = {e.tx_id: e.status for e in restarted.ledger()}
        assert statuses == {
            "tx-1": LedgerStatus.COMPENSATED,
            "tx-2": LedgerStatus.APPLIED,
            "tx-3": LedgerStatus.APPLIED,
            "tx-4": LedgerStatus.APPLIED,
        }
        assert mongo.record("accounts", 1) == {
            "owner": "alice",
            "balance": 100,
            "credit": Decimal("10.50"),
        }
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 52}
        assert mongo.record("orders", "o-1") == {
            "item": "book",
            "qty": 14,
            "price": Decimal("9.99"),
        }

    def test_a_batch_meeting_a_known_transaction_runs_again_and_refuses_the_late_request(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The batch's transaction documents go in with one insert; one already there
        (here: tx-2's rollback marker) is skipped, the others' writes run, and the batch
        runs again, reading: tx-2's request is refused, the others are repeats."""
        assert mongo.make().execute([rollback("tx-2")]) == []  # another worker, before
        storage, seen = counting_storage(mongo, monkeypatch)
        assert storage.execute(BATCH) == [
            report("tx-1", StepStatus.APPLIED),
            report("tx-2", StepStatus.COMPENSATED),
            report("tx-3", StepStatus.APPLIED),
        ]
        intents = ("insert", "saga_ledger_tx", ["bank:tx-1", "bank:tx-2", "bank:tx-3"])
        assert seen.count(intents) == 1
        assert [c for c in seen if c[0] == "findAndModify" and c[1] in TARGETS] == [
            ("findAndModify", "accounts", [1]),
            ("findAndModify", "orders", ["o-1"]),
        ]
        assert (mongo.raw("accounts", 1) or {})["balance"] == 101
        assert (mongo.raw("accounts", 2) or {})["balance"] == 50
        assert (mongo.raw("orders", "o-1") or {})["qty"] == 4
        assert {(e.tx_id, e.status, e.effect) for e in storage.ledger()} == {
            ("tx-1", LedgerStatus.APPLIED, True),
            ("tx-2", LedgerStatus.COMPENSATED, False),
            ("tx-3", LedgerStatus.APPLIED, True),
        }
        assert mongo.make().execute(BATCH) == storage.execute(BATCH)  # repeats change nothing
        assert (mongo.raw("orders", "o-1") or {})["qty"] == 4

    def test_a_crash_after_the_batch_of_intents_before_any_write_applies_each_once(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Every intent is in, no write ran: each is rolled back by its next reader (a
        decision or the re-delivered request), and a rolled-back one refuses its request."""
        crash_once(monkeypatch, DocumentWrite, "run")
        with pytest.raises(Crash):
            mongo.storage.execute(BATCH)
        monkeypatch.undo()
        for tx in ("tx-1", "tx-2", "tx-3"):
            tx_doc = mongo.db["saga_ledger_tx"].find_one({"_id": f"bank:{tx}"})
            assert tx_doc is not None and "s0" in tx_doc["pending"]
        assert (mongo.raw("accounts", 1) or {})["balance"] == 100
        restarted = mongo.make(intent_lease_ms=0, shared=SharedState())
        assert restarted.execute([rollback("tx-1")]) == []  # its write never happened
        assert restarted.execute(BATCH) == [
            report("tx-1", StepStatus.COMPENSATED),
            report("tx-2", StepStatus.APPLIED),
            report("tx-3", StepStatus.APPLIED),
        ]
        assert (mongo.raw("accounts", 1) or {})["balance"] == 100
        assert (mongo.raw("accounts", 2) or {})["balance"] == 52
        assert (mongo.raw("orders", "o-1") or {})["qty"] == 4

    def test_a_crash_between_the_writes_of_a_batch_rolls_each_forward_or_back(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """tx-1's write happened, tx-2's and tx-3's did not, and no step document was
        inserted: a new process finishes tx-1 from its intent and applies the others once."""
        calls: list[int] = []
        run = DocumentWrite.run

        def dies_second(self: DocumentWrite, *args: Any, **kwargs: Any) -> bool:
            calls.append(1)
            if len(calls) == 2:
                raise Crash("the process dies before the batch's second write")
            return run(self, *args, **kwargs)

        def lost(*args: Any, **kwargs: Any) -> None:
            raise Crash("the process is dead: no record goes in")

        monkeypatch.setattr(DocumentWrite, "run", dies_second)
        monkeypatch.setattr(SharedState, "insert_records", lost)
        with pytest.raises(Crash):
            mongo.storage.execute(BATCH)
        monkeypatch.undo()
        assert mongo.storage.ledger() == []
        assert (mongo.raw("accounts", 1) or {})["balance"] == 101
        assert (mongo.raw("accounts", 2) or {})["balance"] == 50
        restarted = _restart_and_apply_batch(mongo)
        befores = {e.tx_id: e.before for e in restarted.ledger()}
        assert befores == {"tx-1": {"balance": 100}, "tx-2": {"balance": 50}, "tx-3": {"qty": 1}}
        assert restarted.execute([rollback("tx-1")]) == [report("tx-1", StepStatus.COMPENSATED)]
        assert (mongo.raw("accounts", 1) or {})["balance"] == 100

    def test_a_partly_inserted_batch_of_intents_leaves_each_absent_or_recoverable(
        self, mongo: MongoHarness, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The insert of the batch's transaction documents dies after the first: tx-1's
        intent is there (its write never ran), tx-2's and tx-3's are absent (not started)."""
        insert_many = pymongo.collection.Collection.insert_many

        def dies_after_one(self: Any, documents: Any, *args: Any, **kwargs: Any) -> Any:
            if self.name == "saga_ledger_tx" and len(documents) > 1:
                insert_many(self, documents[:1], *args, **kwargs)
                raise Crash("the process dies inside the insert of the intents")
            return insert_many(self, documents, *args, **kwargs)

        monkeypatch.setattr(pymongo.collection.Collection, "insert_many", dies_after_one)
        with pytest.raises(Crash):
            mongo.storage.execute(BATCH)
        monkeypatch.undo()
        ids = [d["_id"] for d in mongo.db["saga_ledger_tx"].find({})]
        assert ids == ["bank:tx-1"]
        assert (mongo.raw("accounts", 1) or {})["balance"] == 100
        restarted = _restart_and_apply_batch(mongo)
        assert [e.status for e in restarted.ledger()] == [LedgerStatus.APPLIED] * 3

    def test_a_stale_memory_of_the_ledger_is_caught_by_the_compare_and_set(
        self, mongo: MongoHarness
    ) -> None:
        first, second = mongo.storage, mongo.make()
        steps = [
            INCREMENT_BOB,
            requested(
                "tx-2", "increment", {"target": "accounts", "key": 1, "field": "balance", "by": 1}
            ),
        ]
        assert len(first.execute(steps)) == 2
        # Another worker of the participant rolls both back while the first one remembers
        # them as applied (a partition moved, then moved back).
        assert len(second.execute([rollback("tx-1"), rollback("tx-2")])) == 2
        with pytest.raises(TransientError, match="at the same time"):
            first.execute([rollback("tx-1")])
        # The conflict made it forget: the retry reads the compensation, and only reports it.
        assert first.execute([rollback("tx-1")]) == [report("tx-1", StepStatus.COMPENSATED)]
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 50}
        # What the runtime calls after a partition assignment also forgets.
        first.in_flight_sequential()
        assert first.execute([rollback("tx-2")]) == [report("tx-2", StepStatus.COMPENSATED)]
        assert mongo.record("accounts", 1) == {
            "owner": "alice",
            "balance": 100,
            "credit": Decimal("10.50"),
        }
        assert {e.status for e in first.ledger()} == {LedgerStatus.COMPENSATED}

    def test_concurrent_steps_on_one_document_lose_no_update(self, mongo: MongoHarness) -> None:
        """FerretDB updates are read-then-write; the per-document lock serialises them."""
        workers = [mongo.make() for _ in range(4)]
        errors: list[BaseException] = []

        def work(index: int, storage: Storage) -> None:
            try:
                for n in range(10):
                    step = requested(
                        f"tx-{index}-{n}",
                        "increment",
                        {"target": "accounts", "key": 2, "field": "balance", "by": 1},
                    )
                    assert storage.execute([step]) == [
                        report(f"tx-{index}-{n}", StepStatus.APPLIED)
                    ]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i, w)) for i, w in enumerate(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert errors == []
        assert mongo.record("accounts", 2) == {"owner": "bob", "balance": 90}

    def test_numeric_string_keys_address_integer_ids(self, mongo: MongoHarness) -> None:
        steps = [
            requested("tx-1", "update", {"target": "accounts", "key": "2", "set": {"owner": "b"}}),
            requested("tx-2", "insert", {"target": "orders", "key": "007", "value": {"qty": 1}}),
        ]
        assert only_status(mongo.storage.execute(steps)) == [
            ("tx-1", 0, StepStatus.APPLIED),
            ("tx-2", 0, StepStatus.APPLIED),
        ]
        assert mongo.record("accounts", 2) == {"owner": "b", "balance": 50}
        assert mongo.record("orders", "007") == {"qty": 1}  # not canonical: stays text

    @pytest.mark.parametrize(
        ("action", "args", "reason"),
        [
            (
                "update",
                {"target": "accounts", "key": 1, "set": {"_id": 5}},
                "update of accounts/1 may not change the key field '_id'",
            ),
            (
                "put",
                {"target": "accounts", "key": 1, "value": {"_saga": "forged"}},
                "put of accounts/1 may not set '_saga': names starting with '_saga' are "
                "reserved for the saga marker",
            ),
            (
                "increment",
                {"target": "accounts", "key": 1, "field": "_id", "by": 1},
                "increment may not change the field '_id'",
            ),
            (
                "increment",
                {"target": "accounts", "key": 1, "field": "owner", "by": 1},
                "accounts/1 owner is not a number ('alice')",
            ),
        ],
    )
    def test_reserved_fields_and_types(
        self, mongo: MongoHarness, action: str, args: dict[str, Any], reason: str
    ) -> None:
        before = mongo.snapshot()
        assert mongo.storage.execute([requested("tx-1", action, args)]) == [
            report("tx-1", StepStatus.FAILED, reason=reason)
        ]
        assert mongo.snapshot() == before

    def test_repeating_the_key_field_is_allowed(self, mongo: MongoHarness) -> None:
        step = requested(
            "tx-1", "insert", {"target": "accounts", "key": "3", "value": {"_id": 3, "owner": "c"}}
        )
        assert mongo.storage.execute([step]) == [report("tx-1", StepStatus.APPLIED)]
        assert mongo.record("accounts", 3) == {"owner": "c"}

    def test_a_write_the_server_refuses_fails_the_step(self, mongo: MongoHarness) -> None:
        def forge(session: MongoSession, args: Mapping[str, Any]) -> Any:
            session.stage(DocumentWrite("orders", "o-9", "insert", document={"$bad": 1}))
            return None

        storage = mongo.make(handlers={"forge": Handler(forge, lambda *_: None)})
        [got] = storage.execute([requested("tx-1", "forge", {})])
        assert got.status is StepStatus.FAILED
        assert (got.reason or "").startswith("orders/o-9: the server refused the write (")
        assert mongo.raw("orders", "o-9") is None
        [entry] = storage.ledger("tx-1")
        assert entry.status is LedgerStatus.FAILED

    def test_fractions_round_trip_exactly(self, mongo: MongoHarness) -> None:
        steps = [
            requested(
                "tx-1", "increment", {"target": "accounts", "key": 1, "field": "balance", "by": 0.5}
            ),
            requested(
                "tx-2", "increment", {"target": "accounts", "key": 1, "field": "credit", "by": 0.2}
            ),
        ]
        before = mongo.snapshot()
        mongo.storage.execute(steps)
        assert mongo.raw("accounts", 1) == {"owner": "alice", "balance": 100.5, "credit": 10.7}
        mongo.storage.execute([rollback("tx-1"), rollback("tx-2")])
        assert mongo.snapshot() == before
        assert isinstance(mongo.raw("accounts", 1)["balance"], int)  # type: ignore[index]

    def test_participant_names_may_not_contain_a_colon(self, mongo: MongoHarness) -> None:
        with pytest.raises(ConfigurationError, match="participant name 'a:b'"):
            mongo.make(name="a:b")

    def test_open_storage_builds_it(self, mongo: MongoHarness) -> None:
        storage = open_storage(
            "mongo", name="bank", url=mongo.url, targets=["accounts"], schema=mongo.db.name
        )
        try:
            assert isinstance(storage, MongoStorage)
            assert storage.db.name == mongo.db.name
        finally:
            storage.close()


# ---------------------------------------------------------------- Redis specifics


def no_cancel(session: Any, args: Mapping[str, Any], before: Any) -> None:
    pass


class TestRedis:
    """WATCH/MULTI/EXEC rounds, key validation and text values of :mod:`participants._redis`."""

    def test_a_step_that_loses_the_watch_race_runs_again(self, redis_store: RedisHarness) -> None:
        other = redis.Redis.from_url(redis_store.url, decode_responses=True)
        seen: list[str] = []

        def meddle(session: RedisSession, args: Mapping[str, Any]) -> Any:
            record = session.read("accounts", 2)
            assert record is not None
            seen.append(record["balance"])
            if len(seen) == 1:  # a concurrent writer, between our read and our EXEC
                other.hset(session.key("accounts", 2), "balance", "55")
            session.queue("HINCRBY", session.key("accounts", 2), "balance", "1")
            return None

        storage = redis_store.make(handlers={"meddle": Handler(meddle, no_cancel)})
        try:
            assert storage.execute([requested("tx-1", "meddle", {})]) == [
                report("tx-1", StepStatus.APPLIED)
            ]
        finally:
            other.close()
        assert seen == ["50", "55"]
        assert redis_store.raw("accounts", 2) == {"owner": "bob", "balance": "56"}
        assert [e.status for e in storage.ledger("tx-1")] == [LedgerStatus.APPLIED]

    def test_a_step_that_keeps_losing_is_a_transient_error(self, redis_store: RedisHarness) -> None:
        other = redis.Redis.from_url(redis_store.url, decode_responses=True)

        def meddle(session: RedisSession, args: Mapping[str, Any]) -> Any:
            session.read("accounts", 2)
            other.hincrby(session.key("accounts", 2), "balance", 1)
            session.queue("HSET", session.key("accounts", 2), "owner", "mallory")
            return None

        storage = redis_store.make(handlers={"meddle": Handler(meddle, no_cancel)}, max_attempts=3)
        try:
            with pytest.raises(TransientError, match=r"kept conflicting .* \(3 attempts\)"):
                storage.execute([requested("tx-1", "meddle", {})])
        finally:
            other.close()
        assert redis_store.raw("accounts", 2) == {"owner": "bob", "balance": "53"}
        assert storage.ledger("tx-1") == []

    def test_concurrent_steps_on_one_record_lose_no_update(self, redis_store: RedisHarness) -> None:
        workers = [redis_store.make() for _ in range(4)]
        errors: list[BaseException] = []

        def work(index: int, storage: Storage) -> None:
            try:
                for n in range(10):
                    step = requested(
                        f"tx-{index}-{n}",
                        "increment",
                        {"target": "accounts", "key": 2, "field": "balance", "by": 1},
                    )
                    storage.execute([step])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i, w)) for i, w in enumerate(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert errors == []
        assert redis_store.raw("accounts", 2) == {"owner": "bob", "balance": "90"}

    @pytest.mark.parametrize("key", ["a b", "a*", "a?", "a[1]", "a]", "a\\b", "a\u00a0b"])
    def test_keys_with_whitespace_or_glob_characters_are_refused(
        self, redis_store: RedisHarness, key: str
    ) -> None:
        before = redis_store.snapshot()
        step = requested("tx-1", "put", {"target": "accounts", "key": key, "value": {"a": 1}})
        [got] = redis_store.storage.execute([step])
        assert got.status is StepStatus.FAILED
        assert "may not contain whitespace, control characters or the glob" in (got.reason or "")
        assert redis_store.snapshot() == before

    @pytest.mark.parametrize("key", ["a\r\nDEL x", "a\tb"])
    def test_keys_with_line_breaks_are_refused(self, redis_store: RedisHarness, key: str) -> None:
        step = requested("tx-1", "put", {"target": "accounts", "key": key, "value": {"a": 1}})
        [got] = redis_store.storage.execute([step])
        assert got.status is StepStatus.FAILED
        assert "control character" in (got.reason or "")

    @pytest.mark.parametrize("key", ["2024:01", "o-1.x_y", 42, -7])
    def test_plain_keys_are_used_as_they_are(self, redis_store: RedisHarness, key: Any) -> None:
        step = requested("tx-1", "put", {"target": "orders", "key": key, "value": {"qty": 1}})
        assert redis_store.storage.execute([step]) == [report("tx-1", StepStatus.APPLIED)]
        assert redis_store.client.hgetall(f"{redis_store.prefix}:orders:{key}") == {"qty": "1"}

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"prefix": "a b"}, "key prefix 'a b' must be"),
            ({"prefix": "saga*"}, "key prefix 'saga\\*' must be"),
            ({"prefix": "saga:"}, "and not end with ':'"),
            ({"prefix": ""}, "key prefix '' must be"),
            ({"name": "bank:1"}, "participant name 'bank:1'"),
            ({"name": "bank*"}, "participant name 'bank\\*'"),
            ({"targets": ["ledger"]}, "target name 'ledger' is reserved"),
            ({"targets": ["acc ounts"]}, "is not a plain name"),
        ],
    )
    def test_configuration_is_checked_up_front(
        self, redis_store: RedisHarness, options: dict[str, Any], message: str
    ) -> None:
        name = options.pop("name", "bank")
        targets = options.pop("targets", ["accounts"])
        with pytest.raises(ConfigurationError, match=message):
            RedisStorage(name, redis_store.url, targets, **options)

    @pytest.mark.parametrize(
        "text",
        [
            "return redis.call('FLUSHALL')",
            "'); redis.call('DEL', KEYS[1]); --",
            'EVAL "return 1" 0',
            "*3\r\n$3\r\nDEL\r\n",
            "${jndi:x} %s {0} ☃",
        ],
    )
    def test_lua_looking_text_is_stored_verbatim(
        self, redis_store: RedisHarness, text: str
    ) -> None:
        sentinel = f"{redis_store.prefix}:sentinel"
        redis_store.client.set(sentinel, "still here")
        steps = [
            requested("tx-1", "put", {"target": "orders", "key": "o-1", "value": {"item": text}}),
            requested(
                "tx-2", "insert", {"target": "orders", "key": "o-2", "value": {"note": text}}
            ),
        ]
        assert only_status(redis_store.storage.execute(steps)) == [
            ("tx-1", 0, StepStatus.APPLIED),
            ("tx-2", 0, StepStatus.APPLIED),
        ]
        assert redis_store.raw("orders", "o-1") == {"item": text, "qty": "1", "price": "9.99"}
        assert redis_store.raw("orders", "o-2") == {"note": text}
        assert redis_store.client.get(sentinel) == "still here"

    def test_a_record_that_is_not_a_hash_fails_the_step(self, redis_store: RedisHarness) -> None:
        redis_store.client.set(redis_store.key("accounts", 5), "plain string")
        step = requested("tx-1", "update", {"target": "accounts", "key": 5, "set": {"a": 1}})
        assert redis_store.storage.execute([step]) == [
            report(
                "tx-1",
                StepStatus.FAILED,
                reason="accounts/5 holds a Redis string, not a hash record",
            )
        ]
        assert redis_store.client.get(redis_store.key("accounts", 5)) == "plain string"

    def test_values_are_text_and_increments_are_exact(self, redis_store: RedisHarness) -> None:
        before = redis_store.snapshot()
        steps = [
            requested(
                "tx-1",
                "increment",
                {"target": "accounts", "key": 1, "field": "balance", "by": 0.5, "max": 1000},
            ),
            requested(
                "tx-2",
                "increment",
                {"target": "accounts", "key": 1, "field": "credit", "by": -0.6},
            ),
            requested(
                "tx-3",
                "update",
                {"target": "accounts", "key": 2, "set": {"vip": True, "ratio": 0.25, "n": -3}},
            ),
        ]
        assert len(redis_store.storage.execute(steps)) == 3
        assert redis_store.raw("accounts", 1) == {
            "owner": "alice",
            "balance": "100.5",
            "credit": "9.90",
        }
        assert redis_store.raw("accounts", 2) == {
            "owner": "bob",
            "balance": "50",
            "vip": "true",
            "ratio": "0.25",
            "n": "-3",
        }
        redis_store.storage.execute([rollback("tx-1"), rollback("tx-2"), rollback("tx-3")])
        assert redis_store.snapshot() == before  # "100", not "100.0"; "10.50", not "10.5"

    def test_null_removes_a_field_and_a_record_keeps_one(self, redis_store: RedisHarness) -> None:
        steps = [
            requested("tx-1", "update", {"target": "accounts", "key": 1, "set": {"credit": None}}),
            requested("tx-2", "insert", {"target": "accounts", "key": 3, "value": {"owner": None}}),
            requested(
                "tx-3",
                "update",
                {
                    "target": "orders",
                    "key": "o-1",
                    "set": {"item": None, "qty": None, "price": None},
                },
            ),
        ]
        reports = redis_store.storage.execute(steps)
        assert only_status(reports) == [
            ("tx-1", 0, StepStatus.APPLIED),
            ("tx-2", 0, StepStatus.FAILED),
            ("tx-3", 0, StepStatus.FAILED),
        ]
        assert "needs at least one field that is not null" in (reports[1].reason or "")
        assert redis_store.raw("accounts", 1) == {"owner": "alice", "balance": "100"}

    def test_ledger_layout(self, redis_store: RedisHarness) -> None:
        prefix = redis_store.prefix
        first = requested(
            "tx:1",
            "update",
            {"target": "accounts", "key": 1, "set": {"balance": 0}},
            step=0,
            n_steps=2,
            mode=Mode.SEQUENTIAL,
        )
        redis_store.storage.execute([first, rollback("tx:2")])
        ledger = redis_store.client.hgetall(f"{prefix}:ledger:bank:tx:tx:1")
        assert set(ledger) == {"0"}
        assert json.loads(ledger["0"])["status"] == "applied"
        assert set(redis_store.client.hgetall(f"{prefix}:ledger:bank:tx:tx:2")) == {"rolled_back"}
        assert redis_store.client.smembers(f"{prefix}:ledger:bank:in_flight") == {"tx:1"}
        assert redis_store.storage.in_flight_sequential() == {"tx:1"}

    def test_the_reconciliation_job_reads_the_ledger_the_adapter_writes(
        self, redis_store: RedisHarness
    ) -> None:
        """One key layout (participants._ledger): the audit's reader finds every step entry
        the adapter wrote, under the right participant and transaction, and no marker."""
        from saga.streams.reconcile._sources import _redis_ledger_rows

        bump = {"target": "accounts", "key": 1, "field": "balance", "by": 1}
        redis_store.storage.execute(
            [
                requested("tx:1", "increment", bump, step=1, n_steps=2),
                requested("tx-2", "increment", {**bump, "by": -1000, "min": 0}),
                rollback("tx-3"),
                seen("tx-4"),
            ]
        )
        rows = sorted(_redis_ledger_rows(redis_store.url, redis_store.prefix, "redis"))
        assert [row[:6] for row in rows] == [
            ("redis", "bank", "tx-2", 0, "failed", False),
            ("redis", "bank", "tx:1", 1, "applied", True),
        ]
        assert [e.tx_id for e in redis_store.storage.ledger()] == ["tx-2", "tx:1"]

    def test_open_storage_builds_it(self, redis_store: RedisHarness) -> None:
        storage = open_storage(
            "redis", name="bank", url=redis_store.url, targets=["accounts"], schema="other"
        )
        try:
            assert isinstance(storage, RedisStorage)
            assert storage.prefix == "other"
        finally:
            storage.close()


def _restart_and_apply_batch(mongo: MongoHarness) -> Any:
    """A restarted process (a fresh memory) runs ``BATCH`` again: every step is applied
    once, whatever the crash left; returns its storage."""
    restarted = mongo.make(intent_lease_ms=0, shared=SharedState())
    assert restarted.execute(BATCH) == [
        report(tx, StepStatus.APPLIED) for tx in ("tx-1", "tx-2", "tx-3")
    ]
    assert (mongo.raw("accounts", 1) or {})["balance"] == 101
    assert (mongo.raw("accounts", 2) or {})["balance"] == 52
    assert (mongo.raw("orders", "o-1") or {})["qty"] == 4
    return restarted
