"""Isolation (issue 28): the three anomalies of the issue, through real processes, on
PostgreSQL, the MongoDB wire server (FerretDB) and Redis.

Per store, one coordinator (``--unknown-participants accept``) and one participant
``ledger`` on ``accounts`` (a table, a collection, a key prefix) serve every test of
this module; each test uses keys of its own. A saga is kept open by a last step on a
participant ``gate-<test>`` that is not running yet (its ``pass`` action,
:mod:`tests.e2e.gate_handlers`, changes nothing): its ``ledger`` steps are applied and
wait for the decision. Starting the gate lets the saga commit; ``abort`` (the client's
or ``saga abort``) rolls it back, and starting the gate then closes it.

An outside reader (a plain SQL ``SELECT``, a pymongo ``find_one``, a Redis ``HGET``)
checks what anyone reading the store sees. With ``read_committed`` (the default): no
dirty read (the old value while the saga is open, the new one as soon as the client
sees ``committed``), no dirty spend (a bounded debit of money that is only reserved
fails, naming the bound), no lost update (an update of a held record fails, naming the
holder; the holder's rollback leaves the record as it was). With ``none``: the lost
update and the broken bound end as a ``failed`` saga whose step is
``compensation_failed`` with a reason naming the record, and ``saga list`` shows it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymongo
import pytest
import redis
import sqlalchemy as sa

from saga.coordinator import SagaClient
from saga.streams import Isolation, SagaState, SagaStatus, SagaTimeout, Step, StepStatus
from tests._infra import ROOT, Services, eventually, sqlalchemy_url, unique_name
from tests._system import Proc, SagaSystem

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STORES = ["postgresql", "ferretdb", "redis"]
GATE_HANDLERS = "tests.e2e.gate_handlers"
OPEN_S = 120.0
"""Every saga's timeout: far longer than a test, so no deadline decides for it."""


# ---------------------------------------------------------------- the stores


@dataclass
class Store:
    """One store with an ``accounts`` target, and an outside reader of it."""

    kind: str
    storage: str  # --storage of `saga participant run`
    url: str
    schema: str  # --schema: the SQL schema, the Mongo database or the Redis key prefix
    _engine: sa.Engine | None = None
    _mongo: pymongo.MongoClient[dict[str, Any]] | None = None
    _redis: redis.Redis | None = None

    def open(self) -> None:
        if self.kind == "postgresql":
            self._engine = sa.create_engine(sqlalchemy_url(self.url))
            with self._engine.begin() as conn:
                conn.execute(sa.text(f'CREATE SCHEMA "{self.schema}"'))
                conn.execute(
                    sa.text(
                        f'CREATE TABLE "{self.schema}".accounts '
                        "(id text PRIMARY KEY, balance bigint NOT NULL)"
                    )
                )
        elif self.kind == "ferretdb":
            self._mongo = pymongo.MongoClient(self.url, serverSelectionTimeoutMS=10_000)
            self._mongo[self.schema].create_collection("accounts")
        else:
            self._redis = redis.Redis.from_url(self.url, decode_responses=True)

    def close(self) -> None:
        if self._engine is not None:
            with self._engine.begin() as conn:
                conn.execute(sa.text("SET LOCAL lock_timeout = '10s'"))
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
            self._engine.dispose()
        if self._mongo is not None:
            self._mongo.drop_database(self.schema)
            self._mongo.close()
        if self._redis is not None:
            keys = list(self._redis.scan_iter(match=f"{self.schema}:*", count=500))
            if keys:
                self._redis.delete(*keys)
            self._redis.close()

    def seed(self, balances: dict[str, int]) -> None:
        """Create the records ``id -> balance`` behind the product's back (committed data)."""
        if self._engine is not None:
            with self._engine.begin() as conn:
                conn.execute(
                    sa.text(f'INSERT INTO "{self.schema}".accounts VALUES (:i, :b)'),
                    [{"i": i, "b": b} for i, b in balances.items()],
                )
        elif self._mongo is not None:
            self._mongo[self.schema]["accounts"].insert_many(
                [{"_id": i, "balance": b} for i, b in balances.items()]
            )
        else:
            assert self._redis is not None
            for i, b in balances.items():
                self._redis.hset(f"{self.schema}:accounts:{i}", "balance", b)

    def read(self, key: str) -> int | None:
        """What any reader of the store sees: the balance of ``key`` (None: no record)."""
        if self._engine is not None:
            with self._engine.connect() as conn:
                value = conn.execute(
                    sa.text(f'SELECT balance FROM "{self.schema}".accounts WHERE id = :k'),
                    {"k": key},
                ).scalar()
            return None if value is None else int(value)
        if self._mongo is not None:
            doc = self._mongo[self.schema]["accounts"].find_one({"_id": key})
            return None if doc is None or "balance" not in doc else int(doc["balance"])
        assert self._redis is not None
        text = self._redis.hget(f"{self.schema}:accounts:{key}", "balance")
        return None if text is None else int(text)


