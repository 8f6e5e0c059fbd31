"""Signed records: the coordinator, a participant and the client refuse forgeries (no broker).

Why this module is over 600 lines: one attack per test, each against the
coordinator, a participant and the client on one shared in-memory rig.

The services run on the in-memory log, one poll at a time (:class:`Stepper`), with
keys made in the test's folder: coordinator, client, operator, ``participant-bank``
(a real runtime on SQLite), ``participant-shop`` (whose events the test writes) and
``participant-ledger`` (a participant with no step in the test's sagas).
Each attack of the issue is refused:

* a forged ``applied`` event, unsigned or signed by another participant: the saga
  rolls back as it should and the forgery is in the DLQ with the reason;
* a forged decision: the participant ignores it, the coordinator dead-letters it;
* a forged status: the client does not believe it, and a restarted coordinator
  restores from the real one;
* a stranger's abort (a participant key), or a client's where only operators may
  abort: dead-lettered, the saga unaffected;
* a forged request: dead-lettered, applied by no one;
* a forged neighbour's event in a sequential saga (unsigned, signed by another
  participant, or by a participant for a step that is not its own): the step keeps
  waiting;
* a participant key signs no decision, status or other participant's event anyone
  accepts;
* a lying routing header on a forged record makes the participant skip that record
  only: a forged request leaves no seen marker, and a copy of a genuine decision
  with changed headers is skipped while the genuine one acts.

With keys, the commit and rollback paths still work, and every record on the
topics is signed by the principal allowed to write it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa

from saga.coordinator import AsyncSagaClient, CoordinatorService, SagaClient, StatusView
from saga.participants import ParticipantRuntime, open_storage
from saga.streams import (
    ConflictingRequest,
    Decision,
    Isolation,
    KafkaSettings,
    Keyring,
    Mode,
    Outcome,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    SagaState,
    SagaStatus,
    SagaTimeout,
    SignedLog,
    Step,
    StepEvent,
    StepProgress,
    StepsCommitted,
    StepStatus,
    decode_keyed,
    encode,
)
from saga.streams._routing import PARTS, request_headers
from saga.streams._signing import (
    CLIENT,
    COORDINATOR,
    OPERATOR,
    allowed_signers,
    create_key,
)
from saga.streams.kafka import Message
from saga.streams.log import LogConsumer, LogProducer, LogTransactionalProducer
from saga.streams.testing import InMemoryLog, ManualClock, Stepper, key_on
from tests._helpers import memory_log

pytestmark = pytest.mark.unit

PARTITIONS = 2
SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="sg")
TOPICS = SETTINGS.topics
Record = SagaRequest | SagaAbort | StepEvent | Decision | SagaStatus
PARTICIPANTS = ("participant-bank", "participant-shop", "participant-ledger")


class Keys:
    """Every principal's keyring, from one folder made for the test."""

    def __init__(self, folder: Path) -> None:
        for principal in (COORDINATOR, CLIENT, OPERATOR, *PARTICIPANTS):
            create_key(folder, principal)
        self.folder = folder
        self.coordinator = Keyring.load(folder, COORDINATOR)
        self.client = Keyring.load(folder, CLIENT)
        self.operator = Keyring.load(folder, OPERATOR)
        self.bank = Keyring.load(folder, "participant-bank")
        self.shop = Keyring.load(folder, "participant-shop")
        self.ledger = Keyring.load(folder, "participant-ledger")
        self.verifier = Keyring.load(folder)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path / "keys")


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    return memory_log(SETTINGS, clock, PARTITIONS)


@pytest.fixture
def database(tmp_path: Path) -> str:
    """An SQLite file with ``accounts`` (alice: 100); its URL."""
    url = f"sqlite:///{tmp_path / 'bank.db'}"
    engine = sa.create_engine(url)
    metadata = sa.MetaData()
    accounts = sa.Table(
        "accounts",
        metadata,
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("balance", sa.Integer, nullable=False),
    )
    metadata.create_all(engine)
    with engine.begin() as connection:
        connection.execute(accounts.insert(), [{"id": "alice", "balance": 100}])
    engine.dispose()
    return url


