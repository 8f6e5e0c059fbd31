"""Routing headers: a participant skips, undecoded, what is not meant for it (no broker).

The participant ``bank`` runs on the in-memory log with SQLite (the rigs of
``test_participant_runtime_unit`` and ``test_signed_services``). Records meant for
another participant are written with a body that is not even JSON: were it parsed,
it would count as invalid. Covered: the skips of the four kinds of record, the seen
marker of a request skipped undecoded (one payload per transaction still holds),
headerless and malformed-header records decoded as before, the ``saga.for`` and
``saga.parts`` values the participant and the coordinator write, and forgeries:
with keys, a lying header on a forged record only makes that record skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from saga.coordinator._machine import Saga
from saga.coordinator._route import decision_route, event_route
from saga.participants._routing import Router, Seen, Verdict
from saga.streams import (
    Decision,
    KafkaSettings,
    Mode,
    Outcome,
    SagaRequest,
    SagaState,
    Step,
    StepEvent,
    StepStatus,
)
from saga.streams._routing import (
    DEADLINE,
    FINGERPRINT,
    FOR,
    OUTCOME,
    PARTS,
    TYPE,
    seen_fields,
)
from saga.streams.kafka import Message
from saga.streams.testing import InMemoryLog, ManualClock
from tests.unit.test_participant_runtime_unit import move, shop_step

pytestmark = pytest.mark.unit

JUNK = b"\xff not json"
Headers = list[tuple[str, bytes]]


def request(tx: str, clock: ManualClock, steps: Sequence[Step], mode: Mode) -> SagaRequest:
    return SagaRequest(tx, "transfer", mode, tuple(steps), clock() + 60_000, clock())


def send(log: InMemoryLog, topic: str, key: str, value: bytes, headers: Headers | None) -> None:
    with log.producer() as producer:
        producer.produce(topic, key, value, headers)


def headers_of(log: InMemoryLog, topic: str, participant: str) -> list[dict[str, bytes]]:
    """The headers of ``participant``'s records on ``topic`` (events: by the body's name)."""
    out = []
    for m in log.records(topic):
        if m.value is not None and f'"participant":"{participant}"'.encode() in m.value:
            out.append(dict(m.headers))
    return out


# ---------------------------------------------------------------- pure: the header values


def test_the_router_reads_only_the_headers_and_decodes_what_it_cannot_rule_out() -> None:
    router = Router("bank", KafkaSettings(bootstrap="m:1", prefix="p").topics)
    topics = KafkaSettings(bootstrap="m:1", prefix="p").topics

    def screen(topic: str, *headers: tuple[str, bytes], key: bytes = b"t1") -> Verdict | Seen:
        return router.screen(Message(topic, 0, 0, key, JUNK, tuple(headers)))

    assert screen(topics.events) is Verdict.DECODE  # no headers: as before
    assert screen(topics.events, (FOR, b"")) is Verdict.SKIP
    assert screen(topics.events, (FOR, b"shop,ledger")) is Verdict.SKIP
    assert screen(topics.events, (FOR, b"shop,bank")) is Verdict.DECODE
    assert screen(topics.events, (FOR, b"banker")) is Verdict.SKIP  # names, not prefixes
    assert screen(topics.decisions, (OUTCOME, b"commit")) is Verdict.DECODE
    assert screen(topics.decisions, (PARTS, b"shop")) is Verdict.SKIP
    assert screen(topics.decisions, (PARTS, b"bank")) is Verdict.DECODE
    assert screen(topics.requests, (TYPE, b"saga.abort")) is Verdict.SKIP
    assert screen(topics.requests, (TYPE, b"saga.request"), (PARTS, b"bank")) is Verdict.DECODE
    fp, deadline = (FINGERPRINT, b"0" * 32), (DEADLINE, b"123")
    shop_only = ((TYPE, b"saga.request"), (PARTS, b"shop"))
    assert screen(topics.requests, *shop_only, fp, deadline) == Seen("t1", "0" * 32, 123)
    # A seen marker needs all its fields, well formed; else the body is decoded.
    assert screen(topics.requests, *shop_only, fp) is Verdict.DECODE
    assert screen(topics.requests, *shop_only, (FINGERPRINT, b"x" * 32), deadline) is (
        Verdict.DECODE
    )
    assert screen(topics.requests, *shop_only, fp, (DEADLINE, b"-1")) is Verdict.DECODE
    assert screen(topics.requests, *shop_only, fp, deadline, key=b"a b") is Verdict.DECODE


@pytest.mark.parametrize(
    "key, fingerprint, deadline",
    [
        (None, b"a" * 32, b"1"),
        (b"t" * 129, b"a" * 32, b"1"),
        (b"t", b"a" * 31, b"1"),
        (b"t", b"A" * 32, b"1"),
        (b"t", b"a" * 32, b"9" * 19),
        (b"t", b"a" * 32, b""),
        (b"t", b"a" * 32, b"\xff"),
        (b"t\n", b"a" * 32, b"1"),
    ],
)
def test_malformed_seen_fields_are_refused_without_raising(
    key: bytes | None, fingerprint: bytes, deadline: bytes
) -> None:
    assert seen_fields(key, [(FINGERPRINT, fingerprint), (DEADLINE, deadline)]) is None


def test_a_participant_names_the_reader_of_its_events_only_when_it_knows_the_saga() -> None:
    router = Router("bank", KafkaSettings(bootstrap="m:1", prefix="p").topics)
    clock = ManualClock()
    router.remember(request("par", clock, [move(), shop_step()], Mode.PARALLEL))
    router.remember(request("seq", clock, [shop_step(), move(), shop_step()], Mode.SEQUENTIAL))

    def readers(tx: str, step: int, status: StepStatus) -> bytes | None:
        return dict(router.event_route(tx, step, status)).get(FOR)

    assert readers("par", 0, StepStatus.APPLIED) == b""
    assert readers("par", 0, StepStatus.COMPENSATED) == b""
    assert readers("seq", 1, StepStatus.APPLIED) == b"shop"  # the successor acts on it
    assert readers("seq", 1, StepStatus.COMPENSATED) == b"shop"  # the predecessor does
    assert readers("seq", 1, StepStatus.FAILED) == b""  # only the coordinator acts
    assert readers("unknown", 0, StepStatus.APPLIED) is None  # a restart forgot it: no list
    assert readers("unknown", 0, StepStatus.COMMITTED) == b""


def saga(participants: tuple[str, ...], *, request_seen: bool = True) -> Saga:
    return Saga(
        tx_id="t",
        saga="transfer",
        request_seen=request_seen,
        participants=participants,
        steps=(StepStatus.APPLIED,) * len(participants),
        outcome=Outcome.ROLLBACK,
        state=SagaState.ROLLING_BACK,
        reason="r",
        created_ms=0,
        updated_ms=0,
        deadline_ms=1,
        fingerprint="f" if request_seen else None,
    )


def test_a_decision_names_every_participant_with_a_step_when_the_request_was_seen() -> None:
    decision = Decision("t", Outcome.ROLLBACK, "r", 0)
    assert dict(decision_route(decision, saga(("bank", "shop", "bank")))) == {
        OUTCOME: b"rollback",
        PARTS: b"bank,shop",
    }
    assert PARTS not in dict(decision_route(decision, saga(("bank",), request_seen=False)))
    assert PARTS not in dict(decision_route(decision, saga(("bank", "?"))))
    assert PARTS not in dict(decision_route(decision, None))
    voided = StepEvent("t", 1, "ghost", StepStatus.COMPENSATED, 0)
    assert dict(event_route(voided, saga(("bank", "ghost"))))[FOR] == b"bank"


def test_a_participant_with_nothing_to_confirm_may_skip_every_commit() -> None:
    topics = KafkaSettings(bootstrap="m:1", prefix="p").topics
    router = Router("bank", topics, skip_commits=True)

    def screen(*headers: tuple[str, bytes]) -> Verdict | Seen:
        return router.screen(Message(topics.decisions, 0, 0, b"t", JUNK, tuple(headers)))

    assert screen((OUTCOME, b"commit"), (PARTS, b"bank")) is Verdict.SKIP
    assert screen((OUTCOME, b"rollback"), (PARTS, b"bank")) is Verdict.DECODE
    assert screen((OUTCOME, b"rollback")) is Verdict.DECODE


class ConfirmingSaga(Saga):
    """A saga that knows which steps have something to confirm (the commit path's flag)."""

    def confirm_of(self, step: int) -> bool:
        return step == 1


def test_a_commit_names_only_the_participants_with_something_to_confirm_when_known() -> None:
    base = saga(("bank", "shop", "bank"))
    known = ConfirmingSaga(**{f: getattr(base, f) for f in base.__dataclass_fields__})
    commit = Decision("t", Outcome.COMMIT, "all steps applied", 0)
    # Without the per-step flags every step is confirmed; with them, none here said so.
    everyone = b"" if hasattr(Saga, "confirm_of") else b"bank,shop"
    assert dict(decision_route(commit, base))[PARTS] == everyone
    assert dict(decision_route(commit, known))[PARTS] == b"shop"
    rollback = Decision("t", Outcome.ROLLBACK, "r", 0)
    assert dict(decision_route(rollback, known))[PARTS] == b"bank,shop"
