"""Poison records for every input topic: each breaks the wire contract in its own way.

Some are harmless garbage (not JSON, not UTF-8, a tombstone); others are valid
records that would do damage if a consumer acted on them: a request that moves
money from a hot account, or a step event or a rollback for a real transaction
in flight, each keyed by another transaction (so consumers must ignore it, and
the coordinator must move it to the DLQ). A ``saga.committed`` record (steps a
participant committed) is poison too when keyed by another transaction, when it
lists no step, or when it lists a transaction of another partition than its key's
(:func:`misplaced_ack`): the coordinator moves the whole record to the DLQ.

With signed records (the suite's default) poison goes out unsigned, and
:func:`forged` adds records that are well formed but not signed by one allowed to
write them (the hostile profile): a step event and a ``saga.committed`` signed by
another participant, a rollback decision signed by the client, a decision changed
after the coordinator signed it, aborts signed by a stranger's key and by a
participant, and a final status signed by the client, each for a real transaction
in flight: the coordinator (which with keys reads the status topic too) moves each
to the DLQ, and nobody acts on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from saga.streams import (
    Decision,
    Outcome,
    SagaAbort,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepsCommitted,
    StepStatus,
    encode,
)
from saga.streams._records import Mode
from saga.streams._signing import Keyring
from saga.streams.kafka import partition_for
from tests.chaos.workload import FIELD, PARTICIPANTS, TARGET

Poison = tuple[str, str, str | None, bytes | None]  # (label, topic kind, key, value)


def _request(tx_id: str, now_ms: int) -> dict[str, Any]:
    request = SagaRequest(
        tx_id=tx_id,
        saga="poison",
        mode=Mode.PARALLEL,
        steps=(
            Step(
                PARTICIPANTS["sql"],
                "increment",
                {"target": TARGET, "key": "h0", "field": FIELD, "by": -7, "min": 0},
            ),
            Step(
                PARTICIPANTS["redis"],
                "increment",
                {"target": TARGET, "key": "h0", "field": FIELD, "by": 7},
            ),
        ),
        deadline_ms=now_ms + 3_600_000,
        created_ms=now_ms,
    )
    data: dict[str, Any] = orjson.loads(encode(request))
    return data


def batch(tag: str, real_tx: str, now_ms: int) -> list[Poison]:
    """One poison record of each kind; ``real_tx`` is a transaction of the run in flight."""
    p = f"poison-{tag}"
    valid = _request(f"{p}-r", now_ms)
    applied = encode(StepEvent(real_tx, 1, PARTICIPANTS["redis"], StepStatus.APPLIED, now_ms))
    rollback = encode(Decision(real_tx, Outcome.ROLLBACK, "step 0 failed: forged", now_ms))
    ack = encode(StepsCommitted(PARTICIPANTS["redis"], now_ms, ((real_tx, 1),)))
    return [
        (
            "request: invalid JSON",
            "requests",
            f"{p}-json",
            b'{"v": 1, "type": "saga.request", "tx_',
        ),
        ("request: not UTF-8", "requests", f"{p}-utf8", b"\xff\xfe\xfa\x00\x80 not text \xc3\x28"),
        ("request: tombstone", "requests", f"{p}-tomb", None),
        (
            "request: no steps",
            "requests",
            f"{p}-nosteps",
            orjson.dumps({**valid, "tx_id": f"{p}-nosteps", "steps": []}),
        ),
        (
            "request: unknown field",
            "requests",
            f"{p}-field",
            orjson.dumps({**valid, "tx_id": f"{p}-field", "evil": 1}),
        ),
        ("request: keyed by another tx", "requests", f"{p}-other", orjson.dumps(valid)),
        ("request: a step event", "requests", real_tx, applied),
        ("event: invalid JSON", "events", f"{p}-ejson", b'{"v": 1, "type": "saga.st'),
        (
            "event: unknown status",
            "events",
            real_tx,
            orjson.dumps({**orjson.loads(applied), "status": "teleported"}),
        ),
        ("event: a request", "events", f"{p}-r", orjson.dumps(valid)),
        ("event: keyed by another tx", "events", f"{p}-other", applied),
        ("event: saga.committed keyed by another tx", "events", f"{p}-other", ack),
        (
            "event: saga.committed without steps",
            "events",
            real_tx,
            orjson.dumps({**orjson.loads(ack), "steps": []}),
        ),
        ("decision: not UTF-8", "decisions", real_tx, b"\x80\x81\x82 rollback"),
        (
            "decision: unknown outcome",
            "decisions",
            real_tx,
            orjson.dumps({**orjson.loads(rollback), "outcome": "maybe"}),
        ),
        ("decision: keyed by another tx", "decisions", f"{p}-other", rollback),
        ("decision: a step event", "decisions", real_tx, applied),
        *hostile(p, valid, real_tx, now_ms),
    ]


def _deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def hostile(p: str, valid: dict[str, Any], real_tx: str, now_ms: int) -> list[Poison]:
    """Records that once stopped a process for good: deep, huge, out of range, trailing."""
    step = valid["steps"][0]
    marked = {**valid, "steps": [{**step, "args": {**step["args"], "x": "@"}}]}

    def request(tx: str, **fields: Any) -> bytes:
        return orjson.dumps({**marked, "tx_id": tx, **fields})

    failed = {
        "v": 1,
        "type": "saga.step",
        "tx_id": real_tx,
        "step": 0,
        "participant": PARTICIPANTS["sql"],
        "status": "failed",
        "at_ms": now_ms,
    }
    abort = {"v": 1, "type": "saga.abort", "tx_id": real_tx, "at_ms": now_ms}
    return [
        (
            "request: args nested 300 levels",
            "requests",
            f"{p}-deep",
            request(f"{p}-deep").replace(b'"@"', _deep(300)),
        ),
        (
            "request: args nested 600 levels",
            "requests",
            f"{p}-deeper",
            request(f"{p}-deeper").replace(b'"@"', _deep(600)),
        ),
        (
            "request: meta nested 40 levels",
            "requests",
            f"{p}-meta",
            request(f"{p}-meta", meta={"m": "@"}).replace(b'"@"', _deep(40)),
        ),
        ("request: 1 MB of x", "requests", f"{p}-big", b"x" * 1_040_000),
        (
            "request: integer beyond 64 bits",
            "requests",
            f"{p}-bigint",
            request(f"{p}-bigint").replace(b'"@"', b"1180591620717411303425"),
        ),
        (
            "request: trailing bytes",
            "requests",
            f"{p}-trail",
            request(f"{p}-trail").replace(b'"@"', b"1") + b" trailing",
        ),
        (
            "request: two objects",
            "requests",
            f"{p}-two",
            request(f"{p}-two").replace(b'"@"', b"1") * 2,
        ),
        (
            "request: tx_id ending in a newline",
            "requests",
            f"{p}-nl\n",
            request(f"{p}-nl\n").replace(b'"@"', b"1"),
        ),
        (
            "abort: 1 MB reason",
            "requests",
            real_tx,
            orjson.dumps({**abort, "reason": "r" * 1_030_000}),
        ),
        (
            "abort: reason over the limit",
            "requests",
            real_tx,
            orjson.dumps({**abort, "reason": "r" * 1001}),
        ),
        (
            "event: failed, 1 MB reason",
            "events",
            real_tx,
            orjson.dumps({**failed, "reason": "f" * 1_030_000}),
        ),
        (
            "event: failed, reason over the limit",
            "events",
            real_tx,
            orjson.dumps({**failed, "reason": "f" * 5000}),
        ),
        ("decision: 1 MB of {", "decisions", real_tx, b"{" * 1_040_000),
    ]


def misplaced(tag: str, now_ms: int) -> list[Poison]:
    """Valid requests that move money, each to be sent to a partition not its key's."""
    tx = f"poison-{tag}-wrong-partition"
    return [("request: on the wrong partition", "requests", tx, orjson.dumps(_request(tx, now_ms)))]


