"""Building a saga request: what :meth:`SagaClient.submit` sends, checked before sending.

Needs no Kafka (a command line checks its input before it connects). The ``tx_id`` is
fixed here, before anything is sent: every submit error carries it, and a retry with
it is the same saga (:class:`~streams.SubmitUncertain`).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from saga.streams import InvalidRecord, Isolation, Mode, SagaRequest, Step, decode, encode
from saga.streams._lifecycle import wall_clock_ms

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "build_request"]

DEFAULT_TIMEOUT_S = 30.0
# A deadline further away than this is a typo, not a plan (and must fit in 64 bits).
MAX_TIMEOUT_S = 1_000_000_000


def _as_step(step: Step | Mapping[str, Any]) -> Step:
    if isinstance(step, Step):
        return step
    try:
        return Step(
            participant=step["participant"], action=step["action"], args=dict(step.get("args", {}))
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidRecord(
            f"a step must be an object with 'participant', 'action' and 'args', got {step!r}"
        ) from exc


def _timeout_ms(timeout: Any) -> int:
    """``timeout`` seconds in milliseconds; a readable :class:`InvalidRecord` unless it is a
    finite positive number of at most :data:`MAX_TIMEOUT_S`."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidRecord(
            f"timeout must be a number of seconds, got {type(timeout).__name__} {timeout!r}"
        )
    if not math.isfinite(timeout) or timeout <= 0:
        raise InvalidRecord(f"timeout must be a positive finite number of seconds, got {timeout!r}")
    if timeout > MAX_TIMEOUT_S:
        raise InvalidRecord(
            f"timeout must be at most {MAX_TIMEOUT_S:,} seconds (about 31 years), got {timeout!r}"
        )
    return int(timeout * 1000)


def build_request(
    steps: Sequence[Step | Mapping[str, Any]],
    *,
    saga: str = "saga",
    mode: Mode | str = Mode.PARALLEL,
    isolation: Isolation | str = Isolation.READ_COMMITTED,
    timeout: float = DEFAULT_TIMEOUT_S,
    tx_id: str | None = None,
    meta: Mapping[str, Any] | None = None,
    now_ms: int | None = None,
) -> SagaRequest:
    """The request :meth:`SagaClient.submit` would send, checked against the wire contract.

    Needs no Kafka, so a command line can check its input before it connects.
    Raises :class:`InvalidRecord` with a readable reason for bad input.
    """
    try:
        mode = Mode(mode)
    except ValueError as exc:
        raise InvalidRecord(f"mode must be 'parallel' or 'sequential', got {mode!r}") from exc
    try:
        isolation = Isolation(isolation)
    except ValueError as exc:
        raise InvalidRecord(
            f"isolation must be 'read_committed' or 'none', got {isolation!r}"
        ) from exc
    created = wall_clock_ms() if now_ms is None else now_ms
    deadline_ms = created + _timeout_ms(timeout)
    if meta is not None and not isinstance(meta, Mapping):
        raise InvalidRecord(
            f"meta must be an object of names to values (or absent), got {type(meta).__name__}"
        )
    if isinstance(steps, str | bytes | Mapping) or not isinstance(steps, Iterable):
        raise InvalidRecord(
            "steps must be a list of {participant, action, args} objects, got "
            f"{type(steps).__name__}"
        )
    request = SagaRequest(
        tx_id=tx_id if tx_id is not None else uuid.uuid4().hex,
        saga=saga,
        mode=mode,
        steps=tuple(_as_step(s) for s in steps),
        deadline_ms=deadline_ms,
        created_ms=created,
        meta=meta,
        isolation=isolation,
    )
    # Round-trip through the codec: the one place that enforces the contract.
    checked = decode(encode(request))
    assert isinstance(checked, SagaRequest)
    return checked
