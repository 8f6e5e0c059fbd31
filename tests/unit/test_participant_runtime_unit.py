"""The participant runtime on the in-memory log with a real SQLite storage (no service).

Each test runs ``ParticipantRuntime.run`` for participant ``bank`` under a
:class:`streams.testing.Stepper` (one poll at a time) with a
:class:`~streams.testing.ManualClock`; the storage is SQLite through
:func:`participants.open_storage`, in a file of the test's own. The test writes
what the coordinator and the other participant (``shop``) would write and reads
the events ``bank`` reports. Covered: the request/decision path, the trailing
offsets of the events and decisions topics, the defect of e9eee71 (a sequential
step compensated on its successor's event, whose report a kill lost, reported
again when its decision is read again after the restart), pause on a storage
outage, poison records and items, and sequential neighbours (routing headers: in
``test_participant_routing_unit``). The sagas run at isolation ``none`` unless a test
says otherwise, so a built-in step writes at apply and the tests can read the store
before any decision; the first two tests cover ``read_committed``'s confirm too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa

from saga.participants import (
    LedgerEntry,
    LedgerStatus,
    ParticipantRuntime,
    Report,
    Requested,
    Storage,
    WorkItem,
    open_storage,
)
from saga.streams import (
    Decision,
    InvalidRecord,
    Isolation,
    KafkaSettings,
    Mode,
    Outcome,
    SagaRequest,
    Step,
    StepEvent,
    StepsCommitted,
    StepStatus,
    TransientError,
    decode_as,
    encode,
    step_events,
)
from saga.streams._faults import NO_FAULTS, Faults
from saga.streams._routing import decision_headers
from saga.streams.testing import InMemoryLog, KillAt, ManualClock, Stepper, key_on
from tests._helpers import memory_log

pytestmark = pytest.mark.unit

PARTITIONS = 2
SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="p")
TOPICS = SETTINGS.topics
GROUP = f"{TOPICS.prefix}.participant.bank"
WINDOW_MS = 10_000


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    return memory_log(SETTINGS, clock, PARTITIONS)


@pytest.fixture
def database(tmp_path: Path) -> Iterator[str]:
    """An SQLite file with ``accounts`` (alice: 100, bob: 100); yields its URL."""
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
        connection.execute(accounts.insert(), [{"id": "bob", "balance": 100}])
    engine.dispose()
    yield url


def balance(url: str, key: str = "alice") -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as connection:
            row = connection.execute(
                sa.text("SELECT balance FROM accounts WHERE id = :id"), {"id": key}
            ).one()
            return int(row[0])
    finally:
        engine.dispose()


def sqlite_storage(url: str) -> Storage:
    return open_storage("sql", name="bank", url=url, targets=["accounts"])


class Runtimes:
    """Started runtimes; each is stopped (or found dead) at the end of the test."""

    def __init__(self, log: InMemoryLog, clock: ManualClock) -> None:
        self.log = log
        self.clock = clock
        self.steppers: list[Stepper] = []

    def start(
        self, storage: Storage, faults: Faults = NO_FAULTS, **options: Any
    ) -> tuple[ParticipantRuntime, Stepper]:
        runtime = ParticipantRuntime(
            "bank",
            storage,
            SETTINGS,
            log=self.log,
            clock=self.clock,
            faults=faults,
            event_window_ms=WINDOW_MS,
            max_backoff_s=0.005,
            **options,
        )
        stepper = Stepper(self.log, runtime.run, stop=runtime.stop)
        self.steppers.append(stepper)
        return runtime, stepper.start()


@pytest.fixture
def runtimes(log: InMemoryLog, clock: ManualClock) -> Iterator[Runtimes]:
    running = Runtimes(log, clock)
    yield running
    for stepper in running.steppers:
        if stepper.running:
            stepper.stop()


# ---------------------------------------------------------------- what the others write


def tx_on(partition: int, n: int = 0) -> str:
    return key_on(partition, PARTITIONS, n)


def move(key: str = "alice", by: int = 5) -> Step:
    return Step(
        "bank", "increment", {"target": "accounts", "key": key, "field": "balance", "by": by}
    )


def shop_step() -> Step:
    return Step("shop", "put", {"target": "orders", "key": "o", "value": {"qty": 1}})


def submit(
    log: InMemoryLog,
    clock: ManualClock,
    tx: str,
    steps: Sequence[Step],
    mode: Mode,
    isolation: Isolation = Isolation.NONE,
) -> None:
    """A request for ``tx``; at ``none`` by default, so its built-in steps write at apply."""
    deadline = clock() + 60_000
    request = SagaRequest(tx, "transfer", mode, tuple(steps), deadline, clock(), None, isolation)
    send(log, TOPICS.requests, tx, encode(request))


def send(
    log: InMemoryLog, topic: str, key: str, value: bytes, partition: int | None = None
) -> None:
    with log.producer() as producer:
        producer.produce(topic, key, value, partition=partition)


def decide(log: InMemoryLog, clock: ManualClock, tx: str, outcome: Outcome) -> None:
    send(log, TOPICS.decisions, tx, encode(Decision(tx, outcome, "test", clock())))


def shop_reports(
    log: InMemoryLog, clock: ManualClock, tx: str, step: int, status: StepStatus
) -> None:
    send(log, TOPICS.events, tx, encode(StepEvent(tx, step, "shop", status, clock())))


def reported(log: InMemoryLog, tx: str | None = None) -> list[tuple[int, StepStatus]]:
    """What ``bank`` reported, in order (of one transaction, or all)."""
    out: list[tuple[int, StepStatus]] = []
    for m in log.records(TOPICS.events):
        try:
            record = decode_as(m.value, StepEvent, StepsCommitted)
        except InvalidRecord:
            continue  # a poison record of the test
        assert isinstance(record, StepEvent | StepsCommitted)
        for event in step_events(record):
            if event.participant == "bank" and (tx is None or event.tx_id == tx):
                out.append((event.step, event.status))
    return out


def applied_events(log: InMemoryLog, tx: str) -> list[StepEvent]:
    """The `applied` events ``bank`` reported for ``tx``, in order."""
    events = [decode_as(m.value, StepEvent, StepsCommitted) for m in log.records(TOPICS.events)]
    return [
        e
        for e in events
        if isinstance(e, StepEvent)
        and (e.participant, e.tx_id, e.status) == ("bank", tx, StepStatus.APPLIED)
    ]


def committed(log: InMemoryLog, topic: str, partition: int) -> int | None:
    return log.committed_offset(GROUP, topic, partition)


# ---------------------------------------------------------------- the request and decision path


def test_a_step_is_applied_then_left_alone_on_commit_and_requests_offsets_commit_at_once(
    log: InMemoryLog,
    clock: ManualClock,
    runtimes: Runtimes,
    database: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    storage = sqlite_storage(database)
    opened: list[Sequence[WorkItem]] = []
    open_batch = cast(Any, storage).open_batch

    def counted(items: Sequence[WorkItem], attempt: int) -> Any:
        opened.append(items)
        return open_batch(items, attempt)

    monkeypatch.setattr(storage, "open_batch", counted)
    _, stepper = runtimes.start(storage)
    stepper.step()  # assigned
    # Pausing and resuming are for a storage outage: a batch that works touches neither.
    (member,) = log.members(GROUP)
    touched: list[str] = []
    for name in ("pause_all", "resume_all"):
        monkeypatch.setattr(member, name, lambda *a, _n=name, **k: touched.append(_n))
    tx = tx_on(1)
    submit(log, clock, tx, [move(), shop_step()], Mode.PARALLEL)
    stepper.step()
    assert reported(log, tx) == [(0, StepStatus.APPLIED)]
    assert balance(database) == 105
    assert committed(log, TOPICS.requests, 1) == 1
    assert len(opened) == 1
    commit = Decision(tx, Outcome.COMMIT, "test", clock())
    with log.producer() as producer:  # as the coordinator writes it: nobody confirms
        producer.produce(TOPICS.decisions, tx, encode(commit), decision_headers(commit, ()))
    stepper.step(2)  # its own `applied` event, then the decision
    # A built-in step at `none` has nothing to confirm: its `applied` event said so, and the
    # commit leaves it alone: no event, no ledger change, not even a batch of the storage.
    assert reported(log, tx) == [(0, StepStatus.APPLIED)]
    assert not applied_events(log, tx)[0].confirm
    assert [e.status for e in storage.ledger(tx)] == [LedgerStatus.APPLIED]
    assert len(opened) == 1
    # Without the headers the storage must read the step's level: one batch, no change.
    decide(log, clock, tx, Outcome.COMMIT)
    stepper.step()
    assert len(opened) == 2 and reported(log, tx) == [(0, StepStatus.APPLIED)]
    assert [e.status for e in storage.ledger(tx)] == [LedgerStatus.APPLIED]
    assert balance(database) == 105
    assert touched == []


def test_a_step_with_a_confirm_says_so_and_is_confirmed_and_reported_on_commit(
    log: InMemoryLog, clock: ManualClock, runtimes: Runtimes, database: str
) -> None:
    """At ``read_committed`` a built-in step confirms too: it holds at apply, writes on commit."""
    storage = open_storage(
        "sql", name="bank", url=database, targets=["accounts"], handlers="tests.confirm_handlers"
    )
    assert storage.has_confirm("credit_confirmed")
    assert not storage.has_confirm("credit") and not storage.has_confirm("increment")
    assert storage.needs_decision(Outcome.COMMIT)
    _, stepper = runtimes.start(storage)
    tx = tx_on(0)
    credit = {"key": "alice", "by": 1}
    steps = [Step("bank", "credit", credit), Step("bank", "credit_confirmed", credit), move()]
    submit(log, clock, tx, steps, Mode.PARALLEL, Isolation.READ_COMMITTED)
    stepper.step()
    assert balance(database) == 102  # the handlers wrote; the increment is reserved
    assert storage.ledger(tx)[2].before == {"saga.isolation": "read_committed"}
    flags = [(0, False), (1, True), (2, True)]
    assert [(e.step, e.confirm) for e in applied_events(log, tx)] == flags
    # a repeated request reports the same `applied` events, the flag included
    send(log, TOPICS.requests, tx, log.records(TOPICS.requests)[0].value)
    stepper.step()
    assert [(e.step, e.confirm) for e in applied_events(log, tx)] == flags * 2
    assert balance(database) == 102
    decide(log, clock, tx, Outcome.COMMIT)
    stepper.step(3)
    # only the steps with a confirm are confirmed (the bonus, the increment) and reported
    assert sorted(reported(log, tx)[6:]) == [(1, StepStatus.COMMITTED), (2, StepStatus.COMMITTED)]
    assert balance(database) == 1107
    ledger = {e.step: e.status for e in storage.ledger(tx)}
    assert ledger == {
        0: LedgerStatus.APPLIED,
        1: LedgerStatus.COMMITTED,
        2: LedgerStatus.COMMITTED,
    }


# ---------------------------------------------------------------- trailing offsets


def test_events_and_decisions_offsets_trail_by_the_event_window(
    log: InMemoryLog, clock: ManualClock, runtimes: Runtimes, database: str
) -> None:
    _, stepper = runtimes.start(sqlite_storage(database))
    tx = tx_on(0)
    submit(log, clock, tx, [move(), shop_step()], Mode.PARALLEL)
    stepper.step()
    shop_reports(log, clock, tx, 1, StepStatus.APPLIED)
    decide(log, clock, tx, Outcome.ROLLBACK)
    stepper.step()  # events 0 (its own `applied`) and 1 (shop's), decision 0: compensates
    assert reported(log, tx) == [(0, StepStatus.APPLIED), (0, StepStatus.COMPENSATED)]
    assert committed(log, TOPICS.requests, 0) == 1  # at once
    assert committed(log, TOPICS.events, 0) is None
    assert committed(log, TOPICS.decisions, 0) is None
    clock.advance(WINDOW_MS - 1)
    stepper.step()  # reads its own `compensated` (event 2); the window is not past the rest
    assert committed(log, TOPICS.events, 0) is None
    assert committed(log, TOPICS.decisions, 0) is None
    clock.advance(1)
    stepper.step()  # idle: the window moves past what was read first
    assert committed(log, TOPICS.events, 0) == 2
    assert committed(log, TOPICS.decisions, 0) == 1
    clock.advance(WINDOW_MS)
    stepper.step()
    assert committed(log, TOPICS.events, 0) == 3 == log.end_offset(TOPICS.events, 0)


def test_a_restart_reads_the_window_again_and_still_finds_a_predecessor_seen_before_the_request(
    log: InMemoryLog, clock: ManualClock, runtimes: Runtimes, database: str
) -> None:
    _, stepper = runtimes.start(sqlite_storage(database))
    tx = tx_on(1)
    shop_reports(log, clock, tx, 0, StepStatus.APPLIED)  # read before the request
    stepper.step()
    stepper.stop()
    _, stepper = runtimes.start(sqlite_storage(database))
    submit(log, clock, tx, [shop_step(), move()], Mode.SEQUENTIAL)
    stepper.step()
    assert reported(log, tx) == [(1, StepStatus.APPLIED)]
    assert balance(database) == 105


# ---------------------------------------------------------------- e9eee71


def test_a_sequential_step_compensated_on_its_successors_event_is_reported_after_a_kill(
    log: InMemoryLog, clock: ManualClock, runtimes: Runtimes, database: str
) -> None:
    """e9eee71: the report a kill lost comes back when the decision is read again.

    Step 0 (bank) is applied; the rollback reaches bank first (it waits for step 1's
    compensation); shop's `compensated` event makes bank compensate, and bank is
    killed after its local commit, before reporting. The request offset was long
    committed and the successor's event no longer concerns a step in flight: only
    the decision, read again because its offset trails, can make bank report again.
    """
    kill = KillAt(log, "participant.after_local_commit", nth=None)
    _, stepper = runtimes.start(sqlite_storage(database), kill)
    tx = tx_on(0)
    submit(log, clock, tx, [move(), shop_step()], Mode.SEQUENTIAL)
    stepper.step(2)  # the request; then bank's own `applied`
    assert reported(log, tx) == [(0, StepStatus.APPLIED)]
    decide(log, clock, tx, Outcome.ROLLBACK)
    stepper.step()
    assert reported(log, tx) == [(0, StepStatus.APPLIED)]  # waits for step 1
    clock.advance(1_000)
    shop_reports(log, clock, tx, 1, StepStatus.COMPENSATED)
    kill.arm()
    stepper.step()
    assert stepper.killed
    assert balance(database) == 100  # compensated and committed locally ...
    assert reported(log, tx) == [(0, StepStatus.APPLIED)]  # ... but not reported

    clock.advance(1_000)
    _, stepper = runtimes.start(sqlite_storage(database))
    stepper.step(3)
    assert reported(log, tx) == [(0, StepStatus.APPLIED), (0, StepStatus.COMPENSATED)], (
        "the compensated step was never reported"
    )
    assert balance(database) == 100  # compensated once


# ---------------------------------------------------------------- storage outage


class Flaky(Storage):
    """A storage whose ``execute`` raises ``TransientError`` ``outage`` times, then works;
    and fails for good (``RuntimeError``) on a request of ``poison`` not yet marked failed."""

    def __init__(self, inner: Storage, outage: int = 0, poison: str | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.outage = outage
        self.poison = poison
        self.calls = 0

    def setup(self) -> None:
        self.inner.setup()

    def execute(self, items: Sequence[WorkItem]) -> list[Report]:
        self.calls += 1
        if self.outage > 0:
            self.outage -= 1
            raise TransientError("database unavailable (test)")
        for item in items:
            if isinstance(item, Requested) and item.tx_id == self.poison and not item.fail_reason:
                raise RuntimeError("driver bug (test)")
        return self.inner.execute(items)

    def ledger(self, tx_id: str | None = None) -> list[LedgerEntry]:
        return self.inner.ledger(tx_id)

    def in_flight_sequential(self) -> set[str]:
        return self.inner.in_flight_sequential()

    def prune(self, horizon_ms: int, limit: int) -> int:
        return self.inner.prune(horizon_ms, limit)

    def close(self) -> None:
        self.inner.close()


def test_a_storage_outage_pauses_the_partitions_and_loses_nothing(
    log: InMemoryLog, clock: ManualClock, runtimes: Runtimes, database: str
) -> None:
    storage = Flaky(sqlite_storage(database), outage=3)
    runtime, stepper = runtimes.start(storage)
    stepper.step()  # assigned
    (member,) = log.members(GROUP)
    first, second = tx_on(0), tx_on(1)
    submit(log, clock, first, [move(), shop_step()], Mode.PARALLEL)
    stepper.step()  # fails once; pauses and polls to stay in the group
    assert member.paused == set(member.assignment()) and len(member.paused) == 3 * PARTITIONS
    submit(log, clock, second, [move("bob"), shop_step()], Mode.PARALLEL)  # during the outage
    stepper.step(2)
    assert member.paused and reported(log) == [] and runtime.stats.retries == 3
    stepper.step()  # the fourth try works: resumed
    assert member.paused == set()
    assert reported(log, first) == [(0, StepStatus.APPLIED)]
    stepper.step()
    assert reported(log, second) == [(0, StepStatus.APPLIED)]
    assert (balance(database, "alice"), balance(database, "bob")) == (105, 105)
    assert committed(log, TOPICS.requests, 0) == 1 and committed(log, TOPICS.requests, 1) == 1


# ---------------------------------------------------------------- poison


def test_poison_records_are_skipped_and_a_poison_item_fails_its_step_alone(
    log: InMemoryLog, clock: ManualClock, runtimes: Runtimes, database: str
) -> None:
    bad = tx_on(0, 1)
    runtime, stepper = runtimes.start(Flaky(sqlite_storage(database), poison=bad))
    stepper.step()
    good = tx_on(0, 0)
    send(log, TOPICS.requests, "junk", b"{not json", partition=0)
    send(log, TOPICS.decisions, "junk", b"\xff", partition=0)
    send(log, TOPICS.events, "junk", b"[]", partition=0)
    wrong = tx_on(1, 2)  # a valid request on another partition than its key's
    send(
        log,
        TOPICS.requests,
        wrong,
        encode(SagaRequest(wrong, "t", Mode.PARALLEL, (move(),), clock() + 60_000, clock())),
        partition=0,
    )
    submit(log, clock, good, [move(), shop_step()], Mode.PARALLEL)
    submit(log, clock, bad, [move("bob"), shop_step()], Mode.PARALLEL)
    stepper.step()
    assert runtime.stats.skipped_invalid == 4
    assert runtime.stats.poisoned == 1
    assert sorted(reported(log)) == [(0, StepStatus.APPLIED), (0, StepStatus.FAILED)]
    assert reported(log, bad) == [(0, StepStatus.FAILED)]
    assert (balance(database, "alice"), balance(database, "bob")) == (105, 100)
    assert committed(log, TOPICS.requests, 0) == log.end_offset(TOPICS.requests, 0)


# ---------------------------------------------------------------- sequential neighbours


def test_a_sequential_step_waits_for_its_predecessor_and_compensates_after_its_successor(
    log: InMemoryLog, clock: ManualClock, runtimes: Runtimes, database: str
) -> None:
    _, stepper = runtimes.start(sqlite_storage(database))
    tx = tx_on(1)
    submit(log, clock, tx, [shop_step(), move(), shop_step()], Mode.SEQUENTIAL)
    stepper.step()
    assert reported(log, tx) == [] and balance(database) == 100  # waits for step 0
    shop_reports(log, clock, tx, 0, StepStatus.APPLIED)
    stepper.step()
    assert reported(log, tx) == [(1, StepStatus.APPLIED)] and balance(database) == 105
    decide(log, clock, tx, Outcome.ROLLBACK)
    stepper.step(2)
    assert reported(log, tx) == [(1, StepStatus.APPLIED)]  # waits for step 2
    shop_reports(log, clock, tx, 2, StepStatus.COMPENSATED)
    stepper.step()
    assert reported(log, tx) == [(1, StepStatus.APPLIED), (1, StepStatus.COMPENSATED)]
    assert balance(database) == 100


def test_a_worker_that_takes_over_finds_the_waiting_step_of_the_one_that_left(
    log: InMemoryLog, clock: ManualClock, runtimes: Runtimes, database: str
) -> None:
    _, first = runtimes.start(sqlite_storage(database))
    _, second = runtimes.start(sqlite_storage(database))
    first.step()
    second.step()  # range: the first joined owns partition 0, the second partition 1
    tx = tx_on(1)
    submit(log, clock, tx, [shop_step(), move()], Mode.SEQUENTIAL)
    second.step()  # step 1 waits, known to the second worker and the ledger only
    second.stop()  # leaves: the first takes partition 1 over
    shop_reports(log, clock, tx, 0, StepStatus.APPLIED)
    first.step(2)
    assert reported(log, tx) == [(1, StepStatus.APPLIED)]
    assert balance(database) == 105


# ---------------------------------------------------------------- a slow storage


def test_a_storage_too_slow_for_its_batches_gets_smaller_ones_and_loses_nothing(
    log: InMemoryLog,
    clock: ManualClock,
    database: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch over a quarter of max.poll.interval.ms halves the next reads; nothing is
    skipped, and the batch size grows back once the storage is quick again."""
    settings = KafkaSettings("memory:9092", "p", {"max.poll.interval.ms": "4000"})
    storage = sqlite_storage(database)
    execute = storage.execute
    sizes: list[int] = []
    slow = [True]

    def timed(items: Sequence[WorkItem]) -> list[Report]:
        sizes.append(len(items))
        if slow[0]:
            now[0] += 0.2 * len(items)  # 0.2 s an item: 8 items is over the 1 s budget
        return execute(items)

    now = [0.0]
    monkeypatch.setattr(storage, "execute", timed)
    monkeypatch.setattr("saga.participants._runtime.time.monotonic", lambda: now[0])
    runtime = ParticipantRuntime(
        "bank", storage, settings, log=log, clock=clock, batch_size=64, announce=False
    )
    assert runtime.pace.budget_s == 1.0
    stepper = Stepper(log, runtime.run, stop=runtime.stop).start()
    try:
        stepper.step()  # assigned
        txs = [tx_on(1, n) for n in range(800)]
        for tx in txs[:40]:
            submit(log, clock, tx, [move(by=1), shop_step()], Mode.PARALLEL)
        stepper.step()
        assert sizes == [40] and runtime.pace.limit == 20
        for tx in txs[40:]:
            submit(log, clock, tx, [move(by=1), shop_step()], Mode.PARALLEL)
        while sum(sizes) < 80 and len(sizes) < 40:
            stepper.step()
        # Smaller and smaller batches (the records read include bank's own events), until
        # one fits the budget: 5 items take 1 s.
        assert sum(sizes) == 80 and max(sizes[1:]) <= 20 and min(sizes) <= 5, sizes
        slow[0] = False
        for tx in txs[80:]:
            submit(log, clock, tx, [move(by=1), shop_step()], Mode.PARALLEL)
        for _ in range(300):
            if runtime.pace.limit == 64:
                break
            stepper.step()
        assert runtime.pace.limit == 64
    finally:
        stepper.stop()
    events = [decode_as(m.value, StepEvent) for m in log.records(TOPICS.events)]
    applied = {e.tx_id for e in events if isinstance(e, StepEvent) and e.status == "applied"}
    assert balance(database) == 100 + len(applied)  # each applied once
    assert set(txs[:80]) <= applied