def misplaced_ack(tag: str, real_tx: str, now_ms: int, partitions: int) -> list[Poison]:
    """A ``saga.committed`` keyed ``real_tx`` (on its partition) that also lists a
    transaction of another partition: none with a single partition."""
    here = partition_for(real_tx, partitions)
    other = next(
        (
            tx
            for tx in (f"poison-{tag}-elsewhere-{i}" for i in range(1000))
            if partition_for(tx, partitions) != here
        ),
        None,
    )
    if other is None:
        return []
    ack = StepsCommitted(PARTICIPANTS["redis"], now_ms, ((real_tx, 1), (other, 0)))
    label = "event: saga.committed listing another partition's tx"
    return [(label, "events", real_tx, encode(ack))]


Forged = tuple[str, str, str, bytes, list[tuple[str, bytes]]]
"""(label, topic kind, key, value, headers): a well-formed record with a bad signature."""

FORGED_IN_DLQ = ("events", "decisions", "requests", "status")
"""The kinds of forged records the coordinator reads, so moves to the DLQ."""


def forged(
    real_tx: str,
    now_ms: int,
    signers: Mapping[str, Keyring],
    topics: Mapping[str, str],
) -> list[Forged]:
    """Forged records for ``real_tx`` (in flight). ``signers``: keyrings by principal,
    ``stranger`` a key the folder does not know; ``topics``: topic names by kind."""

    def signed(by: str, kind: str, value: bytes) -> list[tuple[str, bytes]]:
        return signers[by].sign(topics[kind], real_tx, value)

    applied = encode(StepEvent(real_tx, 1, PARTICIPANTS["redis"], StepStatus.APPLIED, now_ms))
    ack = encode(StepsCommitted(PARTICIPANTS["redis"], now_ms, ((real_tx, 1),)))
    rollback = encode(Decision(real_tx, Outcome.ROLLBACK, "step 0 failed: forged", now_ms))
    tampered = encode(Decision(real_tx, Outcome.ROLLBACK, "step 0 failed: genuine", now_ms))
    abort = encode(SagaAbort(real_tx, "forged abort", now_ms))
    status = encode(
        SagaStatus(
            tx_id=real_tx,
            saga="transfer",
            state=SagaState.ROLLED_BACK,
            steps=(),
            reason="forged",
            created_ms=now_ms,
            updated_ms=now_ms,
            deadline_ms=now_ms,
        )
    )
    other = f"participant-{PARTICIPANTS['sql']}"
    return [
        (
            "forged: applied event signed by another participant",
            "events",
            real_tx,
            applied,
            signed(other, "events", applied),
        ),
        (
            "forged: saga.committed signed by another participant",
            "events",
            real_tx,
            ack,
            signed(other, "events", ack),
        ),
        (
            "forged: rollback decision signed by the client",
            "decisions",
            real_tx,
            rollback,
            signed("client", "decisions", rollback),
        ),
        (
            "forged: decision changed after the coordinator signed it",
            "decisions",
            real_tx,
            tampered.replace(b"genuine", b"forged!"),
            signed("coordinator", "decisions", tampered),
        ),
        (
            "forged: abort signed by a stranger's key",
            "requests",
            real_tx,
            abort,
            signed("stranger", "requests", abort),
        ),
        (
            "forged: abort signed by a participant",
            "requests",
            real_tx,
            abort,
            signed(other, "requests", abort),
        ),
        (
            "forged: final status signed by the client",
            "status",
            real_tx,
            status,
            signed("client", "status", status),
        ),
    ]
