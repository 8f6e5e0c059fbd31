"""The participant registry on the in-memory log (no service): issue #15, must-hold 1.

Covered: the ``saga.participant`` record and its key; the registry view (known
names, ``gone`` after three missed heartbeats or a ``stopping`` announcement,
tombstones, caught up); hostile and forged announcements skipped, never fatal;
participants announcing (before consuming, every interval, ``stopping`` on a clean
stop); and the coordinator with the registry: a request naming a participant that
never announced itself rolls back at once with a reason naming it (its step counts
as compensated, and in a sequential saga it is reported so, so that the earlier
step compensates), a known one is decided as usual, and a restarted coordinator
reads the registry before it decides anything.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from saga.coordinator._known import DEFAULT_PARTICIPANT_GRACE_MS
from saga.coordinator._machine import RequestReceived, decide
from saga.coordinator._service import CoordinatorService
from saga.participants import ParticipantRuntime, open_storage
from saga.streams import (
    Decision,
    InvalidRecord,
    Isolation,
    KafkaSettings,
    Mode,
    Outcome,
    ParticipantAnnouncement,
    ParticipantRegistry,
    ParticipantState,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepStatus,
    StorageKind,
    decode_announcement,
    decode_as,
    encode,
)
from saga.streams._signed_log import SignedLog
from saga.streams._signing import OPERATOR, Keyring, create_key
from saga.streams.testing import InMemoryLog, ManualClock, Stepper, key_on
from tests._helpers import memory_log

pytestmark = pytest.mark.unit

PARTITIONS = 2
SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="r")
TOPICS = SETTINGS.topics
INTERVAL_MS = 1_000


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    return memory_log(SETTINGS, clock, PARTITIONS)


def announcement(
    name: str,
    clock: ManualClock,
    *,
    instance: str = "i1",
    state: ParticipantState = ParticipantState.UP,
) -> ParticipantAnnouncement:
    return ParticipantAnnouncement(
        name=name,
        storage=StorageKind.SQL,
        targets=("accounts",),
        version="0.1.0",
        instance=instance,
        started_ms=clock() - 10,
        heartbeat_ms=clock(),
        interval_ms=INTERVAL_MS,
        state=state,
        host="test",
    )


def produce(log: Any, key: str | bytes | None, value: bytes | None) -> None:
    with log.producer() as producer:
        producer.produce(TOPICS.participants, key, value)


def announce(log: Any, clock: ManualClock, name: str, **options: Any) -> None:
    record = announcement(name, clock, **options)
    produce(log, record.key, encode(record))


def registry_of(log: Any, clock: ManualClock, keys: Keyring | None = None) -> ParticipantRegistry:
    registry = ParticipantRegistry(log, keys=keys, clock=clock)
    registry.start()
    assert registry.catch_up(5)
    return registry


# ---------------------------------------------------------------- the record


def test_an_announcement_round_trips_and_its_key_is_name_slash_instance(
    clock: ManualClock,
) -> None:
    record = announcement("bank", clock)
    assert record.key == "bank/i1"
    assert decode_announcement(b"bank/i1", encode(record)) == record
    with pytest.raises(InvalidRecord, match="differs from its name/instance 'bank/i1'"):
        decode_announcement(b"shop/i1", encode(record))


def test_an_announcement_is_not_a_transaction_record() -> None:
    from saga.streams import decode_keyed

    record = ParticipantAnnouncement("bank", StorageKind.REDIS, (), "1", "i", 1, 2, 3)
    with pytest.raises(InvalidRecord, match="not a transaction's record"):
        decode_keyed(b"bank/i", encode(record), ParticipantAnnouncement)


# ---------------------------------------------------------------- the view


def test_the_registry_knows_who_announced_itself_and_who_is_gone(
    log: InMemoryLog, clock: ManualClock
) -> None:
    announce(log, clock, "bank")
    announce(log, clock, "shop", instance="a")
    announce(log, clock, "shop", instance="b")
    registry = registry_of(log, clock)
    assert registry.known("bank") and registry.known("shop") and not registry.known("ledgr")
    assert registry.names() == {"bank", "shop"}
    listed = {p.name: p for p in registry.participants()}
    assert set(listed["shop"].live) == {"a", "b"}
    assert not listed["bank"].gone

    # Three intervals without a heartbeat: gone, but still known (its steps wait for it).
    clock.advance(3 * INTERVAL_MS + 1)
    announce(log, clock, "shop", instance="a")  # one shop process beats on
    announce(log, clock, "shop", instance="b", state=ParticipantState.STOPPING)
    registry.poll(0)
    listed = {p.name: p for p in registry.participants()}
    assert listed["bank"].gone and registry.known("bank")
    assert listed["bank"].heartbeat_age_ms == 3 * INTERVAL_MS + 1
    assert listed["shop"].live == ("a",) and not listed["shop"].gone
    assert listed["shop"].to_json()["state"] == "up"
    assert listed["bank"].to_json()["state"] == "gone"


def test_a_tombstone_forgets_an_instance_and_a_name_with_none_left(
    log: InMemoryLog, clock: ManualClock
) -> None:
    announce(log, clock, "bank", instance="a")
    announce(log, clock, "bank", instance="b")
    produce(log, "bank/a", None)
    registry = registry_of(log, clock)
    assert [a.instance for a in registry.instances()] == ["b"]
    produce(log, "bank/b", None)
    registry.poll(0)
    assert not registry.known("bank") and registry.participants() == []
    assert registry.stats.forgotten == 2


def test_caught_up_means_read_to_the_ends_noted_at_start(
    log: InMemoryLog, clock: ManualClock
) -> None:
    announce(log, clock, "bank")
    registry = ParticipantRegistry(log, clock=clock)
    registry.start()
    assert not registry.caught_up and not registry.known("bank")
    registry.poll(0)
    assert registry.caught_up and registry.known("bank")
    # What comes later is read by later polls; caught up stays true.
    announce(log, clock, "shop")
    assert registry.caught_up and not registry.known("shop")
    assert registry.refresh(5) and registry.known("shop")


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        (b"bank/i1", b"{not json", "not valid JSON"),
        (b"bank/i1", b"[1, 2]", "must be a JSON object"),
        (b"bank/i1", orjson.dumps({"v": 1, "type": "saga.participant"}), "must contain"),
        (b"ledgr/i1", None, ""),  # a tombstone of an instance nobody knows: nothing
        (b"shop/i1", "bank", "differs from its name/instance"),
        (None, "bank", "differs from its name/instance"),
        (b"bank/i1", b"x" * (600 * 1024), "more than the"),
    ],
    ids=["json", "array", "fields", "tombstone", "wrong-key", "no-key", "huge"],
)
def test_hostile_records_are_skipped_and_counted_never_fatal(
    log: InMemoryLog, clock: ManualClock, key: bytes | None, value: Any, why: str
) -> None:
    if value == "bank":
        value = encode(announcement("bank", clock))
    produce(log, key, value)
    announce(log, clock, "shop")
    registry = registry_of(log, clock)
    assert registry.names() == {"shop"}
    assert registry.stats.skipped == (0 if value is None else 1)


def keys_in(folder: Path, principal: str | None) -> Keyring:
    return Keyring.load(folder, principal)


@pytest.fixture
def key_folder(tmp_path: Path) -> Path:
    for principal in ("coordinator", "client", OPERATOR, "participant-bank", "participant-shop"):
        create_key(tmp_path, principal)
    return tmp_path


def test_with_keys_only_the_participant_itself_may_announce_it(
    log: InMemoryLog, clock: ManualClock, key_folder: Path
) -> None:
    as_shop = SignedLog(log, keys_in(key_folder, "participant-shop"))
    as_bank = SignedLog(log, keys_in(key_folder, "participant-bank"))
    announce(as_shop, clock, "bank")  # shop speaks for bank: refused
    announce(log, clock, "bank", instance="unsigned")  # refused
    announce(as_shop, clock, "shop")
    registry = registry_of(log, clock, keys_in(key_folder, None))
    assert registry.names() == {"shop"} and registry.stats.skipped == 2

    announce(as_bank, clock, "bank")
    produce(log, "shop/i1", None)  # an unsigned tombstone: refused
    registry.poll(0)
    assert registry.names() == {"bank", "shop"}
    produce(SignedLog(log, keys_in(key_folder, OPERATOR)), "shop/i1", None)
    registry.poll(0)
    assert registry.names() == {"bank"}


# ---------------------------------------------------------------- the machine


def request(tx: str, clock: ManualClock, *names: str, mode: Mode = Mode.PARALLEL) -> SagaRequest:
    return SagaRequest(
        tx_id=tx,
        saga="transfer",
        mode=mode,
        steps=tuple(
            Step(n, "increment", {"target": "accounts", "key": "a", "field": "n", "by": 1})
            for n in names
        ),
        deadline_ms=clock() + 60_000,
        created_ms=clock(),
    )


def test_the_machine_names_the_unknown_participant_and_keeps_the_audits_suffix(
    clock: ManualClock,
) -> None:
    why = "no participant of that name has announced itself on r.participants"
    inp = RequestReceived(request("t", clock, "bank", "ledgr"), clock(), frozenset({"bank"}), why)
    saga, out = decide(None, inp)
    assert saga is not None and saga.steps == (StepStatus.PENDING, StepStatus.COMPENSATED)
    (decision,) = [o for o in out if isinstance(o, Decision)]
    assert decision.outcome is Outcome.ROLLBACK
    assert decision.reason == f"unknown participant 'ledgr': {why}; " + (
        "step 1 names unknown participant(s): ledgr"
    )
    assert not [o for o in out if isinstance(o, StepEvent)]  # parallel: nobody waits for it


def test_in_a_sequential_saga_the_unknown_step_is_reported_compensated(
    clock: ManualClock,
) -> None:
    req = request("t", clock, "bank", "ledgr", "shop", mode=Mode.SEQUENTIAL)
    _, out = decide(None, RequestReceived(req, clock(), frozenset({"bank", "shop"}), "x"))
    events = [o for o in out if isinstance(o, StepEvent)]
    assert [(e.step, e.participant, e.status) for e in events] == [
        (1, "ledgr", StepStatus.COMPENSATED)
    ]


# ---------------------------------------------------------------- the coordinator


class Coordinators:
    def __init__(self, log: InMemoryLog, clock: ManualClock) -> None:
        self.log, self.clock = log, clock
        self.steppers: list[Stepper] = []

    def start(self, **options: Any) -> tuple[CoordinatorService, Stepper]:
        options.setdefault("unknown_participants", "reject")
        service = CoordinatorService(
            SETTINGS, instance_id="a", clock=self.clock, log=self.log, **options
        )
        stepper = Stepper(self.log, service.run, stop=service.stop)
        self.steppers.append(stepper)
        return service, stepper.start()


@pytest.fixture
def coordinators(log: InMemoryLog, clock: ManualClock) -> Iterator[Coordinators]:
    running = Coordinators(log, clock)
    yield running
    for stepper in running.steppers:
        if stepper.running:
            stepper.stop()


def submit(log: InMemoryLog, req: SagaRequest) -> None:
    with log.producer() as producer:
        producer.produce(TOPICS.requests, req.tx_id, encode(req))


def statuses(log: InMemoryLog) -> dict[str, SagaStatus]:
    latest: dict[str, SagaStatus] = {}
    for m in log.records(TOPICS.status):
        if m.value is not None:
            status = decode_as(m.value, SagaStatus)
            assert isinstance(status, SagaStatus)
            latest[status.tx_id] = status
    return latest


def decisions(log: InMemoryLog) -> list[Decision]:
    found = [decode_as(m.value, Decision) for m in log.records(TOPICS.decisions)]
    return [d for d in found if isinstance(d, Decision)]


def test_a_request_naming_a_participant_that_never_announced_itself_rolls_back_after_the_grace(
    log: InMemoryLog, clock: ManualClock, coordinators: Coordinators
) -> None:
    announce(log, clock, "bank")
    _, stepper = coordinators.start()  # the grace: 30 s (DEFAULT_PARTICIPANT_GRACE_MS)
    alone, mixed = key_on(0, PARTITIONS), key_on(1, PARTITIONS)
    submit(log, request(alone, clock, "ledgr"))
    submit(log, request(mixed, clock, "bank", "ledgr"))
    stepper.step()
    assert decisions(log) == [] and statuses(log)[alone].state is SagaState.PENDING
    clock.advance(DEFAULT_PARTICIPANT_GRACE_MS)
    stepper.step()
    assert {d.tx_id: d.outcome for d in decisions(log)} == {
        alone: Outcome.ROLLBACK,
        mixed: Outcome.ROLLBACK,
    }
    final = statuses(log)
    assert final[alone].state is SagaState.ROLLED_BACK  # nothing to wait for
    assert final[alone].reason is not None and "unknown participant 'ledgr'" in final[alone].reason
    assert f"announced itself on {TOPICS.participants}" in final[alone].reason
    # The known step still owes its compensation; the unknown one owes nothing.
    assert final[mixed].state is SagaState.ROLLING_BACK
    assert [s.status for s in final[mixed].steps] == [StepStatus.PENDING, StepStatus.COMPENSATED]
    with log.producer() as producer:
        event = StepEvent(mixed, 0, "bank", StepStatus.COMPENSATED, clock())
        producer.produce(TOPICS.events, mixed, encode(event))
    stepper.step()
    assert statuses(log)[mixed].state is SagaState.ROLLED_BACK


def test_a_known_participant_is_decided_as_usual_even_one_announced_after_the_start(
    log: InMemoryLog, clock: ManualClock, coordinators: Coordinators
) -> None:
    _, stepper = coordinators.start()
    announce(log, clock, "bank")  # after the coordinator read the registry
    tx = key_on(0, PARTITIONS)
    submit(log, request(tx, clock, "bank"))
    stepper.step()
    assert decisions(log) == [] and statuses(log)[tx].state is SagaState.PENDING


def test_a_restarted_coordinator_reads_the_registry_before_it_decides(
    log: InMemoryLog, clock: ManualClock, coordinators: Coordinators
) -> None:
    """The request is in the log before the coordinator starts, and far more
    announcements than one poll of the registry returns come before it: deciding
    before the registry is read to its end would reject a valid saga."""
    for i in range(2500):
        announce(log, clock, f"p{i}")
    tx = key_on(1, PARTITIONS)
    submit(log, request(tx, clock, "p2499", "p0"))
    service, stepper = coordinators.start()
    # Parked at its first poll of the requests: the registry was read to its end before.
    registry = service.known.registry
    assert registry is not None and registry.caught_up and len(registry.names()) == 2500
    stepper.step()
    assert decisions(log) == [] and statuses(log)[tx].state is SagaState.PENDING


def test_sequential_the_unknown_step_is_reported_so_the_earlier_one_compensates(
    log: InMemoryLog, clock: ManualClock, coordinators: Coordinators
) -> None:
    announce(log, clock, "bank")
    _, stepper = coordinators.start()
    tx = key_on(0, PARTITIONS)
    submit(log, request(tx, clock, "bank", "ledgr", mode=Mode.SEQUENTIAL))
    stepper.step()
    clock.advance(DEFAULT_PARTICIPANT_GRACE_MS)  # "ledgr" never announces itself
    stepper.step()
    assert [d.outcome for d in decisions(log)] == [Outcome.ROLLBACK]
    events = [decode_as(m.value, StepEvent) for m in log.records(TOPICS.events)]
    assert [(e.tx_id, e.step, e.status) for e in events if isinstance(e, StepEvent)] == [
        (tx, 1, StepStatus.COMPENSATED)
    ]
    stepper.step()  # its own event, read back, changes nothing
    assert statuses(log)[tx].state is SagaState.ROLLING_BACK


def test_accept_and_a_static_list_do_not_read_the_registry(
    log: InMemoryLog, clock: ManualClock, coordinators: Coordinators
) -> None:
    accepting, _ = coordinators.start(unknown_participants="accept")
    assert accepting.known.registry is None
    static = CoordinatorService(
        SETTINGS, log=log, participants=frozenset({"bank"}), unknown_participants="reject"
    )
    assert static.known.registry is None and static.known.static == {"bank"}


# ---------------------------------------------------------------- participants announce


def test_a_participant_announces_itself_before_consuming_then_beats_then_says_stopping(
    log: InMemoryLog, clock: ManualClock, tmp_path: Path
) -> None:
    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path / 'bank.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE TABLE accounts (id TEXT PRIMARY KEY, n INTEGER)"))
    engine.dispose()
    storage = open_storage("sql", name="bank", url=url, targets=["accounts"])
    runtime = ParticipantRuntime(
        "bank", storage, SETTINGS, log=log, clock=clock, heartbeat_interval_ms=INTERVAL_MS
    )
    stepper = Stepper(log, runtime.run, stop=runtime.stop).start()
    try:
        registry = registry_of(log, clock)
        (info,) = registry.participants()
        assert (info.name, info.storage, info.targets) == ("bank", "sql", ("accounts",))
        assert not info.gone
        first = info.last_heartbeat_ms
        clock.advance(INTERVAL_MS)
        stepper.step()
        registry.poll(0)
        assert registry.participants()[0].last_heartbeat_ms == first + INTERVAL_MS
    finally:
        stepper.stop()
    registry.poll(0)
    (info,) = registry.participants()
    assert info.gone and info.instances[0].state is ParticipantState.STOPPING


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_the_coordinators_report_of_an_unknown_step_lets_the_earlier_step_compensate(
    log: InMemoryLog, clock: ManualClock, tmp_path: Path, key_folder: Path, signed: bool
) -> None:
    """Sequential: ``bank`` applied step 0 and got the rollback; it compensates only once
    step 1 is reported compensated, which its participant (``ledgr``, unknown) never does:
    the coordinator's report of that step is what lets it (with keys: signed by the
    coordinator, which may sign a ``compensated`` report and nothing else of the kind)."""
    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path / 'bank.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE TABLE accounts (id TEXT PRIMARY KEY, n INTEGER)"))
        connection.execute(sa.text("INSERT INTO accounts VALUES ('a', 100)"))

    def balance() -> int:
        with engine.connect() as connection:
            return int(connection.execute(sa.text("SELECT n FROM accounts")).scalar_one())

    def as_(principal: str) -> Any:
        made = SignedLog(log, keys_in(key_folder, principal)) if signed else log
        return made.producer()

    storage = open_storage("sql", name="bank", url=url, targets=["accounts"])
    runtime = ParticipantRuntime(
        "bank",
        storage,
        SETTINGS,
        log=log,
        clock=clock,
        keys=keys_in(key_folder, "participant-bank") if signed else None,
    )
    stepper = Stepper(log, runtime.run, stop=runtime.stop).start()
    tx = key_on(0, PARTITIONS)
    try:
        # at `none` the increment is in the store once applied, so the balance shows it
        req = request(tx, clock, "bank", "ledgr", mode=Mode.SEQUENTIAL)
        req = dataclasses.replace(req, isolation=Isolation.NONE)
        with as_("client") as producer:
            producer.produce(TOPICS.requests, tx, encode(req))
        stepper.step()
        assert balance() == 101  # applied (increment by 1)
        rollback = Decision(tx, Outcome.ROLLBACK, "unknown participant 'ledgr'", clock())
        with as_("coordinator") as producer:
            producer.produce(TOPICS.decisions, tx, encode(rollback))
        stepper.step()
        assert balance() == 101  # waits for its successor's compensation
        _, out = decide(None, RequestReceived(req, clock(), frozenset({"bank"}), "x"))
        (report,) = [o for o in out if isinstance(o, StepEvent)]
        with as_("coordinator") as producer:
            producer.produce(TOPICS.events, tx, encode(report))
        stepper.step()
        assert balance() == 100
        mine = [decode_as(m.value, StepEvent) for m in log.records(TOPICS.events)]
        assert [(e.step, e.status) for e in mine if isinstance(e, StepEvent)][-1] == (
            0,
            StepStatus.COMPENSATED,
        )
    finally:
        stepper.stop()
        engine.dispose()


# ---------------------------------------------------------------- the command line


def test_saga_participants_prints_a_table_and_json(
    log: InMemoryLog, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from saga.coordinator import _cli_registry
    from saga.coordinator.cli import main

    announce(log, clock, "bank")
    clock.advance(4 * INTERVAL_MS)
    announce(log, clock, "shop")
    monkeypatch.setattr(_cli_registry, "_read", lambda *_: registry_of(log, clock))
    runner = CliRunner()
    table = runner.invoke(main, ["participants", "--bootstrap", "x:1", "--prefix", "r"])
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert lines[0].split() == [
        "NAME", "STORAGE", "STATE", "INSTANCES", "HEARTBEAT", "VERSION", "TARGETS"
    ]  # fmt: skip
    assert lines[1].split() == ["bank", "sql", "gone", "0", "up", "/", "1", "4s", "ago", "0.1.0",
                                "accounts"]  # fmt: skip
    assert lines[2].split()[:3] == ["shop", "sql", "up"]
    as_json = runner.invoke(main, ["participants", "--json", "--bootstrap", "x:1"])
    listed = {p["name"]: p for p in json.loads(as_json.output)}
    assert listed["bank"]["state"] == "gone" and listed["bank"]["heartbeat_age_ms"] == 4_000
    assert listed["shop"]["instances"][0]["state"] == "up"


def test_status_notes_the_gone_and_the_never_announced_a_saga_waits_on(
    log: InMemoryLog, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    from saga.coordinator import _cli_registry
    from saga.streams import StepProgress

    announce(log, clock, "bank")
    announce(log, clock, "shop")
    clock.advance(120_000)
    announce(log, clock, "shop")
    monkeypatch.setattr(_cli_registry, "_read", lambda *_: registry_of(log, clock))
    waiting = SagaStatus(
        "t",
        "transfer",
        SagaState.ROLLING_BACK,
        (
            StepProgress("bank", StepStatus.APPLIED),
            StepProgress("shop", StepStatus.APPLIED),
            StepProgress("ghost", StepStatus.PENDING),
            StepProgress("done", StepStatus.COMPENSATED),
        ),
        "deadline passed",
        1,
        2,
        3,
    )
    assert _cli_registry.waiting_notes(SETTINGS, waiting, None) == [
        "waiting on 'bank', which has not been heard from for 2m",
        "waiting on 'ghost', which has never announced itself on r.participants",
    ]
    finished = dataclasses.replace(waiting, state=SagaState.ROLLED_BACK)
    assert _cli_registry.waiting_notes(SETTINGS, finished, None) == []
    assert [_cli_registry.age(ms) for ms in (0, 89_999, 90_000, 5_400_000, 200_000_000)] == [
        "0s", "89s", "1m", "1h", "2d"
    ]  # fmt: skip