def make_store(kind: str, services: Services, token: str) -> Store:
    if kind == "postgresql":
        return Store(kind, "sql", services.postgres_url, token)
    if kind == "ferretdb":
        return Store(kind, "mongo", services.mongo_url, token)
    return Store(kind, "redis", services.redis_url, token)


# ---------------------------------------------------------------- the system


@dataclass
class Bank:
    """A running system with ``ledger`` on one store; gates are started by the tests."""

    system: SagaSystem
    store: Store
    gates: list[Proc] = field(default_factory=list)
    ledger: Proc | None = None

    def participant(self, name: str, extra: Sequence[str] = ()) -> Proc:
        s = self.store
        return self.system.start(
            f"participant-{name}",
            [
                "participant", "run", "--name", name, "--storage", s.storage,
                "--url", s.url, "--schema", s.schema, "--targets", "accounts", *extra,
            ],
        )  # fmt: skip

    def open_gate(self, gate: str) -> None:
        """Start the participant that keeps the sagas naming ``gate`` open."""
        self.gates.append(self.participant(gate, ["--handlers", GATE_HANDLERS]))

    def log(self) -> str:
        """The end of the ledger participant's log, for a failure message."""
        lines = self.ledger.log().splitlines()[-15:] if self.ledger is not None else []
        return "".join(f"\n  | {line}" for line in lines)

    def saga_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``saga ARGS`` as an operator runs it, against this system."""
        done = subprocess.run(
            [sys.executable, "-m", "coordinator", *args],
            env=self.system.env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=ROOT,
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done


@pytest.fixture(scope="module", params=STORES)
def bank(
    request: pytest.FixtureRequest, services: Services, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Bank]:
    kind: str = request.param
    token = unique_name("t")
    store = make_store(kind, services, token)
    store.open()
    try:
        system = SagaSystem(services, tmp_path_factory.mktemp(kind), token, partitions=2)
        with system.opened():
            system.coordinator()
            made = Bank(system, store)
            made.ledger = made.participant("ledger")
            yield made
    finally:
        store.close()


@pytest.fixture
def client(bank: Bank) -> Iterator[SagaClient]:
    with bank.system.client() as c:
        yield c


# ---------------------------------------------------------------- steps and waits


def increment(key: str, by: int, low: int | None = None) -> Step:
    args: dict[str, Any] = {"target": "accounts", "key": key, "field": "balance", "by": by}
    if low is not None:
        args["min"] = low
    return Step("ledger", "increment", args)


def update(key: str, balance: int) -> Step:
    return Step("ledger", "update", {"target": "accounts", "key": key, "set": {"balance": balance}})


def open_saga(
    bank: Bank, client: SagaClient, steps: Sequence[Step], gate: str, isolation: Isolation
) -> str:
    """Submit ``steps`` plus a last step on ``gate``; return once ``steps`` are applied."""
    tx = client.submit(
        [*steps, Step(gate, "pass", {})], saga="held", isolation=isolation, timeout=OPEN_S
    )

    def applied() -> SagaStatus | None:
        status = client.status(tx)
        if status is None or len(status.steps) != len(steps) + 1:
            return None
        if status.state is not SagaState.PENDING:
            raise AssertionError(f"{tx} was decided before its gate opened: {status}{bank.log()}")
        done = all(s.status is StepStatus.APPLIED for s in status.steps[: len(steps)])
        return status if done else None

    eventually(
        applied, timeout=60, interval=0.2, message=f"the steps of {tx} were not applied{bank.log()}"
    )
    return tx


def result(bank: Bank, client: SagaClient, tx: str) -> SagaStatus:
    """``tx``'s final status; a failure shows its last status and the ledger's log."""
    try:
        return client.result(tx, timeout=60)
    except SagaTimeout as exc:
        raise AssertionError(f"{exc}: {client.status(tx)}{bank.log()}") from None


def wait_decided(client: SagaClient, tx: str) -> None:
    eventually(
        lambda: (s := client.status(tx)) is not None and s.state is not SagaState.PENDING,
        timeout=60,
        interval=0.2,
        message=f"{tx} got no decision",
    )


def step_reason(bank: Bank, tx: str, step: int, status: StepStatus) -> str:
    """The reason of ``tx``'s step event ``status`` for ``step`` (as its participant wrote it)."""
    found = [e for e in bank.system.events(tx) if e.step == step and e.status is status]
    assert found, f"no {status} event for step {step} of {tx}"
    return found[-1].reason or ""