def balance(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            row = connection.execute(
                sa.text("SELECT balance FROM accounts WHERE id = 'alice'")
            ).one()
            return int(row[0])
    finally:
        engine.dispose()


class Running:
    """Services started under steppers; each is stopped at the end of the test."""

    def __init__(self, log: InMemoryLog, clock: ManualClock, keys: Keys, database: str) -> None:
        self.log, self.clock, self.keys, self.database = log, clock, keys, database
        self.steppers: list[Stepper] = []

    def _start(self, run: Any, stop: Any) -> Stepper:
        stepper = Stepper(self.log, run, stop=stop)
        self.steppers.append(stepper)
        return stepper.start()

    def coordinator(
        self, instance: str = "a", *, signed: bool = True, **options: Any
    ) -> tuple[CoordinatorService, Stepper]:
        service = CoordinatorService(
            SETTINGS,
            instance_id=instance,
            clock=self.clock,
            log=self.log,
            keys=self.keys.coordinator if signed else None,
            **options,
        )
        return service, self._start(service.run, service.stop)

    def bank(self) -> tuple[ParticipantRuntime, Stepper]:
        runtime = ParticipantRuntime(
            "bank",
            open_storage("sql", name="bank", url=self.database, targets=["accounts"]),
            SETTINGS,
            log=self.log,
            clock=self.clock,
            event_window_ms=10_000,
            max_backoff_s=0.005,
            keys=self.keys.bank,
        )
        return runtime, self._start(runtime.run, runtime.stop)


@pytest.fixture
def running(log: InMemoryLog, clock: ManualClock, keys: Keys, database: str) -> Iterator[Running]:
    started = Running(log, clock, keys, database)
    yield started
    for stepper in started.steppers:
        if stepper.running:
            stepper.stop()


# ---------------------------------------------------------------- what the others write


def tx_on(partition: int, n: int = 0) -> str:
    return key_on(partition, PARTITIONS, n)


def move(by: int = 5) -> Step:
    return Step(
        "bank", "increment", {"target": "accounts", "key": "alice", "field": "balance", "by": by}
    )


def shop_step() -> Step:
    return Step("shop", "put", {"target": "orders", "key": "o", "value": {"qty": 1}})


def request(
    tx: str, clock: ManualClock, steps: Sequence[Step] = (), mode: Mode = Mode.PARALLEL
) -> SagaRequest:
    # ``none``: a step's effect is in the store once applied, which the tests read to see
    # whether a (forged) record was acted on; read_committed would show it only at commit.
    return SagaRequest(
        tx,
        "transfer",
        mode,
        tuple(steps or (move(), shop_step())),
        clock() + 60_000,
        clock(),
        isolation=Isolation.NONE,
    )


def send(log: InMemoryLog, signer: Keyring | None, topic: str, *records: Record) -> None:
    """Write ``records`` signed by ``signer`` (``None``: unsigned, as an attacker may)."""
    source = SignedLog(log, signer) if signer is not None else log
    with source.producer() as producer:
        for record in records:
            producer.produce(topic, record.tx_id, encode(record))


def event(
    tx: str,
    step: int,
    participant: str,
    status: StepStatus,
    clock: ManualClock,
    *,
    confirm: bool = False,
) -> StepEvent:
    reason = "no" if status == "failed" else None
    return StepEvent(tx, step, participant, status, clock(), reason, confirm)


def decisions(log: InMemoryLog) -> list[tuple[str, Outcome, bool]]:
    """(tx_id, outcome, signed by the coordinator) of every decision."""
    out: list[tuple[str, Outcome, bool]] = []
    for m in log.records(TOPICS.decisions):
        d = decode_keyed(m.key, m.value, Decision)
        assert isinstance(d, Decision)
        out.append((d.tx_id, d.outcome, m.header("saga.kid") is not None))
    return out


def real_decisions(log: InMemoryLog, keys: Keys) -> list[tuple[str, Outcome]]:
    only = frozenset({COORDINATOR})
    out: list[tuple[str, Outcome]] = []
    for m in log.records(TOPICS.decisions):
        if keys.verifier.check(m.topic, m.key, m.value, m.headers, only) is None:
            d = decode_keyed(m.key, m.value, Decision)
            assert isinstance(d, Decision)
            out.append((d.tx_id, d.outcome))
    return out


def real_state(log: InMemoryLog, keys: Keys, tx: str) -> SagaState | None:
    """The latest coordinator-signed status of ``tx``."""
    found: SagaState | None = None
    for m in log.records(TOPICS.status):
        if m.key != tx.encode() or keys.verifier.check(
            m.topic, m.key, m.value, m.headers, frozenset({COORDINATOR})
        ):
            continue
        if m.value is None:
            found = None
            continue
        status = decode_keyed(m.key, m.value, SagaStatus)
        assert isinstance(status, SagaStatus)
        found = status.state
    return found


def dead_letters(log: InMemoryLog) -> list[tuple[str, str]]:
    """(source topic, reason) of every dead letter (which the coordinator signed)."""
    out = []
    for m in log.records(TOPICS.dlq):
        assert m.header("saga.kid") is not None
        out.append(
            (
                (m.header("saga.source.topic") or b"").decode(),
                (m.header("saga.error") or b"").decode(),
            )
        )
    return out


def bank_reported(log: InMemoryLog, tx: str) -> list[tuple[int, StepStatus]]:
    out = []
    for m in log.records(TOPICS.events):
        e = decode_keyed(m.key, m.value, StepEvent)
        assert isinstance(e, StepEvent)
        if e.tx_id == tx and e.participant == "bank":
            out.append((e.step, e.status))
    return out


# ---------------------------------------------------------------- the paths that must still work


def test_with_keys_a_saga_commits_and_every_record_is_signed_by_whom_may_write_it(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running, database: str
) -> None:
    coordinator, c = running.coordinator()
    _, bank = running.bank()
    tx = tx_on(1)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    bank.step()
    c.step()
    assert balance(database) == 105 and real_state(log, keys, tx) is SagaState.PENDING
    # shop's step has something to confirm: the saga is committed once shop confirms it
    applied = event(tx, 1, "shop", StepStatus.APPLIED, clock, confirm=True)
    send(log, keys.shop, TOPICS.events, applied)
    c.step()
    assert real_decisions(log, keys) == [(tx, Outcome.COMMIT)]
    assert real_state(log, keys, tx) is SagaState.COMMITTING
    bank.step(2)
    send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.COMMITTED, clock))
    c.step()
    assert bank_reported(log, tx) == [(0, StepStatus.APPLIED)]  # nothing to confirm
    assert real_state(log, keys, tx) is SagaState.COMMITTED
    assert coordinator.stats.dlq == 0 and coordinator.stats.unauthenticated == 0
    for topic in (TOPICS.requests, TOPICS.events, TOPICS.decisions, TOPICS.status):
        for m in log.records(topic):
            kinds: tuple[type[Record], ...] = (
                SagaRequest,
                SagaAbort,
                StepEvent,
                Decision,
                SagaStatus,
            )
            record = decode_keyed(m.key, m.value, *kinds)
            reason = keys.verifier.check(
                m.topic, m.key, m.value, m.headers, allowed_signers(record)
            )
            assert reason is None, (topic, record)


