"""The ledger's one codec and the Redis ledger's key layout, shared by every reader.

A ledger entry (:class:`~participants._barrier.LedgerEntry`) is stored as the
plain, JSON-ready mapping :func:`entry_fields` returns (SQL: one column per
field; Redis: the JSON text of :func:`entry_json`; MongoDB: document fields) and
read back by :func:`entry_of`. The transaction-level markers are entries too,
with the reserved steps :data:`MARKER_STEP` (a rollback arrived before this
participant knew its steps) and :data:`SEEN_STEP` (a request with no step here;
it keeps the request's fingerprint); :func:`rolled_back_marker` and
:func:`seen_marker` build them.

The Redis key layout (:class:`RedisLedgerKeys`, :func:`redis_ledger_pattern`,
:func:`redis_tx_key_parts`, :func:`step_of_field`) is read by the Redis adapter
and by the reconciliation job (``streams.reconcile._sources``), so it is written
here once. This module imports no driver.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from saga.participants._barrier import LedgerEntry, LedgerStatus
from saga.streams import Mode

MARKER_STEP: Final = -1
"""The step of the transaction-level rollback marker."""
SEEN_STEP: Final = -2
"""The step of the transaction-level *seen* marker (a request without a step here)."""
ROLLED_BACK_REASON: Final = "rolled back before this participant saw the request"

ENTRY_FIELDS: Final = (
    "tx_id",
    "step",
    "status",
    "action",
    "args",
    "mode",
    "n_steps",
    "deadline_ms",
    "effect",
    "before",
    "reason",
    "rollback_pending",
    "successor_compensated",
    "updated_ms",
    "fingerprint",
)
"""The fields of a stored entry, in the order :func:`entry_fields` gives them."""


def rolled_back_marker(tx_id: str, now_ms: int) -> LedgerEntry:
    """The marker of a rollback that arrived before this participant knew its steps."""
    return LedgerEntry(
        tx_id=tx_id,
        step=MARKER_STEP,
        status=LedgerStatus.COMPENSATED,
        reason=ROLLED_BACK_REASON,
        updated_ms=now_ms,
    )


def seen_marker(tx_id: str, *, fingerprint: str, deadline_ms: int, now_ms: int) -> LedgerEntry:
    """The marker of a request in which this participant has no step."""
    return LedgerEntry(
        tx_id=tx_id,
        step=SEEN_STEP,
        status=LedgerStatus.SEEN,
        deadline_ms=deadline_ms,
        updated_ms=now_ms,
        fingerprint=fingerprint,
    )


def plain(value: Any) -> Any:
    """A deep copy of ``value`` made of dicts and lists (mappings and tuples converted)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def entry_fields(entry: LedgerEntry) -> dict[str, Any]:
    """``entry`` as a JSON-ready mapping of :data:`ENTRY_FIELDS`."""
    return {
        "tx_id": entry.tx_id,
        "step": entry.step,
        "status": str(entry.status),
        "action": entry.action,
        "args": None if entry.args is None else plain(entry.args),
        "mode": str(entry.mode),
        "n_steps": entry.n_steps,
        "deadline_ms": entry.deadline_ms,
        "effect": entry.effect,
        "before": plain(entry.before),
        "reason": entry.reason,
        "rollback_pending": entry.rollback_pending,
        "successor_compensated": entry.successor_compensated,
        "updated_ms": entry.updated_ms,
        "fingerprint": entry.fingerprint,
    }


def entry_of(fields: Mapping[str, Any]) -> LedgerEntry:
    """The entry stored as ``fields`` (extra fields ignored; an entry from before
    fingerprints existed has none)."""
    return LedgerEntry(
        tx_id=fields["tx_id"],
        step=fields["step"],
        status=LedgerStatus(fields["status"]),
        action=fields["action"],
        args=fields["args"],
        mode=Mode(fields["mode"]),
        n_steps=fields["n_steps"],
        deadline_ms=fields["deadline_ms"],
        effect=bool(fields["effect"]),
        before=fields["before"],
        reason=fields["reason"],
        rollback_pending=bool(fields["rollback_pending"]),
        successor_compensated=bool(fields["successor_compensated"]),
        updated_ms=fields["updated_ms"],
        fingerprint=fields.get("fingerprint"),
    )


def entry_json(entry: LedgerEntry) -> str:
    """``entry`` as compact JSON text (the Redis ledger's hash values)."""
    return json.dumps(entry_fields(entry), separators=(",", ":"))


def entry_of_json(text: str) -> LedgerEntry:
    """The inverse of :func:`entry_json`."""
    return entry_of(json.loads(text))


# ---------------------------------------------------------------- Redis key layout

MARKER_FIELD: Final = "rolled_back"
"""The Redis ledger hash field of the rollback marker."""
SEEN_FIELD: Final = "seen"
"""The Redis ledger hash field of the seen marker."""
_TX_PART: Final = ":tx:"


def redis_ledger_head(prefix: str) -> str:
    """What every Redis ledger key starts with: ``<prefix>:ledger:``."""
    return f"{prefix}:ledger:"


def redis_ledger_pattern(prefix: str) -> str:
    """The ``SCAN`` pattern of every participant's transaction hashes under ``prefix``."""
    return f"{redis_ledger_head(prefix)}*{_TX_PART}*"


def redis_tx_key_parts(prefix: str, key: str) -> tuple[str, str] | None:
    """``(participant, tx_id)`` of a transaction hash key, or ``None`` for another key."""
    head = redis_ledger_head(prefix)
    if not key.startswith(head):
        return None
    participant, found, tx_id = key[len(head) :].partition(_TX_PART)
    return (participant, tx_id) if found else None


def field_of_step(step: int) -> str:
    """The hash field of ``step`` (a step number, or a marker's reserved step)."""
    return {MARKER_STEP: MARKER_FIELD, SEEN_STEP: SEEN_FIELD}.get(step, str(step))


def step_of_field(field: str) -> int | None:
    """The step a hash field holds; ``None`` for a marker."""
    return int(field) if field.isdigit() else None


@dataclass(frozen=True, slots=True)
class RedisLedgerKeys:
    """The keys of one participant's ledger in Redis::

    <prefix>:ledger:<participant>:tx:<tx_id>      a hash: step -> entry (JSON), and the
                                                  markers "rolled_back" and "seen"
    <prefix>:ledger:<participant>:in_flight       a set: sequential transactions with a
                                                  step that may wait for a neighbour
    <prefix>:ledger:<participant>:finished        a sorted set: transactions that may be
                                                  finished, scored by when (for pruning)
    <prefix>:ledger:<participant>:finished_ready  set once the sorted set covers every
                                                  transaction
    """

    prefix: str
    participant: str

    @property
    def head(self) -> str:
        return f"{redis_ledger_head(self.prefix)}{self.participant}"

    def tx(self, tx_id: str) -> str:
        """The hash of transaction ``tx_id`` (``"*"`` gives the ``SCAN`` pattern of all)."""
        return f"{self.head}{_TX_PART}{tx_id}"

    @property
    def in_flight(self) -> str:
        return f"{self.head}:in_flight"

    @property
    def finished(self) -> str:
        return f"{self.head}:finished"

    @property
    def finished_ready(self) -> str:
        return f"{self.finished}_ready"
