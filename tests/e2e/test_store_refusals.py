"""What PostgreSQL refuses belongs to one step, never to the participant (issue 31, item 2).

Real processes on the real services. ``bank`` (built-in actions on ``accounts``) runs
with a ``statement_timeout`` and a ``lock_timeout`` in its storage URL; ``audit`` runs a
custom handler whose statement the database refuses. A trigger on ``accounts`` raises
``account frozen`` for one account and sleeps past the statement timeout for another,
and a test connection holds a third account's row lock. Each of those fails (or, for
timeouts, runs again and then fails) only its own step, whose saga rolls back with
the store's words as its reason; a commit the store refuses is retried, then parked
and reported (the step ``compensation_failed``, the saga left ``committing`` for an
operator, a metric counting it). Valid sagas sent after them commit, no participant
exits, and participants restarted over the same records (their consumer groups
deleted, so they read every record again) do not exit either.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient

from saga.coordinator import SagaClient
from saga.streams import Isolation, SagaState, Step, StepEvent, StepStatus
from tests._infra import Services, eventually
from tests._system import Proc, SagaSystem, balances, bank_system, engine_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ACCOUNTS = {"alice": 1000, "bob": 1000, "frozen": 100, "slow": 100, "locked": 100}
STATEMENT_TIMEOUT_MS = 1000
LOCK_TIMEOUT_MS = 500
SAGA = str(Path(sys.executable).parent / "saga")


def with_timeouts(url: str) -> str:
    """The storage URL with the session's statement and lock timeouts (libpq options)."""
    options = f"-c statement_timeout={STATEMENT_TIMEOUT_MS} -c lock_timeout={LOCK_TIMEOUT_MS}"
    return f"{url}{'&' if '?' in url else '?'}options={quote(options)}"


def install_guard(system: SagaSystem) -> None:
    """A business rule kept in the database: ``frozen`` cannot change; ``slow`` takes 3 s."""
    schema = system.schema
    engine = engine_for(system.services)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    f'CREATE FUNCTION "{schema}".guard() RETURNS trigger LANGUAGE plpgsql AS $$ '
                    "BEGIN "
                    "IF NEW.id = 'frozen' THEN RAISE EXCEPTION 'account frozen'; END IF; "
                    "IF NEW.id = 'slow' THEN PERFORM pg_sleep(3); END IF; "
                    "RETURN NEW; "
                    "END $$"
                )
            )
            conn.execute(
                sa.text(
                    f'CREATE TRIGGER guard BEFORE INSERT OR UPDATE ON "{schema}".accounts '
                    f'FOR EACH ROW EXECUTE FUNCTION "{schema}".guard()'
                )
            )
    finally:
        engine.dispose()


@contextmanager
def row_locked(system: SagaSystem, key: str) -> Iterator[None]:
    """Another connection holds ``accounts/<key>``'s row lock until the block ends."""
    engine = engine_for(system.services)
    try:
        with engine.connect() as conn, conn.begin():
            conn.execute(
                sa.text(f'SELECT id FROM "{system.schema}".accounts WHERE id = :k FOR UPDATE'),
                {"k": key},
            )
            yield
    finally:
        engine.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_participants(system: SagaSystem, tag: str) -> tuple[Proc, Proc, int]:
    """``bank`` (built-in actions, with the timeouts, serving metrics) and ``audit`` (the
    custom handler); the port of ``bank``'s metrics."""
    port = free_port()
    common = ["participant", "run", "--storage", "sql", "--schema", system.schema]
    bank = system.start(
        f"participant-bank{tag}",
        [
            *common,
            "--name", "bank", "--url", with_timeouts(system.services.postgres_url),
            "--targets", "accounts", "--metrics-port", str(port),
        ],
    )  # fmt: skip
    audit = system.start(
        f"participant-audit{tag}",
        [
            *common,
            "--name", "audit", "--url", system.services.postgres_url,
            "--targets", "orders", "--handlers", "tests.e2e.driver_error_handlers",
        ],
    )  # fmt: skip
    return bank, audit, port


def parked_count(port: int) -> float:
    """``saga_participant_decisions_parked_total`` as the participant serves it (-1: not up)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return -1
    found = re.search(r"^saga_participant_decisions_parked_total\{[^}]*\} (\S+)$", text, re.M)
    return float(found.group(1)) if found else -1


def increment(key: str, by: int) -> Step:
    return Step(
        "bank", "increment", {"target": "accounts", "key": key, "field": "balance", "by": by}
    )


def transfer(amount: int) -> list[Step]:
    return [increment("alice", -amount), increment("bob", amount)]


def reason_of(client: SagaClient, tx_id: str) -> str:
    final = client.result(tx_id, timeout=180)
    assert final.state is SagaState.ROLLED_BACK, final
    assert final.reason is not None
    return final.reason


def assert_alive(*procs: Proc) -> None:
    for proc in procs:
        assert proc.alive, f"{proc.name} exited:\n{proc.log()[-3000:]}"


def delete_group(system: SagaSystem, name: str) -> None:
    """Forget the participant's consumed offsets: restarted, it reads every record again."""
    group = f"{system.prefix}.participant.{name}"
    admin = AdminClient({"bootstrap.servers": system.services.kafka_bootstrap})

    def deleted() -> bool:
        try:
            admin.delete_consumer_groups([group], request_timeout=10)[group].result(timeout=15)
        except Exception:  # still has members for a moment after the process left
            return False
        return True

    eventually(deleted, timeout=60, message=f"consumer group {group} could not be deleted")