def listed_failed(bank: Bank) -> dict[str, Any]:
    """``saga list --state failed --json``, by tx_id."""
    done = bank.saga_cli("list", "--state", "failed", "--json")
    assert done.returncode == 0, done.stderr
    return {row["tx_id"]: row for row in json.loads(done.stdout)}


# ---------------------------------------------------------------- read_committed


def test_no_dirty_read_and_read_your_writes(bank: Bank, client: SagaClient) -> None:
    """T1 credits x and updates w, and stays open: readers see the committed values until
    the client sees ``committed``, then the new ones at once."""
    store = bank.store
    store.seed({"dr-x": 0, "dr-w": 1})
    t1 = open_saga(
        bank,
        client,
        [increment("dr-x", 100), update("dr-w", 2)],
        "gate-dr",
        Isolation.READ_COMMITTED,
    )
    assert (store.read("dr-x"), store.read("dr-w")) == (0, 1), "dirty read: T1 is still open"

    bank.open_gate("gate-dr")
    final = result(bank, client, t1)
    assert final.state is SagaState.COMMITTED, final
    # read-your-writes: `committed` means every store shows the change
    assert (store.read("dr-x"), store.read("dr-w")) == (100, 2)


def test_no_dirty_spend(bank: Bank, client: SagaClient) -> None:
    """While T1's credit of x is open, T2's debit of x with min 0 fails naming the bound;
    T1's abort leaves x at 0, never below the bound."""
    store = bank.store
    store.seed({"ds-x": 0, "ds-dst": 0})
    t1 = open_saga(bank, client, [increment("ds-x", 100)], "gate-ds", Isolation.READ_COMMITTED)
    assert store.read("ds-x") == 0, "dirty read: T1 is still open"

    t2 = client.submit(
        [increment("ds-x", -100, low=0), increment("ds-dst", 100)], saga="spend", timeout=OPEN_S
    )
    spent = result(bank, client, t2)
    assert spent.state is SagaState.ROLLED_BACK, f"dirty spend: {spent}"
    assert spent.reason is not None and spent.reason.startswith("step 0 failed"), spent
    assert "ds-x" in spent.reason and re.search(r"\bmin(imum)?\W+0\b", spent.reason), spent.reason
    assert (store.read("ds-x"), store.read("ds-dst")) == (0, 0)

    aborted = bank.saga_cli("abort", t1, "--reason", "test: T1 given up")
    assert aborted.returncode == 0, (aborted.stdout, aborted.stderr)
    bank.open_gate("gate-ds")
    assert result(bank, client, t1).state is SagaState.ROLLED_BACK
    assert (store.read("ds-x"), store.read("ds-dst")) == (0, 0)


def test_no_lost_update(bank: Bank, client: SagaClient) -> None:
    """T3 updates k from 5 to 7 and stays open; T4's update of k fails naming T3; T3's
    abort leaves k at 5, and a retry of T4 then commits."""
    store = bank.store
    store.seed({"lu-k": 5})
    t3 = open_saga(bank, client, [update("lu-k", 7)], "gate-lu", Isolation.READ_COMMITTED)
    assert store.read("lu-k") == 5, "dirty read: T3 is still open"

    t4 = client.submit([update("lu-k", 9)], saga="overwrite", timeout=OPEN_S)
    refused = result(bank, client, t4)
    assert refused.state is SagaState.ROLLED_BACK, f"T4 wrote a record T3 holds: {refused}"
    assert refused.reason is not None and t3 in refused.reason, refused.reason
    assert "lu-k" in refused.reason, refused.reason
    assert store.read("lu-k") == 5

    client.abort(t3, "test: T3 given up")
    wait_decided(client, t3)
    bank.open_gate("gate-lu")
    assert result(bank, client, t3).state is SagaState.ROLLED_BACK
    assert store.read("lu-k") == 5

    # the hold went with T3's decision: the retry the reason asks for now succeeds
    retried = client.submit([update("lu-k", 9)], saga="overwrite", timeout=OPEN_S)
    assert result(bank, client, retried).state is SagaState.COMMITTED
    assert store.read("lu-k") == 9


# ---------------------------------------------------------------- none: never silently