def test_with_keys_a_failed_step_rolls_back(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running, database: str
) -> None:
    coordinator, c = running.coordinator()
    _, bank = running.bank()
    tx = tx_on(0)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    bank.step()
    send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.FAILED, clock))
    c.step()
    assert real_decisions(log, keys) == [(tx, Outcome.ROLLBACK)]
    bank.step(2)
    assert balance(database) == 100
    send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.COMPENSATED, clock))
    c.step()
    assert real_state(log, keys, tx) is SagaState.ROLLED_BACK
    assert coordinator.stats.dlq == 0


# ---------------------------------------------------------------- forged step events


@pytest.mark.parametrize("forger", ["nobody", "bank"])
def test_a_forged_applied_event_does_not_commit_a_saga_its_participant_rejects(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running, forger: str
) -> None:
    coordinator, c = running.coordinator()
    tx = tx_on(1)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    send(log, keys.bank, TOPICS.events, event(tx, 0, "bank", StepStatus.APPLIED, clock))
    forged = event(tx, 1, "shop", StepStatus.APPLIED, clock)
    send(log, None if forger == "nobody" else keys.bank, TOPICS.events, forged)
    c.step()
    assert decisions(log) == [], "the forged `applied` made the coordinator commit"
    send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.FAILED, clock))
    c.step()
    assert real_decisions(log, keys) == [(tx, Outcome.ROLLBACK)]
    expected = (
        "record is not signed: expected a signature by participant-shop"
        if forger == "nobody"
        else "record is signed by participant-bank, not by participant-shop"
    )
    assert dead_letters(log) == [(TOPICS.events, expected)]
    assert coordinator.stats.unauthenticated == 1


