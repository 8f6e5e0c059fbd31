"""`saga submit --wait` and `saga status` tell the outcome by their exit status, and `--json`
keeps stdout pure JSON, against the real services.

One table for both commands (README "Command line"): 0 committed, 3 rolled back,
4 not final yet (pending, committing, rolling back, a --wait that ended first, no
status yet), 5 failed (an operator must act). The sagas submitted are the shipped
examples (examples/transfer.json, examples/overdraft.json), run by a real coordinator
and a real ``ledger`` participant on PostgreSQL: the examples are checked to work as
the README says, not only to parse.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from saga.streams import SagaState, SagaStatus, StepProgress, StepStatus, encode
from tests._infra import ROOT, Services
from tests._system import SagaSystem, balances, bank_system

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EXAMPLES = ROOT / "examples"


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str


def saga(system: SagaSystem, *args: str, timeout: float = 120) -> Ran:
    """``saga ARGS`` as a shell user runs it, with the system's Kafka address and prefix."""
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        env=system.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return Ran(done.returncode, done.stdout, done.stderr)


def only_json(ran: Ran) -> dict[str, object]:
    """stdout is exactly one JSON object (what `| jq` needs)."""
    try:
        found = json.loads(ran.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON document:\n{ran.stdout}\nstderr:\n{ran.stderr}")
    assert isinstance(found, dict), ran.stdout
    return found


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with bank_system(services, pg_schema, tmp_path, {"alice": 100, "bob": 50}) as s:
        yield s


def test_the_examples_commit_and_roll_back_with_the_documented_exit_status(
    system: SagaSystem,
) -> None:
    system.coordinator()
    system.participant("ledger", ["accounts"])

    committed = saga(system, "submit", str(EXAMPLES / "transfer.json"), "--wait", "--json")
    status = only_json(committed)
    assert status["state"] == "committed", committed
    assert committed.code == 0, committed
    assert balances(system) == {"alice": 70, "bob": 80}
    tx_committed = str(status["tx_id"])

    rejected = saga(system, "submit", str(EXAMPLES / "overdraft.json"), "--wait", "--json")
    status = only_json(rejected)
    assert status["state"] == "rolled_back", rejected
    assert rejected.code == 3, rejected
    assert "below the minimum 0" in str(status["reason"]), status
    assert balances(system) == {"alice": 70, "bob": 80}
    tx_rolled_back = str(status["tx_id"])

    # `saga status` answers with the same exit status as `submit --wait` did.
    for tx_id, state, code in (
        (tx_committed, "committed", 0),
        (tx_rolled_back, "rolled_back", 3),
    ):
        ran = saga(system, "status", tx_id)
        assert only_json(ran)["state"] == state, ran
        assert ran.code == code, ran

    # Without --wait, --json prints {"tx_id": ...} and nothing else.
    sent = saga(system, "submit", str(EXAMPLES / "transfer.json"), "--json")
    assert sent.code == 0, sent
    assert set(only_json(sent)) == {"tx_id"}, sent.stdout
    # Without --json the tx_id line comes first, as before (scripts that read it keep working).
    plain = saga(system, "submit", str(EXAMPLES / "transfer.json"))
    assert plain.code == 0, plain
    assert plain.stdout.strip() and " " not in plain.stdout.strip(), plain.stdout


def _status(tx_id: str, state: SagaState, step: StepStatus) -> SagaStatus:
    now = int(time.time() * 1000)
    return SagaStatus(
        tx_id=tx_id,
        saga="transfer",
        state=state,
        steps=(StepProgress("ledger", step),),
        reason=None if state is SagaState.PENDING else "step 0 could not be compensated",
        created_ms=now,
        updated_ms=now,
        deadline_ms=now + 30_000,
    )


def test_status_exits_4_while_not_final_and_5_when_failed(system: SagaSystem) -> None:
    """No coordinator: the statuses are written as it would write them (unsigned, as a
    system without keys has them), and one saga is never decided."""
    suffix = os.urandom(4).hex()
    cases = (
        ("pending", SagaState.PENDING, StepStatus.APPLIED, 4),
        ("rolling", SagaState.ROLLING_BACK, StepStatus.APPLIED, 4),
        ("failed", SagaState.FAILED, StepStatus.COMPENSATION_FAILED, 5),
    )
    written = {
        f"{name}-{suffix}": (_status(f"{name}-{suffix}", state, step), code)
        for name, state, step, code in cases
    }
    producer = system.producer()
    try:
        for tx_id, (record, _) in written.items():
            producer.produce(system.settings.topics.status, tx_id, encode(record))
        producer.flush()
    finally:
        producer.close()
    for tx_id, (record, code) in written.items():
        ran = saga(system, "status", tx_id)
        assert only_json(ran)["state"] == record.state.value, ran
        assert ran.code == code, (tx_id, ran)

    unknown = saga(system, "status", f"never-{suffix}")
    assert unknown.code == 4, unknown
    assert unknown.stdout == "", unknown
    assert unknown.stderr.startswith(f"saga: no status for transaction never-{suffix}"), unknown

    # No coordinator decides it: the wait ends first (deadline + 30 s), exit 4, one sentence,
    # and stdout, which --json keeps for JSON, stays empty.
    waited = saga(
        system, "submit", str(EXAMPLES / "transfer.json"), "--wait", "--json", "--timeout", "1"
    )
    assert waited.code == 4, waited
    assert waited.stdout == "", waited
    lines = [line for line in waited.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("saga: "), waited.stderr
    assert "still running" in lines[-1], waited.stderr
    assert "check it later with `saga status" in lines[-1], waited.stderr