def test_store_refusals_fail_their_own_step_and_no_participant_exits(
    services: Services, pg_schema: tuple[str, str], tmp_path: Path
) -> None:
    with bank_system(services, pg_schema, tmp_path, ACCOUNTS, partitions=2) as system:
        install_guard(system)
        system.coordinator()
        bank, audit, port = start_participants(system, "")
        none = Isolation.NONE
        with system.client() as client:
            # A trigger's RAISE EXCEPTION at apply: at level none (the increment writes),
            # and at read_committed (an update's trial write runs the trigger).
            frozen = client.submit([increment("frozen", 1)], isolation=none, timeout=180)
            update = {"target": "accounts", "key": "frozen", "set": {"balance": 5}}
            frozen_update = client.submit([Step("bank", "update", update)], timeout=180)
            # A statement timeout: the trigger sleeps 3 s, the session allows 1 s.
            slow = client.submit([increment("slow", 1)], isolation=none, timeout=180)
            # A driver error raised inside a custom handler.
            audited = client.submit([Step("audit", "audit", {})], timeout=180)
            # Both must be refused by the trigger before the next saga reserves on the
            # same row: requests on two partitions reach the participant in either order, and
            # the parked saga below holds the row until an operator acts.
            frozen_reason = reason_of(client, frozen)
            frozen_update_reason = reason_of(client, frozen_update)
            # A commit the store refuses: the reservation passes, the trigger refuses the write.
            parked = client.submit([increment("frozen", 1)], timeout=180)
            # A lock timeout: another connection holds the row while the step runs.
            with row_locked(system, "locked"):
                locked = client.submit([increment("locked", 1)], timeout=180)
                locked_reason = reason_of(client, locked)

            refused = "PostgreSQL refused the {} of accounts/frozen: account frozen (P0001)"
            assert frozen_reason == "step 0 failed: " + refused.format("increment")
            assert frozen_update_reason == "step 0 failed: " + refused.format("update")
            assert reason_of(client, slow).startswith(
                "step 0 failed: PostgreSQL timed out on the increment of accounts/slow: "
                "canceling statement due to statement timeout (57014)"
            )
            assert locked_reason.startswith(
                "step 0 failed: PostgreSQL timed out on the increment of accounts/locked: "
                "canceling statement due to lock timeout (55P03)"
            )
            assert reason_of(client, audited) == (
                "step 0 failed: PostgreSQL refused the audit step: relation "
                '"saga_audit_table_that_is_not_there" does not exist (42P01)'
            )

            # The refused commit: parked, reported, visible; the saga waits for an operator.
            def reported() -> bool:
                status = client.status(parked)
                return status is not None and status.steps[0].status is (
                    StepStatus.COMPENSATION_FAILED
                )

            eventually(reported, timeout=120, message="the refused commit was not reported")
            status = client.status(parked)
            assert status is not None and status.state is SagaState.COMMITTING, status
            [event] = [
                e
                for e in system.events(parked)
                if isinstance(e, StepEvent) and e.status is StepStatus.COMPENSATION_FAILED
            ][:1]
            assert event.reason == (
                "commit refused, left applied for a re-driven decision: "
                + refused.format("commit of the increment")
            )
            listed = subprocess.run(
                [SAGA, "list", "--json", "--participant", "bank"],
                env=system.env(), capture_output=True, text=True, timeout=120, check=True,
            )  # fmt: skip
            [row] = [r for r in json.loads(listed.stdout) if r["tx_id"] == parked]
            assert row["state"] == "committing"
            assert "compensation_failed" in json.dumps(row["steps"])
            eventually(lambda: parked_count(port) >= 1, timeout=30, message="no parked metric")

            # Valid sagas sent after them commit, at both levels.
            valid = [client.submit(transfer(n), timeout=180) for n in (1, 2, 3)]
            valid += [client.submit(transfer(n), isolation=none, timeout=180) for n in (4, 5)]
            for tx in valid:
                assert client.result(tx, timeout=180).state is SagaState.COMMITTED, tx
            assert_alive(bank, audit)
            assert balances(system) == {**ACCOUNTS, "alice": 1000 - 15, "bob": 1000 + 15}

            # Restarted over the same records: every record is read again.
            for proc in (bank, audit):
                proc.kill(signal.SIGTERM)
            for name in ("bank", "audit"):
                delete_group(system, name)
            bank, audit, port = start_participants(system, "-again")
            # The parked commit is tried (and refused) again: the records were read again.
            eventually(
                lambda: parked_count(port) >= 1,
                timeout=120,
                message="the restarted participant did not read the parked commit again",
            )
            after = client.submit(transfer(10), timeout=180)
            assert client.result(after, timeout=180).state is SagaState.COMMITTED
            again = client.submit([Step("audit", "audit", {})], timeout=180)
            assert "(42P01)" in reason_of(client, again)
            time.sleep(2)  # a last look: nothing exits after the work is done
            assert_alive(bank, audit)
        assert balances(system) == {**ACCOUNTS, "alice": 1000 - 25, "bob": 1000 + 25}
