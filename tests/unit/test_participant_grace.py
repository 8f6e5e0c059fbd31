"""Requests wait for their participants (issue 29, item 1), on the in-memory log.

With the registry policy (``unknown_participants="reject"``), a request naming a
participant that has not announced itself yet waits for it up to the coordinator's
grace (``participant_grace_ms``, never past the saga's deadline), then rolls back with
the unknown-participant reason; a participant that announces itself meanwhile is
acted on as usual. A static list knows its names at once. The client says at submit
time when a name was never announced, with the nearest announced one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from saga.coordinator import SagaClient
from saga.coordinator._hints import hints_for
from saga.coordinator._service import CoordinatorService
from saga.streams import (
    Decision,
    KafkaSettings,
    Mode,
    Outcome,
    ParticipantAnnouncement,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepStatus,
    StorageKind,
    decode_as,
    encode,
)
from saga.streams.testing import InMemoryLog, ManualClock, Stepper, key_on
from tests._helpers import memory_log

pytestmark = pytest.mark.unit

PARTITIONS = 2
SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="g")
TOPICS = SETTINGS.topics
GRACE_MS = 10_000


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    return memory_log(SETTINGS, clock, PARTITIONS)


@pytest.fixture
def start(log: InMemoryLog, clock: ManualClock) -> Iterator[Any]:
    steppers: list[Stepper] = []

    def started(**options: Any) -> tuple[CoordinatorService, Stepper]:
        options.setdefault("unknown_participants", "reject")
        options.setdefault("participant_grace_ms", GRACE_MS)
        service = CoordinatorService(SETTINGS, instance_id="a", clock=clock, log=log, **options)
        stepper = Stepper(log, service.run, stop=service.stop)
        steppers.append(stepper)
        return service, stepper.start()

    yield started
    for stepper in steppers:
        if stepper.running:
            stepper.stop()


def announce(log: InMemoryLog, clock: ManualClock, name: str) -> None:
    record = ParticipantAnnouncement(
        name=name,
        storage=StorageKind.SQL,
        targets=("accounts",),
        version="0.1.0",
        instance="i1",
        started_ms=clock(),
        heartbeat_ms=clock(),
        interval_ms=1_000,
        host="test",
    )
    with log.producer() as producer:
        producer.produce(TOPICS.participants, record.key, encode(record))


def submit(
    log: InMemoryLog,
    clock: ManualClock,
    tx: str,
    *names: str,
    timeout_ms: int = 60_000,
    mode: Mode = Mode.PARALLEL,
) -> None:
    request = SagaRequest(
        tx_id=tx,
        saga="transfer",
        mode=mode,
        steps=tuple(
            Step(n, "increment", {"target": "accounts", "key": "a", "field": "n", "by": 1})
            for n in names
        ),
        deadline_ms=clock() + timeout_ms,
        created_ms=clock(),
    )
    with log.producer() as producer:
        producer.produce(TOPICS.requests, tx, encode(request))


def report(
    log: InMemoryLog, clock: ManualClock, tx: str, step: int, name: str, status: str
) -> None:
    event = StepEvent(
        tx, step, name, StepStatus(status), clock(), "no" if status == "failed" else None
    )
    with log.producer() as producer:
        producer.produce(TOPICS.events, tx, encode(event))


def status(log: InMemoryLog, tx: str) -> SagaStatus:
    found = [decode_as(m.value, SagaStatus) for m in log.records(TOPICS.status) if m.value]
    return [s for s in found if isinstance(s, SagaStatus) and s.tx_id == tx][-1]


def decisions(log: InMemoryLog, tx: str) -> list[Decision]:
    found = [decode_as(m.value, Decision) for m in log.records(TOPICS.decisions)]
    return [d for d in found if isinstance(d, Decision) and d.tx_id == tx]


# ---------------------------------------------------------------- the coordinator


def test_a_participant_that_announces_itself_within_the_grace_is_waited_for(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    """Processes start in no particular order: the request comes first."""
    _, stepper = start()
    tx = key_on(0, PARTITIONS)
    submit(log, clock, tx, "ledger")
    stepper.step()
    assert decisions(log, tx) == [] and status(log, tx).state is SagaState.PENDING
    clock.advance(GRACE_MS - 1_000)
    announce(log, clock, "ledger")
    report(log, clock, tx, 0, "ledger", "applied")
    stepper.step()
    clock.advance(5_000)  # past the end of the grace: the participant exists now
    stepper.step(2)
    assert [d.outcome for d in decisions(log, tx)] == [Outcome.COMMIT]
    assert status(log, tx).state is SagaState.COMMITTED


@pytest.mark.parametrize("mode", [Mode.PARALLEL, Mode.SEQUENTIAL])
def test_a_participant_that_never_comes_rolls_the_saga_back_when_the_grace_ends(
    log: InMemoryLog, clock: ManualClock, start: Any, mode: Mode
) -> None:
    announce(log, clock, "bank")
    _, stepper = start()
    tx = key_on(1, PARTITIONS)
    submit(log, clock, tx, "bank", "ledgr", mode=mode)
    stepper.step()
    clock.advance(GRACE_MS - 1)
    stepper.step()
    assert decisions(log, tx) == []
    clock.advance(1)
    stepper.step()
    (decision,) = decisions(log, tx)
    assert decision.outcome is Outcome.ROLLBACK
    assert decision.reason.startswith("unknown participant 'ledgr': no participant of that name")
    assert decision.reason.endswith("names unknown participant(s): ledgr")  # the audit's suffix
    assert [s.status for s in status(log, tx).steps] == [
        StepStatus.PENDING,  # bank still owes its compensation
        StepStatus.COMPENSATED,
    ]
    events = [decode_as(m.value, StepEvent) for m in log.records(TOPICS.events)]
    reported = [(e.step, e.status) for e in events if isinstance(e, StepEvent) and e.tx_id == tx]
    # sequential: bank compensates once step 1 is reported compensated, by the coordinator
    assert reported == ([] if mode is Mode.PARALLEL else [(1, StepStatus.COMPENSATED)])


def test_the_grace_never_goes_past_the_deadline(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    _, stepper = start()
    tx = key_on(0, PARTITIONS)
    submit(log, clock, tx, "ledgr", timeout_ms=3_000)
    stepper.step()
    clock.advance(3_000)
    stepper.step()
    (decision,) = decisions(log, tx)
    assert "unknown participant 'ledgr'" in decision.reason  # not "deadline passed"
    assert status(log, tx).state is SagaState.ROLLED_BACK


def test_a_static_list_or_no_grace_decides_at_once(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    _, static = start(participants=frozenset({"bank"}), unknown_participants="accept")
    tx = key_on(0, PARTITIONS)
    submit(log, clock, tx, "bank", "ledgr")
    static.step()
    assert [d.outcome for d in decisions(log, tx)] == [Outcome.ROLLBACK]
    static.stop()
    _, at_once = start(participant_grace_ms=0)
    other = key_on(1, PARTITIONS)
    submit(log, clock, other, "ledgr")
    at_once.step(2)
    assert [d.outcome for d in decisions(log, other)] == [Outcome.ROLLBACK]


def test_a_saga_rolled_back_meanwhile_is_not_left_waiting_for_a_step_that_never_comes(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    announce(log, clock, "bank")
    _, stepper = start()
    tx = key_on(0, PARTITIONS)
    submit(log, clock, tx, "bank", "ledgr")
    report(log, clock, tx, 0, "bank", "failed")
    stepper.step()
    assert status(log, tx).state is SagaState.ROLLING_BACK
    report(log, clock, tx, 0, "bank", "compensated")  # the failed step closes
    stepper.step()
    assert status(log, tx).state is SagaState.ROLLING_BACK  # waits for step 1 ...
    clock.advance(GRACE_MS)
    stepper.step()  # ... whose participant never came: it owes nothing
    assert [s.status for s in status(log, tx).steps] == [StepStatus.COMPENSATED] * 2
    assert status(log, tx).state is SagaState.ROLLED_BACK
    assert "step 0 failed" in (status(log, tx).reason or "")
    assert len(decisions(log, tx)) == 1


def test_a_restarted_coordinator_gives_the_grace_again_and_an_abort_does_not_lose_it(
    log: InMemoryLog, clock: ManualClock, start: Any
) -> None:
    _, stepper = start()
    tx = key_on(1, PARTITIONS)
    submit(log, clock, tx, "ledgr")
    stepper.step()
    stepper.stop()
    clock.advance(GRACE_MS - 1_000)
    restarted, stepper = start()
    stepper.step()
    clock.advance(GRACE_MS - 1)  # the grace counts from the restart
    stepper.step()
    assert decisions(log, tx) == []
    clock.advance(1)
    log.fail_next_commit()
    stepper.step()  # the batch that ends the wait aborts: the next one ends it
    assert restarted.stats.aborted_transactions == 1 and decisions(log, tx) == []
    stepper.step()
    assert [d.outcome for d in decisions(log, tx)] == [Outcome.ROLLBACK]


# ---------------------------------------------------------------- the client


def test_the_nearest_announced_name_is_suggested() -> None:
    known = frozenset({"ledger", "bank", "wallet"})
    assert hints_for(["ledgr", "bank"], known, "s.participants") == [
        ("ledgr", "participant 'ledgr' has never announced itself on s.participants; "
                  "did you mean 'ledger'?"),
    ]  # fmt: skip
    ((name, far),) = hints_for(["zzz"], known, "s.participants")
    assert name == "zzz" and "did you mean" not in far and "rolls the saga back" in far


def test_the_client_warns_once_per_name_never_announced_and_sends_all_the_same(
    log: InMemoryLog, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    announce(log, clock, "ledger")
    with SagaClient(SETTINGS, log=log) as client:
        step = Step("ledgr", "increment", {"target": "accounts", "key": "a", "field": "n", "by": 1})
        assert client.unannounced([step]) == [
            f"participant 'ledgr' has never announced itself on {TOPICS.participants}; "
            "did you mean 'ledger'?"
        ]
        assert client.unannounced([Step("ledger", step.action, step.args)]) == []
        with caplog.at_level(logging.WARNING, logger="saga.client"):
            first = client.submit([step], saga="typo")
            client.submit([step], saga="typo")
    warned = [r.getMessage() for r in caplog.records if "did you mean 'ledger'?" in r.getMessage()]
    assert len(warned) == 1
    sent = [decode_as(m.value, SagaRequest) for m in log.records(TOPICS.requests)]
    assert first in [r.tx_id for r in sent if isinstance(r, SagaRequest)] and len(sent) == 2
