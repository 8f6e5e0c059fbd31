"""The consumer's commit gate: one asynchronous offset commit in flight, the rest held."""

from __future__ import annotations

import pytest

from saga.streams.kafka._commits import COMMIT_ANSWER_S, CommitGate
from saga.streams.testing import ManualClock

pytestmark = pytest.mark.unit

A, B = ("t", 0), ("t", 1)


def gate_on(clock: ManualClock) -> CommitGate:
    return CommitGate(lambda: clock() / 1000)  # the gate counts in seconds


def test_a_commit_in_flight_holds_the_next_until_its_answer(clock: ManualClock) -> None:
    gate = gate_on(clock)
    gate.hold({A: 1})
    assert gate.release() == {A: 1}
    for offset in range(2, 1002):  # a thousand small batches while the first is in flight
        gate.hold({A: offset, B: offset})
        assert gate.release() is None
    gate.answered()
    assert gate.release() == {A: 1001, B: 1001}  # the newest of each partition, once
    assert gate.sent == 2
    assert not gate.holding


def test_nothing_held_sends_nothing(clock: ManualClock) -> None:
    gate = gate_on(clock)
    assert gate.release() is None
    assert gate.release(now=True) is None
    assert gate.sent == 0


def test_closing_sends_what_is_held_even_with_a_commit_in_flight(clock: ManualClock) -> None:
    gate = gate_on(clock)
    gate.hold({A: 1})
    gate.release()
    gate.hold({A: 2})
    assert gate.release(now=True) == {A: 2}


def test_a_waited_commit_carries_the_held_offsets_under_its_own(clock: ManualClock) -> None:
    gate = gate_on(clock)
    gate.hold({A: 1})
    gate.release()
    gate.hold({A: 5, B: 3})
    # held offsets are older than the ones asked for after them: never sent after them
    assert gate.take({A: 7}) == {A: 7, B: 3}
    assert not gate.holding
    gate.answered()
    assert gate.release() is None


def test_lost_partitions_are_forgotten_and_a_new_client_starts_clean(clock: ManualClock) -> None:
    gate = gate_on(clock)
    gate.hold({A: 1})
    gate.release()
    gate.hold({A: 2, B: 2})
    assert gate.holds_any([B])
    gate.drop([B])
    assert not gate.holds_any([B])
    gate.reset()
    assert not gate.holding
    gate.hold({A: 3})
    assert gate.release() == {A: 3}  # nothing in flight after the reset


def test_an_answer_that_never_comes_stops_holding_after_the_backstop(
    clock: ManualClock,
) -> None:
    gate = gate_on(clock)
    gate.hold({A: 1})
    gate.release()
    gate.hold({A: 2})
    clock.advance(int(COMMIT_ANSWER_S * 1000) - 500)
    assert gate.release() is None
    clock.advance(1000)
    assert gate.release() == {A: 2}
