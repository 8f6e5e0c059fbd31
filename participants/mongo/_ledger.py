"""The MongoDB ledger's documents: their ids, what a unit knows of one transaction
(:class:`_TxView`), and ledger entries as step-document fields and back.

The layout is described in :mod:`saga.participants.mongo`;
:mod:`streams.reconcile._sources` reads these documents too.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from saga.participants._barrier import LedgerEntry, LedgerStatus, finished_ms, isolation_of
from saga.participants._ledger import entry_fields, entry_of
from saga.participants.mongo._values import Document, _plain
from saga.streams import TX_ID_PATTERN, InvalidRecord, Isolation

PARTICIPANT_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""Participant names as the wire contract allows them (no ``:``: it separates ledger ids)."""


TX_COLLECTION_SUFFIX: Final = "_tx"
"""The transaction documents live in the ledger collection's name plus this suffix."""


_TX_ID: Final = re.compile(TX_ID_PATTERN)


def _step_id(participant: str, tx_id: str, step: int) -> str:
    return f"{participant}:{tx_id}:{step}"


def _tx_doc_id(participant: str, tx_id: str) -> str:
    return f"{participant}:{tx_id}"


DECISION_SUFFIX: Final = "/d"
"""A decision document's ``_id`` is its step document's plus this suffix (see
:func:`_decision_doc`)."""


def _decision_id(step_id: str) -> str:
    return f"{step_id}{DECISION_SUFFIX}"


def _split_step_id(step_id: str) -> tuple[str, str, int] | None:
    participant, sep, rest = step_id.partition(":")
    tx_id, sep2, step = rest.rpartition(":")
    if not sep or not sep2 or not _TX_ID.fullmatch(tx_id):
        return None
    try:
        return participant, tx_id, int(step)
    except ValueError:
        return None


def _pending_key(step: int) -> str:
    """The key of a step's creation intent in the transaction document's ``pending``."""
    return f"s{step}"


@dataclass(slots=True)
class _TxView:
    """What a unit knows of one transaction's ledger documents at one participant.

    ``doc`` is the transaction document (``None``: absent). ``steps`` holds the
    step documents known (``None``: absent). ``speculative``: ``doc`` was assumed
    absent without reading (a request for a transaction this storage does not
    know); inserting the transaction document checks the assumption.
    """

    participant: str
    tx_id: str
    doc: Document | None
    steps: dict[int, Document | None] = field(default_factory=dict)
    speculative: bool = False

    @property
    def doc_id(self) -> str:
        return _tx_doc_id(self.participant, self.tx_id)

    def step_id(self, step: int) -> str:
        return _step_id(self.participant, self.tx_id, step)

    def listed(self, step: int) -> bool:
        return self.doc is not None and step in self.doc.get("steps", ())

    def creation(self, step: int) -> Document | None:
        """The intent creating ``step``, if the transaction document holds one."""
        pending = (self.doc or {}).get("pending") or {}
        intent: Document | None = pending.get(_pending_key(step))
        return intent


def _entry_fields(entry: LedgerEntry) -> Document:
    """A step document's entry fields: the ledger's one codec
    (:func:`participants._ledger.entry_fields`) without ``tx_id`` and ``step`` (the
    document's own fields), ``args`` and ``before`` as JSON text (MongoDB field
    names may not contain ``.`` or ``$``), plus ``last`` and ``finished_ms``."""
    fields = entry_fields(entry)
    del fields["tx_id"], fields["step"]
    fields["args"] = None if entry.args is None else json.dumps(fields["args"])
    fields["before"] = json.dumps(fields["before"])
    fields["last"] = entry.step >= entry.n_steps - 1
    fields["finished_ms"] = finished_ms(entry)
    return fields


def _finished_ms(entry: LedgerEntry) -> int | None:
    """When the entry's transaction finished here for pruning
    (:func:`participants._barrier.finished_ms`), except that a ``read_committed`` step still
    applied has not: it holds or reserves a document until its decision, and pruning must
    never drop that. (Its document still carries ``finished_ms``, so that a decision can
    record itself without changing it: see :func:`_decision_doc`.)"""
    if entry.status is LedgerStatus.APPLIED and (
        isolation_of(entry.before) is Isolation.READ_COMMITTED
    ):
        return None
    return finished_ms(entry)


def _decision_doc(step: Mapping[str, Any], changed: Document, finished: int) -> Document:
    """The **decision document** recording the decision of an applied step whose write
    was idempotent (``BatchWrites.defer_decision``): the entry fields ``changed`` and
    ``finished_ms``, applying to step document ``step`` at its ``rev``.

    A batch inserts its decision documents together, with one ``insert_many``, instead
    of updating each step document: FerretDB spends about 1.4 ms of server CPU on an
    update by ``_id`` and under 0.1 ms per document of a batched insert. Readers of a
    step document read it through :func:`_decided`."""
    return {
        "_id": _decision_id(step["_id"]),
        "participant": step["participant"],
        "tx_id": step["tx_id"],
        "decides": step["step"],
        "rev": step["rev"],
        "set": changed,
        "finished_ms": finished,
    }


def _decided(doc: Document, decision: Mapping[str, Any] | None) -> Document:
    """Step document ``doc`` with its decision document applied, if ``decision`` was made on
    ``doc``'s revision (a later change of the step document holds the whole entry)."""
    if decision is None or decision.get("rev") != doc.get("rev"):
        return doc
    merged = {**doc, **(decision.get("set") or {})}
    finished = decision.get("finished_ms")
    if finished is not None:
        merged["finished_ms"] = max(int(doc.get("finished_ms") or 0), int(finished))
    return merged


def _may_be_decided(doc: Mapping[str, Any] | None) -> bool:
    """Whether a decision document may apply to step document ``doc``: only an applied
    step's decision is recorded so (see :func:`_decision_doc`)."""
    if doc is None or doc.get("pending") is not None:
        return False
    return bool(doc.get("status") == LedgerStatus.APPLIED.value)


def _find_step(ledger: Any, step_id: str, session: Any = None) -> Document | None:
    """Step document ``step_id`` of collection ``ledger`` as stored, with its decision
    document applied (:func:`_decided`)."""
    doc: Document | None = ledger.find_one({"_id": step_id}, session=session)
    if doc is not None and _may_be_decided(doc):
        decision = ledger.find_one({"_id": _decision_id(step_id)}, session=session)
        doc = _decided(doc, decision)
    return doc


def _entry_of(doc: Mapping[str, Any]) -> LedgerEntry:
    """The entry a step document holds (the inverse of :func:`_entry_fields`)."""
    return entry_of({**doc, "args": _plain(doc.get("args")), "before": _plain(doc.get("before"))})


def _seen_doc(participant: str, marker: LedgerEntry) -> Document:
    """The transaction document of a transaction first known by its seen ``marker``
    (:func:`participants._ledger.seen_marker`)."""
    return {
        "_id": _tx_doc_id(participant, marker.tx_id),
        "participant": participant,
        "tx_id": marker.tx_id,
        "rev": 1,
        "steps": [],
        "seen": {"deadline_ms": marker.deadline_ms, "updated_ms": marker.updated_ms},
        "fingerprint": marker.fingerprint,
        "finished_ms": max(marker.deadline_ms, marker.updated_ms),
    }


def _check_tx_id(tx_id: str) -> None:
    if not isinstance(tx_id, str) or not _TX_ID.fullmatch(tx_id):
        raise InvalidRecord(f"transaction id {tx_id!r} breaks the wire contract")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