def test_none_lost_update_fails_loudly(bank: Bank, client: SagaClient) -> None:
    """At ``none`` T3's update shows at once and T4's commits over it; T3's abort does not
    restore its before-image over T4's work: T3 ends ``failed``, its step
    ``compensation_failed`` naming the record, listed by ``saga list``."""
    store = bank.store
    store.seed({"nlu-k": 5})
    t3 = open_saga(bank, client, [update("nlu-k", 7)], "gate-nlu", Isolation.NONE)
    assert store.read("nlu-k") == 7  # `none` writes at once: the setup reproduces the issue

    t4 = client.submit([update("nlu-k", 9)], saga="overwrite", isolation="none", timeout=OPEN_S)
    assert result(bank, client, t4).state is SagaState.COMMITTED
    assert store.read("nlu-k") == 9

    aborted = bank.saga_cli("abort", t3, "--reason", "test: T3 given up")
    assert aborted.returncode == 0, (aborted.stdout, aborted.stderr)
    bank.open_gate("gate-nlu")
    final = result(bank, client, t3)
    assert final.state is SagaState.FAILED, f"a lost update went unreported: {final}"
    assert final.steps[0].status is StepStatus.COMPENSATION_FAILED, final
    assert store.read("nlu-k") == 9, "T3's compensation overwrote T4's committed update"
    reason = step_reason(bank, t3, 0, StepStatus.COMPENSATION_FAILED)
    assert "accounts/nlu-k" in reason, reason

    row = eventually(lambda: listed_failed(bank).get(t3), timeout=30, message="not listed")
    assert row is not None and row["steps"][0]["status"] == "compensation_failed", row


def test_none_broken_bound_fails_loudly(bank: Bank, client: SagaClient) -> None:
    """At ``none`` T2 spends T1's uncommitted credit (min 0) and commits; T1's abort does
    not take the credit back below the bound T2 relied on: T1 ends ``failed``, its step
    ``compensation_failed`` naming the record, listed by ``saga list``."""
    store = bank.store
    store.seed({"nbb-x": 0, "nbb-dst": 0})
    t1 = open_saga(bank, client, [increment("nbb-x", 100)], "gate-nbb", Isolation.NONE)
    assert store.read("nbb-x") == 100  # `none` writes at once

    t2 = client.submit(
        [increment("nbb-x", -100, low=0), increment("nbb-dst", 100)],
        saga="spend",
        isolation="none",
        timeout=OPEN_S,
    )
    assert result(bank, client, t2).state is SagaState.COMMITTED
    assert (store.read("nbb-x"), store.read("nbb-dst")) == (0, 100)

    client.abort(t1, "test: T1 given up")
    wait_decided(client, t1)
    bank.open_gate("gate-nbb")
    final = result(bank, client, t1)
    assert final.state is SagaState.FAILED, f"a broken bound went unreported: {final}"
    assert final.steps[0].status is StepStatus.COMPENSATION_FAILED, final
    assert store.read("nbb-x") == 0, "T1's compensation broke the bound T2 relied on"
    reason = step_reason(bank, t1, 0, StepStatus.COMPENSATION_FAILED)
    assert "accounts/nbb-x" in reason, reason

    row = eventually(lambda: listed_failed(bank).get(t1), timeout=30, message="not listed")
    assert row is not None and row["steps"][0]["status"] == "compensation_failed", row


# ---------------------------------------------------------------- the audit


def test_the_audit_of_these_sagas_finds_no_early_effect(bank: Bank, tmp_path: Path) -> None:
    """``saga reconcile`` over this system's log and its store's ledger, as the stores
    really write it (batches and scripts included): no step of a ``read_committed`` saga
    reached its store before its commit (I7), and no other invariant is broken."""
    store = bank.store
    option = {"sql": "schema", "mongo": "database", "redis": "prefix"}[store.storage]
    ledger = f"{store.storage}:$SAGA_TEST_LEDGER_URL#{option}={store.schema}"
    done = subprocess.run(
        [
            sys.executable, "-m", "coordinator", "reconcile", "--ledger", ledger,
            "--out", str(tmp_path / "audit"), "--grace", "2s", "--master", "local[2]",
            "--driver-memory", "1g", "--json",
        ],
        env={**bank.system.env(), "SAGA_TEST_LEDGER_URL": store.url},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["classes"]["early_effect"] == 0, summary
    assert summary["invariants"] == dict.fromkeys(summary["invariants"], 0), summary
    assert summary["classes"]["violation"] == 0, summary
    assert [x["entries"] > 0 for x in summary["ledgers"]] == [True], summary["ledgers"]
