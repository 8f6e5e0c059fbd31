"""Poison records for every input topic: each breaks the wire contract in its own way.

Some are harmless garbage (not JSON, not UTF-8, a tombstone); others are valid
records that would do damage if a consumer acted on them: a request that moves
money from a hot account, or a step event or a rollback for a real transaction
in flight, each keyed by another transaction (so consumers must ignore it, and
the coordinator must move it to the DLQ).
"""

from __future__ import annotations

from typing import Any

import orjson

from streams import Decision, Outcome, SagaRequest, Step, StepEvent, StepStatus, encode
from streams._records import Mode
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
        ("decision: not UTF-8", "decisions", real_tx, b"\x80\x81\x82 rollback"),
        (
            "decision: unknown outcome",
            "decisions",
            real_tx,
            orjson.dumps({**orjson.loads(rollback), "outcome": "maybe"}),
        ),
        ("decision: keyed by another tx", "decisions", f"{p}-other", rollback),
        ("decision: a step event", "decisions", real_tx, applied),
    ]
