"""The in-memory log's own semantics (``streams.testing``): what the service tests rely on.

Partitions and keys as Kafka places them, range-assigned consumer groups whose
rebalances run inside ``poll_batch``, committed offsets, transactions (markers,
read_committed, fencing, generation checks, pending offsets), the plain
producer's flush, and the kill and stepping hooks.
"""

from __future__ import annotations

import pytest

from saga.streams import ConfigurationError, FatalKafkaError, TransientError
from saga.streams.kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Message,
    TransactionAborted,
    partition_for,
)
from saga.streams.testing import (
    InMemoryConsumer,
    InMemoryLog,
    KillAt,
    Killed,
    ManualClock,
    Stepper,
)

pytestmark = pytest.mark.unit

PARTITIONS = 4


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    made = InMemoryLog(clock=clock)
    made.create_topic("in", PARTITIONS)
    made.create_topic("other", PARTITIONS)
    made.create_topic("out", PARTITIONS)
    return made


def put(log: InMemoryLog, topic: str, *keys: str, partition: int | None = None) -> None:
    with log.producer() as producer:
        for key in keys:
            producer.produce(topic, key, f"v-{key}".encode(), partition=partition)


class Recorder:
    """A group member's rebalance callbacks, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[str, int]]]] = []

    def member(self, log: InMemoryLog, name: str, topics: tuple[str, ...]) -> InMemoryConsumer:
        consumer = log.consumer(
            "g",
            client_id=name,
            on_assign=lambda ps: self.calls.append(("assign", sorted(ps))),
            on_revoke=lambda ps: self.calls.append(("revoke", sorted(ps))),
            on_lost=lambda ps: self.calls.append(("lost", sorted(ps))),
        )
        consumer.subscribe(list(topics))
        return consumer


def drain(consumer: InMemoryConsumer) -> list[Message]:
    found: list[Message] = []
    while batch := consumer.poll_batch(100, 0):
        found += batch
    return found


# ---------------------------------------------------------------- topics, producer


def test_keys_are_partitioned_like_kafka_with_offsets_headers_and_timestamps(
    log: InMemoryLog, clock: ManualClock
) -> None:
    keys = [f"tx-{i}" for i in range(40)]
    with log.producer() as producer:
        for key in keys:
            producer.produce("in", key, b"v", headers=[("h", b"1")])
        producer.produce("in", "stamped", b"v", partition=2, timestamp_ms=7)
    for key in keys:
        (found,) = [m for m in log.records("in") if m.key == key.encode()]
        assert found.partition == partition_for(key, PARTITIONS)
        assert found.headers == (("h", b"1"),)
        assert found.timestamp_ms == clock()
    for p in range(PARTITIONS):
        assert [m.offset for m in log.records("in", p)] == list(range(log.end_offset("in", p)))
    assert [(m.partition, m.timestamp_ms) for m in log.records("in") if m.key == b"stamped"] == [
        (2, 7)
    ]


def test_plain_producer_records_appear_on_flush_and_a_kill_before_it_loses_them(
    log: InMemoryLog,
) -> None:
    producer = log.producer()
    delivered: list[int] = []
    producer.produce("in", "a", b"1", on_delivery=lambda err, m: delivered.append(m.offset))
    assert log.records("in") == []
    assert producer.flush() == 1
    assert len(log.records("in")) == 1 and delivered == [0]
    producer.produce("in", "a", b"2")
    log.kill()  # this thread's clients die: the buffered record is lost
    with pytest.raises(Killed):
        producer.flush()
    assert [m.value for m in log.records("in")] == [b"1"]


def test_missing_topics_are_configuration_errors(log: InMemoryLog) -> None:
    with pytest.raises(ConfigurationError):
        log.producer().produce("nope", "k", b"v")
    consumer = log.consumer("g")
    with pytest.raises(ConfigurationError):
        consumer.subscribe(["nope"])
    with pytest.raises(ConfigurationError):
        consumer.list_partitions("nope")
    assert consumer.list_partitions("in") == PARTITIONS
    with pytest.raises(ConfigurationError):
        log.consumer(None).subscribe(["in"])


# ---------------------------------------------------------------- groups


def test_range_assignment_gives_each_member_the_same_numbers_of_every_topic(
    log: InMemoryLog,
) -> None:
    rec_a, rec_b = Recorder(), Recorder()
    a = rec_a.member(log, "a", ("in", "other"))
    assert rec_a.calls == []  # callbacks run inside poll_batch, not in subscribe
    a.poll_batch(10, 0)
    assert rec_a.calls == [("assign", [(t, p) for t in ("in", "other") for p in range(4)])]
    b = rec_b.member(log, "b", ("in", "other"))
    generation = log.generation("g")
    a.poll_batch(10, 0)
    b.poll_batch(10, 0)
    # eager, as the range assignor: the whole old assignment is revoked, then the new one given
    assert rec_a.calls[1:] == [
        ("revoke", [(t, p) for t in ("in", "other") for p in range(4)]),
        ("assign", [(t, p) for t in ("in", "other") for p in (0, 1)]),
    ]
    assert rec_b.calls == [("assign", [(t, p) for t in ("in", "other") for p in (2, 3)])]
    assert a.generation == b.generation == generation
    assert [m.client_id for m in log.members("g")] == ["a", "b"]


def test_a_leaving_member_hands_its_partitions_over_from_the_committed_offsets(
    log: InMemoryLog,
) -> None:
    put(log, "in", "x", "y", partition=3)
    rec_a, rec_b = Recorder(), Recorder()
    a = rec_a.member(log, "a", ("in",))
    b = rec_b.member(log, "b", ("in",))
    a.poll_batch(10, 0)
    first = b.poll_batch(1, 0)  # b owns 2 and 3
    assert [m.offset for m in first] == [0]
    b.commit({("in", 3): 1})
    b.close()
    assert rec_b.calls[-1] == ("revoke", [("in", 2), ("in", 3)])
    assert [(m.partition, m.offset) for m in drain(a)] == [(3, 1)]
    assert a.assignment() == [("in", p) for p in range(4)]
    assert a.committed([("in", 3), ("in", 0)]) == {("in", 3): 1, ("in", 0): None}


def test_a_dropped_member_is_told_lost_and_cannot_commit(log: InMemoryLog) -> None:
    rec_a, rec_b = Recorder(), Recorder()
    a = rec_a.member(log, "a", ("in",))
    b = rec_b.member(log, "b", ("in",))
    a.poll_batch(10, 0)
    b.poll_batch(10, 0)
    log.drop(b)  # its session timed out: it does not know yet
    with pytest.raises(TransientError):
        b.commit({("in", 2): 1})
    a.poll_batch(10, 0)
    assert a.assignment() == [("in", p) for p in range(4)]
    b.poll_batch(10, 0)  # learns it was dropped, joins again as a new member
    assert rec_b.calls[-2:] == [
        ("lost", [("in", 2), ("in", 3)]),
        ("assign", [("in", 2), ("in", 3)]),
    ]
    assert a.generation < log.generation("g") == b.generation
    a.poll_batch(10, 0)
    assert a.assignment() == [("in", 0), ("in", 1)]


def test_a_poll_can_return_records_fetched_before_the_rebalance_it_runs(
    log: InMemoryLog,
) -> None:
    log.fetch_before_rebalance = True
    rec_a = Recorder()
    a = rec_a.member(log, "a", ("in",))
    a.poll_batch(10, 0)
    put(log, "in", "late", partition=3)
    Recorder().member(log, "b", ("in",))
    batch = a.poll_batch(10, 0)
    assert [(m.partition, m.offset) for m in batch] == [(3, 0)]
    assert a.assignment() == [("in", 0), ("in", 1)]  # ... of a partition revoked in that poll
    assert rec_a.calls[-1] == ("assign", [("in", 0), ("in", 1)])


# ---------------------------------------------------------------- offsets, flow control


def test_seek_position_pause_resume_and_group_less_assign(log: InMemoryLog) -> None:
    put(log, "in", "a", "b", "c", partition=0)
    reader = log.consumer(None)
    reader.assign([("in", 0, OFFSET_BEGINNING)])
    assert reader.committed([("in", 0)]) == {("in", 0): None}
    assert [m.offset for m in drain(reader)] == [0, 1, 2]
    assert reader.position([("in", 0)]) == {("in", 0): 3}
    reader.seek("in", 0, 1)
    assert reader.pause_all() == [("in", 0)]
    assert reader.poll_batch(10, 0) == []
    reader.resume_all()
    assert [m.offset for m in drain(reader)] == [1, 2]
    reader.assign({("in", 0): OFFSET_END})
    put(log, "in", "d", partition=0)
    assert [m.value for m in drain(reader)] == [b"v-d"]
    assert reader.watermarks("in", 0) == (0, 4)
    with pytest.raises(ConfigurationError):
        reader.commit({("in", 0): 1})


# ---------------------------------------------------------------- transactions


def test_read_committed_hides_open_and_aborted_records_and_markers_take_offsets(
    log: InMemoryLog,
) -> None:
    txp = log.transactional_producer("t")
    txp.init()
    txp.begin()
    txp.produce("out", "k", b"open", partition=0)
    put(log, "out", "plain", partition=0)  # after the open transaction's record
    committed_reader = log.consumer(None)
    committed_reader.assign([("out", 0, 0)])
    dirty_reader = log.consumer(None, isolation_level="read_uncommitted")
    dirty_reader.assign([("out", 0, 0)])
    assert drain(committed_reader) == []  # stops at the last stable offset
    assert committed_reader.watermarks("out", 0) == (0, 0)
    assert dirty_reader.watermarks("out", 0) == (0, 2)
    assert [m.value for m in drain(dirty_reader)] == [b"open", b"v-plain"]
    txp.abort()  # marker at offset 2
    assert [m.value for m in drain(committed_reader)] == [b"v-plain"]
    txp.begin()
    txp.produce("out", "k", b"kept", partition=0)
    txp.commit()  # record at 3, marker at 4
    assert [(m.offset, m.value) for m in drain(committed_reader)] == [(3, b"kept")]
    assert committed_reader.position([("out", 0)]) == {("out", 0): 5}
    assert committed_reader.watermarks("out", 0) == (0, 5) == (0, log.end_offset("out", 0))
    assert [m.value for m in log.records("out")] == [b"v-plain", b"kept"]


def test_a_new_producer_with_the_same_id_fences_the_old_and_aborts_its_transaction(
    log: InMemoryLog,
) -> None:
    old = log.transactional_producer("t")
    old.init()
    old.begin()
    old.produce("out", "k", b"zombie")
    new = log.transactional_producer("t")
    new.init()
    with pytest.raises(FatalKafkaError, match="fenced"):
        old.commit()
    with pytest.raises(FatalKafkaError):
        old.begin()
    old.close()  # quietly
    new.begin()
    new.produce("out", "k", b"fresh")
    new.commit()
    assert [m.value for m in log.records("out")] == [b"fresh"]


def test_offsets_sent_by_a_stale_member_make_the_commit_abort(log: InMemoryLog) -> None:
    put(log, "in", "k", partition=0)
    a = Recorder().member(log, "a", ("in",))
    (m,) = a.poll_batch(10, 0)
    Recorder().member(log, "b", ("in",))  # a rebalance a has not seen yet
    txp = log.transactional_producer("t")
    txp.init()
    txp.begin()
    txp.produce("out", "k", b"result")
    txp.send_offsets(a, {m.partition_key: m.next_offset})
    with pytest.raises(TransactionAborted, match="generation"):
        txp.commit()
    txp.abort()
    assert log.records("out") == []
    assert log.committed_offset("g", "in", 0) is None
    a.poll_batch(10, 0)  # a rejoins: it still owns partition 0 (range: a, b)
    txp.begin()
    txp.send_offsets(a, {m.partition_key: m.next_offset})
    txp.commit()  # the broker checks the generation, not ownership
    assert log.committed_offset("g", "in", 0) == 1


def test_offsets_pending_in_a_transaction_hold_back_their_partitions_new_owner(
    log: InMemoryLog,
) -> None:
    put(log, "in", "k1", "k2", partition=0)
    a = Recorder().member(log, "a", ("in",))
    batch = a.poll_batch(1, 0)
    txp = log.transactional_producer("t")
    txp.init()
    txp.begin()
    txp.send_offsets(a, {("in", 0): batch[-1].next_offset})
    a.close()  # the transaction is still open
    b = Recorder().member(log, "b", ("in",))
    with pytest.raises(TransientError, match="pending"):
        b.committed([("in", 0)])
    assert b.poll_batch(10, 0) == []  # unstable offset: nothing fetched yet
    txp.commit()
    assert [m.offset for m in drain(b)] == [1]


def test_an_injected_failure_aborts_the_next_commit_only(log: InMemoryLog) -> None:
    txp = log.transactional_producer("t")
    txp.init()
    log.fail_next_commit("t")
    txp.begin()
    txp.produce("out", "k", b"1")
    with pytest.raises(TransactionAborted):
        txp.commit()
    txp.abort()
    txp.begin()
    txp.produce("out", "k", b"2")
    txp.commit()
    assert [m.value for m in log.records("out")] == [b"2"]


# ---------------------------------------------------------------- kill and stepping


class Loop:
    """A minimal service: copies what it reads to ``out``, committing as it goes."""

    def __init__(self, log: InMemoryLog, faults: KillAt | None = None) -> None:
        self.log = log
        self.faults = faults
        self.consumer = log.consumer("loop")
        self.stopped = False
        self.polls = 0

    def run(self) -> None:
        producer = self.log.producer()
        self.consumer.subscribe(["in"])
        try:
            while not self.stopped:
                batch = self.consumer.poll_batch(10, 0)
                self.polls += 1
                for m in batch:
                    producer.produce("out", m.key, m.value)
                if self.faults is not None and batch:
                    self.faults.hit("loop.after_produce")
                producer.flush()
                if batch:
                    self.consumer.commit({m.partition_key: m.next_offset for m in batch})
        finally:
            producer.close()
            self.consumer.close()

    def stop(self) -> None:
        self.stopped = True


def test_a_stepper_runs_a_loop_one_poll_at_a_time(log: InMemoryLog) -> None:
    loop = Loop(log)
    stepper = Stepper(log, loop.run, stop=loop.stop).start()
    assert loop.polls == 0 and stepper.running
    put(log, "in", "a", partition=1)
    stepper.step()
    assert loop.polls == 1 and [m.value for m in log.records("out")] == [b"v-a"]
    stepper.step(3)
    assert loop.polls == 4
    stepper.stop()
    assert not stepper.running and log.members("loop") == []


def test_a_kill_at_a_fault_point_loses_the_unflushed_and_uncommitted(log: InMemoryLog) -> None:
    loop = Loop(log, KillAt(log, "loop.after_produce"))
    stepper = Stepper(log, loop.run, stop=loop.stop).start()
    put(log, "in", "a", partition=1)
    stepper.step()
    assert stepper.killed and not stepper.running
    assert log.records("out") == []
    assert log.members("loop") == []  # dropped, as after its session timed out
    again = Loop(log)
    stepper = Stepper(log, again.run, stop=again.stop).start()
    stepper.step(2)
    stepper.stop()
    assert [m.value for m in log.records("out")] == [b"v-a"]


def test_a_stepper_raises_what_the_service_dies_of(log: InMemoryLog) -> None:
    def broken() -> None:
        consumer = log.consumer("x")
        consumer.subscribe(["in"])
        consumer.poll_batch(1, 0)
        raise RuntimeError("boom")

    stepper = Stepper(log, broken).start()
    with pytest.raises(RuntimeError, match="boom"):
        stepper.step()
    assert not stepper.running
