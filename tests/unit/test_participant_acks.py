"""A participant acknowledges a batch's commits together: one saga.committed per partition."""

from __future__ import annotations

import pytest

from saga.participants._acks import ACKS_PER_RECORD, acknowledgements
from saga.participants._work import Report
from saga.streams import StepsCommitted, StepStatus
from saga.streams.testing import key_on

pytestmark = pytest.mark.unit

PARTITIONS = 4


def test_commits_go_together_per_partition_and_everything_else_as_events() -> None:
    a, b, c = key_on(0, PARTITIONS), key_on(0, PARTITIONS, 1), key_on(2, PARTITIONS)
    applied = Report(a, 1, StepStatus.APPLIED, confirm=True)
    refused = Report(b, 2, StepStatus.COMPENSATION_FAILED, "commit refused", parked=True)
    compensated = Report(c, 0, StepStatus.COMPENSATED)
    reports = [
        Report(a, 0, StepStatus.COMMITTED),
        applied,
        Report(c, 3, StepStatus.COMMITTED),
        refused,
        Report(b, 0, StepStatus.COMMITTED),
        compensated,
        Report(a, 0, StepStatus.COMMITTED),  # a repeat: listed once
    ]
    events, acks = acknowledgements("bank", 7, reports, PARTITIONS)
    assert events == [applied, refused, compensated]
    assert [ack for ack, _ in acks] == [
        StepsCommitted("bank", 7, ((a, 0), (b, 0))),
        StepsCommitted("bank", 7, ((c, 3),)),
    ]
    # a record of one saga's steps carries its report (the saga's trace context)
    assert [single for _, single in acks] == [None, Report(c, 3, StepStatus.COMMITTED)]
    _, acks = acknowledgements(
        "bank",
        7,
        [Report(a, 0, StepStatus.COMMITTED), Report(a, 2, StepStatus.COMMITTED)],
        PARTITIONS,
    )
    assert acks == [
        (StepsCommitted("bank", 7, ((a, 0), (a, 2))), Report(a, 0, StepStatus.COMMITTED))
    ]


def test_a_large_batch_is_split_into_records_of_at_most_the_limit() -> None:
    txs = [key_on(1, PARTITIONS, n) for n in range(ACKS_PER_RECORD + 3)]
    reports = [Report(tx, 0, StepStatus.COMMITTED) for tx in txs]
    events, acks = acknowledgements("bank", 7, reports, PARTITIONS)
    assert events == []
    assert [len(ack.steps) for ack, _ in acks] == [ACKS_PER_RECORD, 3]
    assert [tx for ack, _ in acks for tx, _ in ack.steps] == txs
    assert all(ack.tx_id == ack.steps[0][0] for ack, _ in acks)
