"""Re-driven decisions end to end (issue 31, must-hold 4): real Kafka, PostgreSQL, processes.

A real coordinator (``--redrive-after 2s``) and a real SQL participant ``bank`` whose
custom action ``confirm_later`` (:mod:`tests.e2e.redrive_handlers`) fails its confirm
while a flag file exists: the participant fails to act on the commit and gives the
decision up, so the saga stays ``committing``. The coordinator sends the decision again
(a copy marked ``saga.replayed.by``); once the flag is gone a copy is acted on and the
saga ends ``committed``, with no ``saga reconcile`` run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from saga.streams import Decision, SagaState, Step, decode
from tests._infra import Services, eventually
from tests._system import SagaSystem, bank_system

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

HANDLERS = "tests.e2e.redrive_handlers"


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with bank_system(services, pg_schema, tmp_path, {"alice": 100}, partitions=2) as s:
        s.start(
            "coordinator-0",
            ["coordinator", "run", "--instance-id", "0", "--unknown-participants", "accept",
             "--redrive-after", "2s", "--redrive-limit", "10"],
        )  # fmt: skip
        s.participant("bank", ["accounts"], extra=["--handlers", HANDLERS])
        yield s


def decisions(system: SagaSystem, tx: str) -> list[tuple[str, bool]]:
    """(outcome, re-sent by the coordinator) of every decision record of ``tx``."""
    found = []
    for m in system.read_messages(system.settings.topics.decisions):
        record = decode(m.value) if m.value is not None else None
        if isinstance(record, Decision) and record.tx_id == tx:
            found.append((record.outcome.value, m.header("saga.replayed.by") == b"coordinator"))
    return found


def test_a_decision_the_participant_failed_to_act_on_is_redriven_until_the_saga_finishes(
    system: SagaSystem, tmp_path: Path
) -> None:
    flag = tmp_path / "confirm-fails"
    flag.touch()
    with system.client() as client:
        tx = client.submit(
            [Step("bank", "confirm_later", {"flag": str(flag)})], saga="redrive", timeout=120
        )
        eventually(
            lambda: (s := client.status(tx)) is not None and s.state is SagaState.COMMITTING,
            timeout=60,
            message="the saga never reached committing",
        )
        # Given up by the participant, the decision is sent again, and fails again.
        eventually(
            lambda: sum(again for _, again in decisions(system, tx)) >= 1,
            timeout=30,
            interval=0.5,
            message="the coordinator never sent the decision again",
        )
        current = client.status(tx)
        assert current is not None and current.state is SagaState.COMMITTING
        flag.unlink()  # the participant can confirm now: the next copy finishes the saga
        final = client.result(tx, timeout=90)
    assert final.state is SagaState.COMMITTED
    sent = decisions(system, tx)
    assert sent[0] == ("commit", False) and len(sent) >= 2
    assert all(outcome == "commit" and again for outcome, again in sent[1:])
    coordinator_log = next(p for p in system.procs if p.name == "coordinator-0").log()
    assert "Traceback" not in coordinator_log