@pytest.mark.parametrize("forger", ["nobody", "bank"])
def test_a_forged_committed_acknowledgement_does_not_finish_a_saga(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running, forger: str
) -> None:
    """A saga.committed names the participant that must have signed it, as a step event."""
    coordinator, c = running.coordinator()
    tx = tx_on(1)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    applied = [
        event(tx, i, p, StepStatus.APPLIED, clock, confirm=True)
        for i, p in ((0, "bank"), (1, "shop"))
    ]
    send(log, keys.bank, TOPICS.events, applied[0])
    send(log, keys.shop, TOPICS.events, applied[1])
    c.step()
    assert real_decisions(log, keys) == [(tx, Outcome.COMMIT)]
    send(log, keys.bank, TOPICS.events, StepsCommitted("bank", clock(), ((tx, 0),)))
    forged = StepsCommitted("shop", clock(), ((tx, 1),))
    send(log, None if forger == "nobody" else keys.bank, TOPICS.events, forged)
    c.step()
    assert real_state(log, keys, tx) is SagaState.COMMITTING, "the forged ack finished the saga"
    expected = (
        "record is not signed: expected a signature by participant-shop"
        if forger == "nobody"
        else "record is signed by participant-bank, not by participant-shop"
    )
    assert dead_letters(log) == [(TOPICS.events, expected)]
    send(log, keys.shop, TOPICS.events, forged)
    c.step()
    assert real_state(log, keys, tx) is SagaState.COMMITTED
    assert coordinator.stats.unauthenticated == 1


# ---------------------------------------------------------------- forged decisions


def test_a_forged_decision_is_ignored_by_the_participant_and_dead_lettered(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running, database: str
) -> None:
    coordinator, c = running.coordinator()
    bank_runtime, bank = running.bank()
    tx = tx_on(0)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    bank.step()
    c.step()
    assert balance(database) == 105
    send(log, None, TOPICS.decisions, Decision(tx, Outcome.ROLLBACK, "forged", clock()))
    send(log, keys.bank, TOPICS.decisions, Decision(tx, Outcome.ROLLBACK, "forged", clock()))
    bank.step(2)
    assert balance(database) == 105, "the participant obeyed a forged rollback"
    assert bank_reported(log, tx) == [(0, StepStatus.APPLIED)]
    assert bank_runtime.stats.unauthenticated == 2
    c.step()
    assert dead_letters(log) == [
        (TOPICS.decisions, "record is not signed: expected a signature by coordinator"),
        (TOPICS.decisions, "record is signed by participant-bank, not by coordinator"),
    ]
    # The real path goes on: shop applied, the coordinator commits (bank has nothing to
    # confirm: its built-in step is left as it is).
    send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.APPLIED, clock))
    c.step()
    bank.step(2)
    assert real_decisions(log, keys) == [(tx, Outcome.COMMIT)]
    assert real_state(log, keys, tx) is SagaState.COMMITTED
    assert bank_reported(log, tx) == [(0, StepStatus.APPLIED)]
    assert balance(database) == 105
    assert coordinator.stats.dlq == 2  # its own decision was not dead-lettered


# ---------------------------------------------------------------- forged requests and aborts


def test_a_forged_request_is_dead_lettered_and_applied_by_no_one(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running, database: str
) -> None:
    _, c = running.coordinator()
    _, bank = running.bank()
    tx = tx_on(1)
    send(log, keys.shop, TOPICS.requests, request(tx, clock))
    bank.step()
    c.step()
    assert balance(database) == 100 and bank_reported(log, tx) == []
    assert real_state(log, keys, tx) is None
    assert dead_letters(log) == [
        (TOPICS.requests, "record is signed by participant-shop, not by client or operator")
    ]


def test_a_strangers_abort_is_dead_lettered_and_the_saga_commits(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running
) -> None:
    _, c = running.coordinator()
    tx = tx_on(0)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    send(log, keys.bank, TOPICS.requests, SagaAbort(tx, "stranger", clock()))
    send(log, None, TOPICS.requests, SagaAbort(tx, "nobody", clock()))
    c.step()
    assert decisions(log) == []
    send(
        log,
        keys.bank,
        TOPICS.events,
        event(tx, 0, "bank", StepStatus.APPLIED, clock),
    )
    send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.APPLIED, clock))
    c.step()
    assert real_decisions(log, keys) == [(tx, Outcome.COMMIT)]
    assert dead_letters(log) == [
        (TOPICS.requests, "record is signed by participant-bank, not by client or operator"),
        (TOPICS.requests, "record is not signed: expected a signature by client or operator"),
    ]


