"""The audit's DLQ judge (I6) on ``saga.committed`` dead letters, without services.

A ``saga.committed`` stands for one ``committed`` event per step it lists. Its dead
letter was rightly rejected when it is keyed otherwise than by its first ``tx_id``,
lists a ``tx_id`` of another partition than its own, or does not decode (a step
listed twice, a step that is not an integer); otherwise the coordinator should have
taken it, and each transaction it lists gets the I6 finding (one violation: one
dead letter).
"""

from __future__ import annotations

import json

import pytest

from saga.streams import StepEvent, StepsCommitted, StepStatus, Topics, encode
from saga.streams.kafka import partition_for
from saga.streams.reconcile._dlq import DeadLetter, TxFacts, judge, rejected_at

pytestmark = pytest.mark.unit

T = Topics("p")
PARTITIONS = 4


def _together(count: int) -> list[str]:
    """``count`` transaction ids of partition 0."""
    ids = (f"tx-{i}" for i in range(1000))
    return [tx for tx in ids if partition_for(tx, PARTITIONS) == 0][:count]


def _far() -> str:
    return next(f"far-{i}" for i in range(1000) if partition_for(f"far-{i}", PARTITIONS) != 0)


def _letter(key: str, value: bytes, *, partition: int | None = None, offset: int = 0) -> DeadLetter:
    home = partition_for(key, PARTITIONS) if partition is None else partition
    headers = {
        "saga.source.topic": T.events.encode(),
        "saga.source.partition": str(home).encode(),
        "saga.source.offset": str(offset).encode(),
        "saga.component": b"coordinator",
        "saga.error": b"rejected",
    }
    return DeadLetter(0, offset, key.encode(), value, headers)


def _facts(txs: set[str]) -> dict[str, TxFacts]:
    return {tx: TxFacts(decided=True, first_request=None, first_request_offset=None) for tx in txs}


def test_a_valid_saga_committed_was_wrongly_rejected_for_each_saga_it_lists() -> None:
    a, b = _together(2)
    record = StepsCommitted("bank", 5, ((a, 0), (b, 1), (a, 1)))
    verdict = judge([_letter(a, encode(record))], T, _facts, partitions=PARTITIONS)
    assert sorted(verdict.findings) == sorted([a, b])
    assert all(len(found) == 1 for found in verdict.findings.values())
    assert "valid saga.committed" in verdict.findings[b][0]
    assert (verdict.records, verdict.justified, verdict.violations) == (1, 0, 1)


def test_a_saga_committed_listing_another_partition_was_rightly_rejected() -> None:
    a = _together(1)[0]
    far = _far()
    record = StepsCommitted("bank", 5, ((a, 0), (far, 0)))
    letter = _letter(a, encode(record))
    verdict = judge([letter], T, _facts, partitions=PARTITIONS)
    assert (verdict.justified, verdict.violations, verdict.findings) == (1, 0, {})
    # Without the partition count the rule cannot be applied: the record decodes.
    assert judge([letter], T, _facts).violations == 1


def test_a_misplaced_or_misfit_saga_committed_was_rightly_rejected() -> None:
    a, b = _together(2)
    good = encode(StepsCommitted("bank", 5, ((a, 0), (b, 0))))
    raw = json.loads(good)
    letters = [
        _letter(a, good, partition=(partition_for(a, PARTITIONS) + 1) % PARTITIONS),
        _letter(b, good),  # keyed by the second tx_id, not the first
        _letter(a, json.dumps({**raw, "steps": [[a, 0], [a, 0]]}).encode()),  # listed twice
        _letter(a, json.dumps({**raw, "steps": [[a, "0"]]}).encode()),  # not an integer
        _letter(a, json.dumps({**raw, "steps": []}).encode()),  # nothing listed
    ]
    verdict = judge(letters, T, _facts, partitions=PARTITIONS)
    assert (verdict.records, verdict.justified, verdict.invalid) == (5, 2, 3)
    assert verdict.violations == 0


def test_step_events_are_judged_as_before() -> None:
    a = _together(1)[0]
    event = StepEvent(a, 0, "bank", StepStatus.COMMITTED, 5)
    verdict = judge([_letter(a, encode(event))], T, _facts, partitions=PARTITIONS)
    assert list(verdict.findings) == [a]
    assert "valid saga.step" in verdict.findings[a][0]


def test_a_rejected_saga_committed_is_left_out_where_it_sits() -> None:
    a = _together(1)[0]
    letter = _letter(a, encode(StepsCommitted("bank", 5, ((a, 0),))), offset=42)
    assert rejected_at([letter], T) == {T.events: {(partition_for(a, PARTITIONS), 42)}}
