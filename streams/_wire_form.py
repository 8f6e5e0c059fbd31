"""The JSON object form of each wire record: what :func:`streams._codec.encode` writes.

One function per record type turns a frozen record into the plain dict its schema
describes (``streams/schemas/<type>.schema.json``); :func:`to_dict` picks the right
one. Nothing here validates or serialises: :mod:`streams._codec` checks the dict
against the schema and the limits, then writes it as JSON, so that decoding and
encoding keep one set of rules.

Contract: optional fields are left out when unset (``meta``, a step event's
``reason``, ``fingerprint``, ``confirm`` when false), so a record without them is
byte for byte what older writers produced; nested ``args`` and ``meta`` are the
record's own objects, not copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from saga.streams._records import (
    WIRE_VERSION,
    Decision,
    ParticipantAnnouncement,
    Record,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    SagaStatus,
    StepEvent,
    StepProgress,
    StepsCommitted,
)

__all__ = ["to_dict"]


def _request_dict(r: SagaRequest) -> dict[str, Any]:
    data: dict[str, Any] = {
        "v": WIRE_VERSION,
        "type": r.TYPE,
        "tx_id": r.tx_id,
        "saga": r.saga,
        "mode": str(r.mode),
        "steps": [
            {
                "participant": s.participant,
                "action": s.action,
                # The schema wants a JSON object; any other Mapping becomes one.
                "args": s.args if isinstance(s.args, dict) else dict(s.args),
            }
            for s in r.steps
        ],
        "deadline_ms": r.deadline_ms,
        "created_ms": r.created_ms,
        # Always written: a reader older than isolation levels rejects the request to
        # its DLQ (an unknown field) instead of running it without isolation.
        "isolation": str(r.isolation),
    }
    if r.meta is not None:
        data["meta"] = r.meta if isinstance(r.meta, dict) else dict(r.meta)
    return data


def _abort_dict(r: SagaAbort) -> dict[str, Any]:
    data: dict[str, Any] = {
        "v": WIRE_VERSION,
        "type": r.TYPE,
        "tx_id": r.tx_id,
        "reason": r.reason,
        "at_ms": r.at_ms,
    }
    if r.by is not None:
        data["by"] = r.by
    return data


def _resolve_dict(r: SagaResolve) -> dict[str, Any]:
    return {
        "v": WIRE_VERSION,
        "type": r.TYPE,
        "tx_id": r.tx_id,
        "step": r.step,
        "note": r.note,
        "by": r.by,
        "at_ms": r.at_ms,
    }


def _step_dict(r: StepEvent) -> dict[str, Any]:
    data: dict[str, Any] = {
        "v": WIRE_VERSION,
        "type": r.TYPE,
        "tx_id": r.tx_id,
        "step": r.step,
        "participant": r.participant,
        "status": str(r.status),
        "at_ms": r.at_ms,
    }
    if r.reason is not None:
        data["reason"] = r.reason
    if r.confirm:  # absent when false: such an event is byte for byte what it always was
        data["confirm"] = True
    return data


def _committed_dict(r: StepsCommitted) -> dict[str, Any]:
    return {
        "v": WIRE_VERSION,
        "type": r.TYPE,
        "participant": r.participant,
        "at_ms": r.at_ms,
        "steps": [[tx_id, step] for tx_id, step in r.steps],
    }


def _decision_dict(r: Decision) -> dict[str, Any]:
    return {
        "v": WIRE_VERSION,
        "type": r.TYPE,
        "tx_id": r.tx_id,
        "outcome": str(r.outcome),
        "reason": r.reason,
        "at_ms": r.at_ms,
    }


def _status_dict(r: SagaStatus) -> dict[str, Any]:
    data: dict[str, Any] = {
        "v": WIRE_VERSION,
        "type": r.TYPE,
        "tx_id": r.tx_id,
        "saga": r.saga,
        "state": str(r.state),
        "steps": [_progress_dict(s) for s in r.steps],
        "reason": r.reason,
        "created_ms": r.created_ms,
        "updated_ms": r.updated_ms,
        "deadline_ms": r.deadline_ms,
    }
    if r.fingerprint is not None:
        data["fingerprint"] = r.fingerprint
    return data


def _progress_dict(s: StepProgress) -> dict[str, Any]:
    data: dict[str, Any] = {"participant": s.participant, "status": str(s.status)}
    if s.confirm:
        data["confirm"] = True
    return data


def _announcement_dict(r: ParticipantAnnouncement) -> dict[str, Any]:
    data: dict[str, Any] = {"v": WIRE_VERSION, "type": r.TYPE, "name": r.name}
    data |= {"storage": str(r.storage), "targets": list(r.targets), "version": r.version}
    data |= {"instance": r.instance, "started_ms": r.started_ms, "heartbeat_ms": r.heartbeat_ms}
    data |= {"interval_ms": r.interval_ms, "state": str(r.state)}
    if r.host is not None:
        data["host"] = r.host
    return data


# Keyed by the exact class: records are final, and an exact lookup is faster
# than a chain of isinstance checks.
_TO_DICT: Final[dict[type, Callable[[Any], dict[str, Any]]]] = {
    SagaRequest: _request_dict,
    SagaAbort: _abort_dict,
    SagaResolve: _resolve_dict,
    StepEvent: _step_dict,
    StepsCommitted: _committed_dict,
    Decision: _decision_dict,
    SagaStatus: _status_dict,
    ParticipantAnnouncement: _announcement_dict,
}


def to_dict(record: Record) -> dict[str, Any]:
    """Return the JSON object form of ``record``, as :func:`encode` writes it.

    Enums become their string values; ``meta``, a step event's ``reason`` and
    ``fingerprint`` are left out when ``None``. Nested ``args`` and ``meta``
    dicts are the record's own objects, not copies: do not change them.
    The result is not validated (see :func:`encode`).

    Raises:
        TypeError: ``record`` is not one of the wire record classes.
    """
    try:
        convert = _TO_DICT[type(record)]
    except KeyError:
        raise TypeError(f"{type(record).__name__} is not a saga wire record") from None
    return convert(record)