def test_a_forged_abort_cannot_pre_block_a_transaction_id(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running
) -> None:
    """A rollback sent before the request would make the client's saga roll back."""
    _, c = running.coordinator()
    tx = tx_on(1)
    send(log, None, TOPICS.requests, SagaAbort(tx, "pre-block", clock()))
    c.step()
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    c.step()
    assert decisions(log) == []
    assert real_state(log, keys, tx) is SagaState.PENDING


def test_only_operators_abort_when_the_coordinator_says_so(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running
) -> None:
    _, c = running.coordinator(aborters=frozenset({OPERATOR}))
    tx = tx_on(1)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    send(log, keys.client, TOPICS.requests, SagaAbort(tx, "client", clock()))
    c.step()
    assert decisions(log) == []
    assert dead_letters(log) == [
        (TOPICS.requests, "record is signed by client, not by operator"),
    ]
    send(log, keys.operator, TOPICS.requests, SagaAbort(tx, "operator", clock()))
    c.step()
    assert real_decisions(log, keys) == [(tx, Outcome.ROLLBACK)]


def test_only_the_operator_key_resolves_a_failed_compensation(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running
) -> None:
    _, c = running.coordinator()
    tx = tx_on(1)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    send(log, keys.bank, TOPICS.events, event(tx, 0, "bank", StepStatus.APPLIED, clock))
    send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.FAILED, clock))
    c.step()
    send(log, keys.bank, TOPICS.events, event(tx, 0, "bank", StepStatus.COMPENSATION_FAILED, clock))
    send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.COMPENSATED, clock))
    c.step()
    assert real_state(log, keys, tx) is SagaState.FAILED
    for signer in (keys.client, None):
        send(log, signer, TOPICS.requests, SagaResolve(tx, 0, "by hand", "mallory", clock()))
    c.step()
    assert real_state(log, keys, tx) is SagaState.FAILED
    assert dead_letters(log) == [
        (TOPICS.requests, "record is signed by client, not by operator"),
        (TOPICS.requests, "record is not signed: expected a signature by operator"),
    ]
    send(log, keys.operator, TOPICS.requests, SagaResolve(tx, 0, "by hand", "ann", clock()))
    c.step()
    assert real_state(log, keys, tx) is SagaState.ROLLED_BACK


# ---------------------------------------------------------------- forged status


def forged_status(tx: str, state: SagaState, clock: ManualClock) -> SagaStatus:
    return SagaStatus(
        tx,
        "transfer",
        state,
        (StepProgress("bank", StepStatus.APPLIED), StepProgress("shop", StepStatus.APPLIED)),
        None,
        clock(),
        clock(),
        clock() + 60_000,
    )


def forge_tombstone(log: InMemoryLog, tx: str) -> None:
    with log.producer() as producer:
        producer.produce(TOPICS.status, tx, None)


def test_a_restarted_coordinator_restores_from_the_real_status_not_a_forged_one(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running
) -> None:
    _, c = running.coordinator()
    tx = tx_on(0)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    c.step()
    assert real_state(log, keys, tx) is SagaState.PENDING
    send(log, keys.bank, TOPICS.status, forged_status(tx, SagaState.ROLLED_BACK, clock))
    forge_tombstone(log, tx)
    send(log, None, TOPICS.status, forged_status(tx, SagaState.COMMITTED, clock))
    c.step()  # the coordinator reads the status topic too: forged records go to the DLQ
    forged = [reason for topic, reason in dead_letters(log) if topic == TOPICS.status]
    assert len(forged) == 3, forged
    assert all("signed" in reason for reason in forged)
    # ... and its real status is published again on top of them (the topic is compacted)
    assert real_state(log, keys, tx) is SagaState.PENDING
    c.stop()
    restarted, c2 = running.coordinator()
    c2.step()
    assert restarted.stats.restored == 1 and restarted.stats.forged_status == 0


