"""The participant runtime and routing headers, on the in-memory log with SQLite.

The rig of ``test_participant_runtime_unit`` (participant ``bank``, one poll at a
time, a manual clock). Records meant for others are skipped undecoded and their
offsets still move; headerless records and records naming this participant are
decoded as before; a sequential neighbour's events reach it through the headers.
The sagas run at isolation ``none`` (see ``submit`` there): the tests read the
store before any decision.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from saga.streams import (
    Decision,
    Isolation,
    Mode,
    Outcome,
    SagaAbort,
    SagaRequest,
    Step,
    StepEvent,
    StepStatus,
    encode,
)
from saga.streams._routing import FOR, PARTS, request_headers, type_headers
from saga.streams.testing import InMemoryLog, ManualClock
from tests.unit.test_participant_runtime_unit import (  # noqa: F401 (fixtures)
    TOPICS,
    Runtimes,
    balance,
    database,
    log,
    move,
    reported,
    runtimes,
    shop_step,
    sqlite_storage,
    tx_on,
)

pytestmark = pytest.mark.unit

JUNK = b"\xff not json"  # a body no reader can parse: a skipped record was never parsed


def routed_request(
    tx: str, clock: ManualClock, steps: Sequence[Step], mode: Mode = Mode.PARALLEL
) -> SagaRequest:
    return SagaRequest(
        tx, "transfer", mode, tuple(steps), clock() + 60_000, clock(), isolation=Isolation.NONE
    )


def send_with(
    log: InMemoryLog,  # noqa: F811
    topic: str,
    key: str,
    value: bytes,
    headers: list[tuple[str, bytes]] | None,
) -> None:
    with log.producer() as producer:
        producer.produce(topic, key, value, headers)


def headers_of(log: InMemoryLog, participant: str) -> list[dict[str, bytes]]:  # noqa: F811
    """The headers of ``participant``'s step events."""
    needle = f'"participant":"{participant}"'.encode()
    return [dict(m.headers) for m in log.records(TOPICS.events) if needle in (m.value or b"")]


def test_records_for_others_are_skipped_undecoded_and_offsets_still_move(
    log: InMemoryLog,  # noqa: F811
    clock: ManualClock,
    runtimes: Runtimes,  # noqa: F811
    database: str,  # noqa: F811
) -> None:
    runtime, stepper = runtimes.start(sqlite_storage(database))
    stepper.step()
    tx = tx_on(0)
    shop_only = routed_request(tx, clock, [shop_step()], Mode.PARALLEL)
    send_with(log, TOPICS.events, tx, JUNK, [(FOR, b"shop")])
    send_with(log, TOPICS.decisions, tx, JUNK, [(PARTS, b"shop")])
    send_with(log, TOPICS.requests, tx, JUNK, type_headers(SagaAbort(tx, "r", 0)))
    send_with(
        log, TOPICS.requests, tx, JUNK, request_headers(shop_only)
    )  # its fields, not its body
    stepper.step()
    assert runtime.stats.routed == 4
    assert runtime.stats.skipped_invalid == 0  # nothing was parsed
    assert runtime.observer.not_mine == 1  # the seen marker of the request
    assert log.committed_offset(
        f"{TOPICS.prefix}.participant.bank", TOPICS.requests, 0
    ) == log.end_offset(TOPICS.requests, 0)
    # One payload per transaction: the marker came from the headers alone, and a
    # conflicting resubmission with a step here is refused as before.
    other = routed_request(tx, clock, [move(), shop_step()], Mode.PARALLEL)
    send_with(log, TOPICS.requests, tx, encode(other), None)
    stepper.step()
    assert reported(log, tx) == [] and balance(database) == 100


def test_headerless_records_and_records_naming_this_participant_are_decoded(
    log: InMemoryLog,  # noqa: F811
    clock: ManualClock,
    runtimes: Runtimes,  # noqa: F811
    database: str,  # noqa: F811
) -> None:
    runtime, stepper = runtimes.start(sqlite_storage(database))
    old, new = tx_on(0, 0), tx_on(1, 1)
    send_with(
        log, TOPICS.requests, old, encode(routed_request(old, clock, [move()], Mode.PARALLEL)), None
    )
    routed = routed_request(new, clock, [move(), shop_step()], Mode.PARALLEL)
    send_with(log, TOPICS.requests, new, encode(routed), request_headers(routed))
    stepper.step()
    assert reported(log, old) == [(0, StepStatus.APPLIED)] == reported(log, new)
    assert balance(database) == 110
    rollback = Decision(old, Outcome.ROLLBACK, "d", clock())
    send_with(log, TOPICS.decisions, old, encode(rollback), None)
    send_with(log, TOPICS.decisions, new, JUNK, [(PARTS, b"shop,bank")])
    stepper.step()
    assert reported(log, old)[-1] == (0, StepStatus.COMPENSATED)
    assert balance(database) == 105
    assert runtime.stats.skipped_invalid == 1  # it was read, not skipped by its headers
    # The participant's own events say who reads them: nobody but the coordinator here.
    assert [h[FOR] for h in headers_of(log, "bank")] == [b"", b"", b""]


def test_a_sequential_neighbours_events_reach_it_through_the_headers(
    log: InMemoryLog,  # noqa: F811
    clock: ManualClock,
    runtimes: Runtimes,  # noqa: F811
    database: str,  # noqa: F811
) -> None:
    _, stepper = runtimes.start(sqlite_storage(database))
    tx = tx_on(1)
    steps = [shop_step(), move(), shop_step()]
    seq = routed_request(tx, clock, steps, Mode.SEQUENTIAL)
    send_with(log, TOPICS.requests, tx, encode(seq), request_headers(seq))
    applied = StepEvent(tx, 0, "shop", StepStatus.APPLIED, clock())
    send_with(log, TOPICS.events, tx, encode(applied), [(FOR, b"bank")])
    stepper.step(2)
    assert reported(log, tx) == [(1, StepStatus.APPLIED)] and balance(database) == 105
    assert headers_of(log, "bank")[-1][FOR] == b"shop"  # step 2's participant
