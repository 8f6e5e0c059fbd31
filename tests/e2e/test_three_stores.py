"""Sagas across PostgreSQL, the MongoDB wire server and Redis, through real processes.

``ledger`` debits ``accounts`` (PostgreSQL), ``inventory`` takes ``stock``
(MongoDB wire) and ``loyalty`` credits ``points`` (Redis). Money is conserved
across two stores (balance + points) and stock across the log and Mongo.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from saga.streams import SagaState, Step
from tests._infra import Services, eventually
from tests._system import Proc, SagaSystem, engine_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ACCOUNTS = ["alice", "bob", "carol"]
SKUS = ["book", "pen"]
OPENING = 1000
STOCK = 50


class Stores:
    """The three stores of one test, with their opening state."""

    def __init__(self, services: Services, schema: str, mongo_db: Any, redis_url: str) -> None:
        self.services = services
        self.schema = schema
        self.mongo = mongo_db
        self.redis_url = redis_url
        self.prefix = schema  # Redis key prefix and Mongo database share the test's token
        engine = engine_for(services)
        try:
            with engine.begin() as conn:
                conn.execute(
                    sa.text(
                        f'CREATE TABLE "{schema}".accounts (id text PRIMARY KEY, balance bigint)'
                    )
                )
                conn.execute(
                    sa.text(f'INSERT INTO "{schema}".accounts VALUES (:i, :b)'),
                    [{"i": a, "b": OPENING} for a in ACCOUNTS],
                )
        finally:
            engine.dispose()
        self.mongo["stock"].insert_many([{"_id": s, "qty": STOCK} for s in SKUS])
        r = redis.Redis.from_url(redis_url)
        for a in ACCOUNTS:
            r.hset(f"{self.prefix}:points:{a}", "points", 0)
        r.close()

    def balances(self) -> dict[str, int]:
        engine = engine_for(self.services)
        try:
            with engine.connect() as conn:
                rows = conn.execute(sa.text(f'SELECT id, balance FROM "{self.schema}".accounts'))
                return {r[0]: int(r[1]) for r in rows}
        finally:
            engine.dispose()

    def stock(self) -> dict[str, int]:
        return {d["_id"]: int(d["qty"]) for d in self.mongo["stock"].find({})}

    def points(self) -> dict[str, int]:
        r = redis.Redis.from_url(self.redis_url, decode_responses=True)
        try:
            return {a: int(r.hget(f"{self.prefix}:points:{a}", "points") or 0) for a in ACCOUNTS}
        finally:
            r.close()

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        return self.balances(), self.stock(), self.points()


def order(account: str, sku: str, qty: int, amount: int) -> list[Step]:
    return [
        Step(
            "ledger",
            "increment",
            {"target": "accounts", "key": account, "field": "balance", "by": -amount, "min": 0},
        ),
        Step(
            "inventory",
            "increment",
            {"target": "stock", "key": sku, "field": "qty", "by": -qty, "min": 0},
        ),
        Step(
            "loyalty",
            "increment",
            {"target": "points", "key": account, "field": "points", "by": amount},
        ),
    ]


def start(system: SagaSystem, stores: Stores, name: str, redis_url: str | None = None) -> Proc:
    kinds = {
        "ledger": ("sql", system.services.postgres_url, stores.schema, "accounts"),
        "inventory": ("mongo", system.services.mongo_url, stores.mongo.name, "stock"),
        "loyalty": ("redis", redis_url or stores.redis_url, stores.prefix, "points"),
    }
    storage, url, schema, target = kinds[name]
    return system.start(
        f"participant-{name}-{len(system.procs)}",
        [
            "participant",
            "run",
            "--name",
            name,
            "--storage",
            storage,
            "--url",
            url,
            "--schema",
            schema,
            "--targets",
            target,
        ],
    )


@pytest.fixture
def setup(
    services: Services, pg_schema: tuple[str, str], mongo_db: Any, tmp_path: Path
) -> Iterator[tuple[SagaSystem, Stores]]:
    _, schema = pg_schema
    stores = Stores(services, schema, mongo_db, services.redis_url)
    system = SagaSystem(services, tmp_path, schema)
    system.extra_env["SAGA_KAFKA_SESSION_TIMEOUT_MS"] = "6000"
    system.create_topics()
    try:
        yield system, stores
    finally:
        system.stop_all()
        system.delete_topics()
        r = redis.Redis.from_url(services.redis_url)
        keys = list(r.scan_iter(match=f"{stores.prefix}:*", count=500))
        if keys:
            r.delete(*keys)
        r.close()


def test_a_transfer_across_three_stores_commits(setup: tuple[SagaSystem, Stores]) -> None:
    system, stores = setup
    system.coordinator()
    for name in ("ledger", "inventory", "loyalty"):
        start(system, stores, name)
    with system.client() as client:
        tx = client.submit(order("alice", "book", 2, 30), saga="order", timeout=60)
        final = client.result(tx, timeout=90)
    assert final.state is SagaState.COMMITTED, final
    assert stores.balances()["alice"] == OPENING - 30
    assert stores.stock()["book"] == STOCK - 2
    assert stores.points()["alice"] == 30


def test_a_rejected_mongo_step_leaves_postgres_and_redis_as_before(
    setup: tuple[SagaSystem, Stores],
) -> None:
    system, stores = setup
    system.coordinator()
    for name in ("ledger", "inventory", "loyalty"):
        start(system, stores, name)
    before = stores.snapshot()
    with system.client() as client:
        tx = client.submit(order("bob", "pen", STOCK + 1, 40), saga="order", timeout=60)
        final = client.result(tx, timeout=90)
    assert final.state is SagaState.ROLLED_BACK, final
    assert final.reason is not None and final.reason.startswith("step 1 failed")
    assert stores.snapshot() == before


def _load(system: SagaSystem, n: int, seed: int) -> dict[str, tuple[int, int, str, str]]:
    """Submit ``n`` orders (about a fifth out of stock); tx_id -> (qty, amount, acct, sku)."""
    rng = random.Random(seed)
    sent: dict[str, tuple[int, int, str, str]] = {}
    with system.client() as client:
        for _ in range(n):
            account, sku = rng.choice(ACCOUNTS), rng.choice(SKUS)
            qty = STOCK * 10 if rng.random() < 0.2 else 1
            amount = rng.randint(1, 5)
            request = client.build(order(account, sku, qty, amount), saga="order", timeout=120)
            client.send(request, wait_delivery=False)
            sent[request.tx_id] = (qty, amount, account, sku)
        client.flush()
    return sent


def _check_once_and_conserved(
    system: SagaSystem, stores: Stores, sent: dict[str, tuple[int, int, str, str]]
) -> None:
    with system.client() as client:
        finals = eventually(
            lambda: (
                (s if all((x := s.get(tx)) is not None and x.state.final for tx in sent) else None)
                if (s := client.statuses())
                else None
            ),
            timeout=180,
            interval=0.5,
            message="not every saga finished after the restart",
        )
    committed = [tx for tx in sent if finals[tx].state is SagaState.COMMITTED]
    assert all(finals[tx].state in (SagaState.COMMITTED, SagaState.ROLLED_BACK) for tx in sent)
    balances, stock, points = stores.snapshot()
    spent = {a: 0 for a in ACCOUNTS}
    taken = {s: 0 for s in SKUS}
    for tx in committed:
        qty, amount, account, sku = sent[tx]
        spent[account] += amount
        taken[sku] += qty
    # each committed step took effect exactly once, every rolled-back one not at all
    assert balances == {a: OPENING - spent[a] for a in ACCOUNTS}
    assert points == spent
    assert stock == {s: STOCK - taken[s] for s in SKUS}


@pytest.mark.parametrize("victim", ["inventory", "loyalty"])
def test_kill_9_of_a_participant_mid_load(setup: tuple[SagaSystem, Stores], victim: str) -> None:
    """The Mongo or Redis participant dies mid-load; after a restart every saga finishes once."""
    system, stores = setup
    system.coordinator()
    procs = {name: start(system, stores, name) for name in ("ledger", "inventory", "loyalty")}
    sent = _load(system, 150, seed=11)
    # kill once the victim has reported some, but not all, of its steps
    eventually(
        lambda: sum(1 for e in system.step_events() if e.participant == victim) >= 20,
        timeout=120,
        message=f"{victim} reported nothing",
    )
    procs[victim].kill()
    time.sleep(1)
    start(system, stores, victim)
    _check_once_and_conserved(system, stores, sent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_redis_kill_9_after_applied_loses_nothing(
    setup: tuple[SagaSystem, Stores], tmp_path: Path
) -> None:
    """A private redis-server with AOF: kill -9 after steps were reported; nothing is lost."""
    server = shutil.which("redis-server")
    assert server is not None, "redis-server is not installed (make infra-up installs it)"
    system, stores = setup
    port = _free_port()
    data = tmp_path / "redis"
    data.mkdir()
    args = [
        server,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(data),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
    ]

    def run_redis() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        eventually(lambda: _pings(port), timeout=20, message="the private redis did not start")
        return proc

    url = f"redis://127.0.0.1:{port}/0"
    own = run_redis()
    try:
        r = redis.Redis.from_url(url)
        for a in ACCOUNTS:
            r.hset(f"{stores.prefix}:points:{a}", "points", 0)
        r.close()
        local = Stores.__new__(Stores)
        local.__dict__.update(stores.__dict__, redis_url=url)
        system.coordinator()
        start(system, stores, "ledger")
        start(system, stores, "inventory")
        loyalty = start(system, local, "loyalty", redis_url=url)
        sent = _load(system, 60, seed=5)
        with system.client() as client:
            eventually(
                lambda: all((s := client.status(tx)) is not None and s.state.final for tx in sent),
                timeout=120,
                interval=0.5,
                message="the sagas did not finish",
            )
        before = local.points()
        assert sum(before.values()) > 0
        own.kill()  # SIGKILL: no shutdown, no final fsync
        own.wait(10)
        loyalty.kill()
        own = run_redis()
        assert local.points() == before, "an acknowledged step was lost"
        start(system, local, "loyalty", redis_url=url)
        _check_once_and_conserved(system, local, sent)
    finally:
        own.kill()
        own.wait(10)


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False