def test_a_restore_skips_forged_status_records_it_finds_on_top(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running
) -> None:
    _, c = running.coordinator()
    tx = tx_on(0)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    c.step()
    c.kill()  # gone before it could read what follows
    send(log, keys.bank, TOPICS.status, forged_status(tx, SagaState.ROLLED_BACK, clock))
    forge_tombstone(log, tx)
    send(log, None, TOPICS.status, forged_status(tx, SagaState.COMMITTED, clock))
    restarted, c2 = running.coordinator()
    c2.step()
    assert restarted.stats.restored == 1 and restarted.stats.forged_status == 3
    send(log, keys.bank, TOPICS.events, event(tx, 0, "bank", StepStatus.APPLIED, clock))
    send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.APPLIED, clock))
    c2.step()
    assert real_decisions(log, keys) == [(tx, Outcome.COMMIT)]
    assert real_state(log, keys, tx) is SagaState.COMMITTED


def test_a_restore_believes_the_coordinators_tombstone(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running
) -> None:
    _, c = running.coordinator()
    tx = tx_on(1)
    send(log, keys.client, TOPICS.requests, request(tx, clock))
    c.step()
    with SignedLog(log, keys.coordinator).producer() as producer:
        producer.produce(TOPICS.status, tx, None)
    c.stop()
    restarted, c2 = running.coordinator()
    c2.step()
    assert restarted.stats.restored == 0 and restarted.stats.forged_status == 0


class ClientLog:
    """The in-memory log for a client, whose status reader waits a little when idle.

    (An in-memory poll never waits: the reader thread would spin.)
    """

    def __init__(self, log: InMemoryLog) -> None:
        self._log = log

    @property
    def settings(self) -> KafkaSettings:
        return self._log.settings

    def consumer(self, group_id: str | None = None, **options: Any) -> LogConsumer:
        return cast(LogConsumer, _Idle(self._log.consumer(group_id, **options)))

    def producer(self, *, client_id: str = "saga") -> LogProducer:
        return self._log.producer(client_id=client_id)

    def transactional_producer(
        self,
        transactional_id: str,
        *,
        client_id: str = "saga",
        transaction_timeout_ms: int = 60_000,
    ) -> LogTransactionalProducer:
        raise NotImplementedError


class _Idle:
    def __init__(self, inner: LogConsumer) -> None:
        self._inner = inner

    def poll_batch(self, max_messages: int = 500, timeout: float = 1.0) -> list[Message]:
        got = self._inner.poll_batch(max_messages, timeout)
        if not got:
            time.sleep(min(timeout, 0.01))
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def eventually(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not within 5 s"
        time.sleep(0.01)


def test_the_client_does_not_believe_a_forged_status(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running
) -> None:
    _, c = running.coordinator()
    tx = tx_on(1)
    with SagaClient(SETTINGS, keys=keys.client, log=ClientLog(log)) as client:
        client.send(request(tx, clock))
        c.step()
        send(log, keys.bank, TOPICS.status, forged_status(tx, SagaState.COMMITTED, clock))
        forge_tombstone(log, tx)
        send(log, None, TOPICS.status, forged_status(tx, SagaState.ROLLED_BACK, clock))
    # A new client reads the topic from the beginning: pending (the coordinator's), not
    # the forged states (an unauthenticated view believes the last forgery).
    plain = StatusView(SETTINGS, log=ClientLog(log))
    try:
        assert plain.wait_caught_up(5)
        found = plain.get(tx)
        assert found is not None and found.state is SagaState.ROLLED_BACK
    finally:
        plain.close()
    with SagaClient(SETTINGS, keys=keys.client, log=ClientLog(log)) as client:
        assert client.wait_caught_up(5)
        status = client.status(tx)
        assert status is not None and status.state is SagaState.PENDING
        with pytest.raises(SagaTimeout):
            client.result(tx, timeout=0.2)
        send(log, keys.bank, TOPICS.events, event(tx, 0, "bank", StepStatus.APPLIED, clock))
        send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.APPLIED, clock))
        c.step()
        send(log, keys.bank, TOPICS.events, event(tx, 0, "bank", StepStatus.COMMITTED, clock))
        send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.COMMITTED, clock))
        c.step()
        assert client.result(tx, timeout=5).state is SagaState.COMMITTED


