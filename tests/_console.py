"""Helpers of the console's end-to-end tests: a bank system with ``ledger`` and ``shop``,
``saga console`` as a process, and a saga left waiting on a stopped participant.

``ledger`` keeps ``accounts`` and ``shop`` keeps ``orders`` (PostgreSQL, the test's
schema). :func:`stuck_saga` runs ``shop`` once (so it is a participant that exists),
stops it, and submits a saga with a ``ledger`` step and a ``shop`` step: it stays
``pending`` (ledger applied) until its deadline, an hour away. An abort rolls it back;
``shop`` owes a compensation of the step it never applied, which it reports when it
runs again (:func:`shop`).
"""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from saga.streams import SagaState, Step
from tests._infra import Services, eventually
from tests._system import Proc, SagaSystem, bank_schema, engine_for


def debit(amount: int) -> Step:
    return Step(
        "ledger",
        "increment",
        {"target": "accounts", "key": "alice", "field": "balance", "by": -amount, "min": 0},
    )


def order(key: str) -> Step:
    return Step("shop", "insert", {"target": "orders", "key": key, "value": {"item": "book"}})


@contextmanager
def bank_system(
    services: Services, schema: str, tmp: Path, signing: list[str] | None = None
) -> Iterator[SagaSystem]:
    """A system on fresh topics with ``accounts`` (alice: 1000) and ``orders``."""
    engine = engine_for(services)
    try:
        bank_schema(engine, schema)
        with engine.begin() as conn:
            conn.execute(sa.text(f"INSERT INTO \"{schema}\".accounts VALUES ('alice', 1000)"))
    finally:
        engine.dispose()
    made = SagaSystem(services, tmp, schema, partitions=2, signing=signing)
    made.extra_env["SAGA_KAFKA_SESSION_TIMEOUT_MS"] = "6000"
    made.create_topics()
    try:
        yield made
    finally:
        made.stop_all()
        made.delete_topics()


def shop(system: SagaSystem) -> Proc:
    """Start the ``shop`` participant (again)."""
    return system.participant("shop", ["orders"], tag=f"-{len(system.procs)}")


def stuck_saga(system: SagaSystem) -> str:
    """Run the coordinator, ledger and shop; commit one saga, roll one back, stop shop,
    and return the tx_id of a saga left pending on it (ledger applied)."""
    system.coordinator()
    system.participant("ledger", ["accounts"])
    first_shop = shop(system)
    with system.client() as client:
        done = client.submit([debit(10), order("o-warm")], saga="order", timeout=120)
        assert client.result(done, timeout=120).state is SagaState.COMMITTED
        rejected = client.submit([debit(10**6)], saga="transfer", timeout=120)
        assert client.result(rejected, timeout=120).state is SagaState.ROLLED_BACK
        first_shop.kill(signal.SIGTERM)
        stuck = client.submit([debit(25), order("o-stuck")], saga="order", timeout=3600)
        eventually(
            lambda: (
                (s := client.status(stuck)) is not None
                and s.state is SagaState.PENDING
                and s.steps[0].status.value == "applied"
            ),
            timeout=60,
            message="the saga did not wait on the stopped shop",
        )
    return stuck


def start_console(system: SagaSystem, *extra: str) -> tuple[Proc, str]:
    """Start ``saga console`` on a free port; the process and its base URL."""
    proc = system.start(
        "console",
        ["console", "--port", "0", "--db", f"sqlite:///{system.tmp / 'console.db'}", *extra],
    )
    found = eventually(
        lambda: re.search(r"saga console ready: (http://\S+)/", proc.log()) or not proc.alive,
        timeout=60,
        message="saga console did not print its address",
    )
    assert proc.alive and isinstance(found, re.Match), proc.log()
    return proc, found.group(1)


class ConsoleApi:
    """The console's JSON API as its page calls it (with the page's token)."""

    def __init__(self, base: str) -> None:
        self.base = base
        with urllib.request.urlopen(base + "/", timeout=10) as response:
            page = response.read().decode()
        found = re.search(r'name="saga-console-token" content="([^"]+)"', page)
        assert found, page
        self.token = found.group(1)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=30) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            self.base + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Saga-Console-Token": self.token},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def state(self, tx_id: str) -> str | None:
        try:
            return str(self.get(f"/api/sagas/{tx_id}")["saga"]["state"])
        except urllib.error.HTTPError:
            return None
