"""Requests wait for their participants, end to end (issue 29, must-hold 1).

Real processes on the real services, the coordinator on its defaults (the participant
registry, a 30 s grace), as a deploy script, ``docker compose up`` or a Kubernetes
rollout starts them: the coordinator and the SQL participant ``bank`` are started,
and sagas are submitted in the first second, before ``bank`` has announced itself;
every one commits once it is up. A saga naming ``ledgr``, a participant that never
comes, rolls back when the grace ends (``--participant-grace 4s`` there), with the
reason naming it; and ``saga submit`` of a step naming ``bnak`` says on standard
error "did you mean 'bank'?", and sends it all the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from saga.streams import SagaRequest, SagaState, Step, decode
from tests._infra import Services
from tests._system import SagaSystem, balances, bank_system

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

START = 1_000


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with bank_system(services, pg_schema, tmp_path, {"alice": START}, partitions=2) as s:
        yield s


def debit(by: int) -> Step:
    return Step("bank", "increment", {"target": "accounts", "key": "alice", "field": "balance",
                                      "by": -by, "min": 0})  # fmt: skip


def test_sagas_sent_before_their_participant_is_up_commit_once_it_is(system: SagaSystem) -> None:
    started = time.monotonic()
    system.coordinator(unknown_participants="reject")  # `saga coordinator run`'s defaults
    system.participant("bank", ["accounts"], extra=["--heartbeat", "1s"])
    with system.client() as client:
        txs = [client.submit([debit(i)], saga="early", timeout=120) for i in range(1, 11)]
        sent_s = time.monotonic() - started
        finals = [client.result(tx, timeout=120) for tx in txs]
    assert sent_s < 3, f"the sagas were sent {sent_s:.1f} s after the start"
    assert [f.state for f in finals] == [SagaState.COMMITTED] * len(txs), finals
    assert balances(system) == {"alice": START - sum(range(1, 11))}
    # They really came first: every request is older than bank's first announcement.
    announced = min(
        m.timestamp_ms or 0 for m in system.read_messages(system.settings.topics.participants)
    )
    created = [
        r.created_ms
        for m in system.read_messages(system.settings.topics.requests)
        if isinstance(r := decode(m.value or b""), SagaRequest)
    ]
    assert len(created) == len(txs) and max(created) < announced


def test_a_participant_that_never_comes_rolls_back_after_the_grace_and_a_typo_gets_a_hint(
    system: SagaSystem, tmp_path: Path
) -> None:
    grace_s = 4
    system.coordinator(unknown_participants="reject", extra=["--participant-grace", f"{grace_s}s"])
    system.participant("bank", ["accounts"], extra=["--heartbeat", "1s"])
    system.wait_announced("bank")
    ledgr = Step("ledgr", "put", {"target": "entries", "key": "e-1", "value": {"amount": 10}})
    with system.client() as client:
        tx = client.submit([debit(5), ledgr], saga="waits", timeout=120)
        final = client.result(tx, timeout=60)
    assert final.state is SagaState.ROLLED_BACK, final
    assert final.reason is not None and final.reason.startswith("unknown participant 'ledgr'")
    assert f"announced itself on {system.settings.topics.participants}" in final.reason
    assert final.updated_ms - final.created_ms >= grace_s * 1000, "rolled back before the grace"
    assert balances(system) == {"alice": START}

    submission = tmp_path / "typo.json"
    submission.write_text(json.dumps({"saga": "typo", "timeout_s": 60, "steps": [
        {"participant": "bnak", "action": "increment", "args": debit(1).args}]}))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", "submit", str(submission)],
        env=system.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr  # sent all the same
    assert (
        "saga: warning: participant 'bnak' has never announced itself on "
        f"{system.settings.topics.participants}; did you mean 'bank'?"
    ) in done.stderr, done.stderr
    assert done.stdout.strip()  # its tx_id