def test_the_client_believes_only_the_coordinators_dead_letters(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running
) -> None:
    _, c = running.coordinator()
    tx = tx_on(0)
    first = request(tx, clock)
    with SagaClient(SETTINGS, keys=keys.client, log=ClientLog(log)) as client:
        client.send(first)
        c.step()
        # A forged rejection of this very request: the client keeps waiting.
        with log.producer() as producer:
            producer.produce(
                TOPICS.dlq,
                tx,
                encode(first),
                headers=[
                    ("saga.error", b"already submitted with a different payload"),
                    ("saga.source.topic", TOPICS.requests.encode()),
                ],
            )
        time.sleep(0.05)
        with pytest.raises(SagaTimeout):
            client.result(tx, timeout=0.2)
    # The coordinator's own rejection of a conflicting request is believed.
    other = request(tx, clock, [move(by=7), shop_step()])
    with SagaClient(
        SETTINGS, keys=keys.client, log=ClientLog(log), status_from_beginning=False
    ) as late:
        late.send(other)
        c.step()
        with pytest.raises(ConflictingRequest):
            late.result(tx, timeout=5)


def test_the_async_client_resolves_a_wait_only_on_the_coordinators_status(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running
) -> None:
    _, c = running.coordinator()
    tx = tx_on(0)

    async def scenario() -> SagaStatus:
        async with AsyncSagaClient(SETTINGS, keys=keys.client, log=ClientLog(log)) as client:
            await client.submit([move(), shop_step()], tx_id=tx, timeout=60)
            await asyncio.to_thread(c.step)
            waiting = asyncio.ensure_future(client.result(tx, timeout=5))
            await asyncio.sleep(0.05)
            send(log, None, TOPICS.status, forged_status(tx, SagaState.ROLLED_BACK, clock))
            send(log, keys.shop, TOPICS.status, forged_status(tx, SagaState.COMMITTED, clock))
            await asyncio.sleep(0.2)
            assert not waiting.done(), "a forged status ended the wait"
            for status in (StepStatus.APPLIED, StepStatus.COMMITTED):
                send(log, keys.bank, TOPICS.events, event(tx, 0, "bank", status, clock))
                send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", status, clock))
                await asyncio.to_thread(c.step)
            return await waiting

    assert asyncio.run(scenario()).state is SagaState.COMMITTED


# ---------------------------------------------------------------- sequential neighbours


@pytest.mark.parametrize("before_the_request", [False, True])
@pytest.mark.parametrize("forger", ["nobody", "bank", "ledger"])
def test_a_forged_predecessors_event_does_not_start_a_sequential_step(
    log: InMemoryLog,
    clock: ManualClock,
    keys: Keys,
    running: Running,
    database: str,
    before_the_request: bool,
    forger: str,
) -> None:
    """Unsigned, signed by bank for the shop, or by a participant for a step not its own."""
    bank_runtime, bank = running.bank()
    tx = tx_on(1)
    sequential = request(tx, clock, [shop_step(), move()], Mode.SEQUENTIAL)
    real = event(tx, 0, "shop", StepStatus.APPLIED, clock)
    signer, forged = {
        "nobody": (None, real),
        "bank": (keys.bank, real),
        "ledger": (keys.ledger, event(tx, 0, "ledger", StepStatus.APPLIED, clock)),
    }[forger]
    if before_the_request:
        send(log, signer, TOPICS.events, forged)
        bank.step()
        send(log, keys.client, TOPICS.requests, sequential)
        bank.step()
    else:
        send(log, keys.client, TOPICS.requests, sequential)
        bank.step()
        send(log, signer, TOPICS.events, forged)
        bank.step()
    assert balance(database) == 100 and bank_reported(log, tx) == []
    assert bank_runtime.stats.unauthenticated == 1
    send(log, keys.shop, TOPICS.events, real)  # now by the shop itself
    bank.step()
    assert balance(database) == 105 and bank_reported(log, tx) == [(1, StepStatus.APPLIED)]


