"""A tx_id submitted again with another payload changes nothing, through real processes.

The reproduction: a one-step saga (``bank`` +1 on PostgreSQL) commits; the same
``tx_id`` is then sent with a second step (``rewards`` +5 on Redis). The
coordinator moves the second request to the DLQ; the participants must not act on
it either: ``rewards`` read the first request, which had no step of its own, and
remembered its fingerprint (the seen marker), so the second applies nothing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from saga.coordinator import AsyncSagaClient, SagaClient
from saga.streams import ConflictingRequest, SagaState, Step, encode
from saga.streams.kafka import partition_for
from tests._infra import Services, eventually
from tests._system import SagaSystem, engine_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TX = "conflict-1"


def bank_step(by: int = 1) -> Step:
    return Step(
        "bank", "increment", {"target": "accounts", "key": "alice", "field": "balance", "by": by}
    )


def rewards_step() -> Step:
    return Step(
        "rewards", "increment", {"target": "points", "key": "alice", "field": "points", "by": 5}
    )


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    _, schema = pg_schema
    engine = engine_for(services)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(f'CREATE TABLE "{schema}".accounts (id text PRIMARY KEY, balance bigint)')
            )
            conn.execute(sa.text(f"INSERT INTO \"{schema}\".accounts VALUES ('alice', 100)"))
    finally:
        engine.dispose()
    r = redis.Redis.from_url(services.redis_url)
    r.hset(f"{schema}:points:alice", "points", 0)
    r.close()
    saga = SagaSystem(services, tmp_path, schema)
    saga.create_topics()
    try:
        yield saga
    finally:
        saga.stop_all()
        saga.delete_topics()
        r = redis.Redis.from_url(services.redis_url)
        keys = list(r.scan_iter(match=f"{schema}:*", count=500))
        if keys:
            r.delete(*keys)
        r.close()


def balance(system: SagaSystem) -> int:
    engine = engine_for(system.services)
    try:
        with engine.connect() as conn:
            query = f"SELECT balance FROM \"{system.schema}\".accounts WHERE id = 'alice'"
            return int(conn.execute(sa.text(query)).scalar_one())
    finally:
        engine.dispose()


def redis_state(system: SagaSystem) -> tuple[str | None, dict[str, Any]]:
    """Alice's points and the rewards ledger of TX (field -> entry)."""
    r = redis.Redis.from_url(system.services.redis_url, decode_responses=True)
    try:
        points = r.hget(f"{system.schema}:points:alice", "points")
        ledger = r.hgetall(f"{system.schema}:ledger:rewards:tx:{TX}")
        return points, {name: json.loads(text) for name, text in ledger.items()}
    finally:
        r.close()


def same_partition_as(tx_id: str, partitions: int) -> str:
    """Another tx_id on ``tx_id``'s partition: once it is decided, the participants have
    read every earlier record of that partition."""
    wanted = partition_for(tx_id, partitions)
    return next(
        f"probe-{i}" for i in range(10_000) if partition_for(f"probe-{i}", partitions) == wanted
    )


def test_a_resubmission_with_another_payload_changes_nothing(system: SagaSystem) -> None:
    system.coordinator()
    system.participant("bank", ["accounts"])
    system.start(
        "participant-rewards",
        [
            "participant", "run", "--name", "rewards", "--storage", "redis",
            "--url", system.services.redis_url, "--schema", system.schema,
            "--targets", "points", "--retention", "7d",
        ],
    )  # fmt: skip
    with system.client() as client:
        client.submit([bank_step()], saga="reward", timeout=60, tx_id=TX)
        first = client.result(TX, timeout=90)
        assert first.state is SagaState.COMMITTED, first
        points, ledger = redis_state(system)
        assert points == "0"
        assert set(ledger) == {"seen"}  # rewards read the request: no step of its own

        # The same tx_id with a second step, sent as a raw record (the client library
        # itself refuses a conflicting resubmission).
        conflicting = client.build(
            [bank_step(), rewards_step()], saga="reward", timeout=60, tx_id=TX
        )
        producer = system.producer()
        producer.produce(system.settings.topics.requests, TX, encode(conflicting))
        producer.flush(30)

        # A probe on the same partition: once it commits, both participants have read
        # the conflicting request (records of one partition are handled in order).
        probe = same_partition_as(TX, system.partitions)
        client.submit([bank_step(0), rewards_step()], saga="probe", timeout=60, tx_id=probe)
        assert client.result(probe, timeout=90).state is SagaState.COMMITTED

        points, ledger = redis_state(system)
        assert points == "5"  # the probe's +5 only
        assert set(ledger) == {"seen"}, ledger  # no step entry, so none says applied
        assert not any(entry.get("status") == "applied" for entry in ledger.values())
        assert balance(system) == 101  # the first saga's +1, once
        now = client.status(TX)
        assert now is not None and now.state is SagaState.COMMITTED, now

    # No event and no decision ever came for the conflicting request.
    events = system.events(TX)
    assert {(e.participant, e.step) for e in events} == {("bank", 0)}
    assert [d.outcome.value for d in system.decisions(TX)] == ["commit"]
    status = eventually(lambda: system.read_topic(system.settings.topics.status), timeout=30)
    last = [s for s in status if getattr(s, "tx_id", None) == TX][-1]
    assert last.state is SagaState.COMMITTED


def test_the_client_and_saga_submit_report_a_conflict_within_seconds(
    system: SagaSystem, tmp_path: Path
) -> None:
    system.coordinator()
    system.participant("bank", ["accounts"])
    tx = "conflict-2"
    with system.client() as client:
        client.submit([bank_step()], saga="reward", timeout=60, tx_id=tx)
        assert client.result(tx, timeout=90).state is SagaState.COMMITTED

    # A client that does not read the status history (as `saga submit` does) cannot tell
    # before sending; the coordinator's dead letter for its request tells it after.
    with SagaClient(system.settings, status_from_beginning=False) as late:
        late.submit([bank_step(2)], saga="reward", timeout=60, tx_id=tx)
        started = time.monotonic()
        with pytest.raises(ConflictingRequest, match="different payload"):
            late.result(tx, timeout=60)
        assert time.monotonic() - started < 10

    async def async_conflict() -> None:
        async with AsyncSagaClient(system.settings, status_from_beginning=False) as aclient:
            await aclient.submit([bank_step(4)], saga="reward", timeout=60, tx_id=tx)
            with pytest.raises(ConflictingRequest, match="different payload"):
                await aclient.result(tx, timeout=60)

    started = time.monotonic()
    asyncio.run(async_conflict())
    assert time.monotonic() - started < 15

    submission = tmp_path / "conflict.json"
    submission.write_text(
        json.dumps(
            {
                "tx_id": tx,
                "saga": "reward",
                "timeout_s": 60,
                "steps": [
                    {"participant": "bank", "action": "increment", "args": bank_step(3).args}
                ],
            }
        )
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "submit", str(submission), "--wait"],
        env=system.env(),
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "already submitted with a different payload" in done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 20
    assert balance(system) == 101