def test_events_not_acted_on_are_not_verified(
    log: InMemoryLog,
    clock: ManualClock,
    keys: Keys,
    running: Running,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A participant reads every event; it verifies only those it makes work of."""
    checked: list[str] = []
    real_check = keys.bank.check

    def counting(topic: str, *args: Any) -> str | None:
        checked.append(topic)
        return real_check(topic, *args)

    monkeypatch.setattr(keys.bank, "check", counting)
    bank_runtime, bank = running.bank()
    tx = tx_on(0)
    send(log, keys.shop, TOPICS.events, event(tx, 0, "shop", StepStatus.APPLIED, clock))
    send(log, keys.shop, TOPICS.events, event(tx, 1, "shop", StepStatus.FAILED, clock))
    bank.step()
    assert checked == []  # no sequential saga of bank's: nothing to act on
    send(
        log,
        keys.client,
        TOPICS.requests,
        request(tx, clock, [shop_step(), move()], Mode.SEQUENTIAL),
    )
    bank.step()
    assert checked == [TOPICS.requests, TOPICS.events]  # the request; the remembered event
    assert bank_runtime.stats.unauthenticated == 0


# ---------------------------------------------------------------- a participant key's reach


@pytest.mark.parametrize(
    "record",
    [
        Decision("tx-1", Outcome.COMMIT, "forged", 1),
        SagaStatus("tx-1", "s", SagaState.COMMITTED, (), None, 1, 1, 2),
        StepEvent("tx-1", 1, "shop", StepStatus.APPLIED, 1),
        StepsCommitted("shop", 1, (("tx-1", 1),)),
        SagaAbort("tx-1", "forged", 1),
        SagaRequest("tx-1", "s", Mode.PARALLEL, (shop_step(),), 2, 1),
    ],
    ids=[
        "decision",
        "status",
        "another participant's event",
        "another's commits",
        "abort",
        "request",
    ],
)
def test_a_participant_key_signs_nothing_but_its_own_events(keys: Keys, record: Record) -> None:
    topic = TOPICS.events
    value = encode(record)
    headers = keys.bank.sign(topic, record.tx_id, value)
    reason = keys.verifier.check(topic, b"tx-1", value, headers, allowed_signers(record))
    assert reason is not None and reason.startswith("record is signed by participant-bank, not by")
    own = StepEvent("tx-1", 0, "bank", StepStatus.APPLIED, 1)
    headers = keys.bank.sign(topic, "tx-1", encode(own))
    assert keys.verifier.check(topic, b"tx-1", encode(own), headers, allowed_signers(own)) is None


# ---------------------------------------------------------------- routing headers

JUNK = b"\xff not json"


def send_raw(
    log: InMemoryLog, topic: str, key: str, value: bytes, headers: list[tuple[str, bytes]]
) -> None:
    """Write a record with exactly these headers (unsigned, or a copy of a signed one)."""
    with log.producer() as producer:
        producer.produce(topic, key, value, headers)


def test_a_forged_request_with_lying_headers_leaves_no_seen_marker(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running, database: str
) -> None:
    bank, stepper = running.bank()
    tx = tx_on(0)
    genuine = request(tx, clock)  # a bank step and a shop step
    lie = request_headers(SagaRequest(tx, "x", Mode.PARALLEL, (shop_step(),), 1, 0))
    send_raw(log, TOPICS.requests, tx, JUNK, lie)  # unsigned: an attacker's
    with SignedLog(log, keys.client).producer() as producer:
        producer.produce(TOPICS.requests, tx, encode(genuine), request_headers(genuine))
    stepper.step(2)
    assert bank.stats.unauthenticated == 1 and bank.stats.skipped_invalid == 0  # not parsed
    assert balance(database) == 105  # the genuine request was not taken for a conflict


def test_a_copy_of_a_genuine_decision_with_changed_headers_changes_nothing(
    log: InMemoryLog, clock: ManualClock, keys: Keys, running: Running, database: str
) -> None:
    bank, stepper = running.bank()
    tx = tx_on(1)
    genuine = request(tx, clock)
    with SignedLog(log, keys.client).producer() as producer:
        producer.produce(TOPICS.requests, tx, encode(genuine), request_headers(genuine))
    stepper.step()
    assert balance(database) == 105
    rollback = Decision(tx, Outcome.ROLLBACK, "r", clock())
    signed = keys.coordinator.sign(TOPICS.decisions, tx, encode(rollback), [(PARTS, b"bank,shop")])
    # The attacker copies it with a header naming no one but shop: that copy is skipped
    # (its signature no longer holds anyway); the genuine one, written after, still acts.
    lying = [(n, b"shop" if n == PARTS else v) for n, v in signed]
    for headers in (lying, signed):
        send_raw(log, TOPICS.decisions, tx, encode(rollback), headers)
    stepper.step(2)
    assert bank.stats.unauthenticated == 0  # the copy was skipped before any check
    assert balance(database) == 100  # compensated on the genuine decision
