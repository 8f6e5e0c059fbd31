"""Pruning the MongoDB ledger: a finished transaction's documents go as a whole (see
*Pruning* in :mod:`saga.participants.mongo`)."""

from __future__ import annotations

from pymongo.collection import Collection

from saga.participants.mongo._cas import _Cas
from saga.participants.mongo._ledger import (
    _decided,
    _decision_id,
    _entry_of,
    _finished_ms,
    _may_be_decided,
    _pending_key,
    _step_id,
    _tx_doc_id,
)
from saga.participants.mongo._values import Document


class LedgerPruner:
    """Removes the ledger documents of one participant's finished transactions."""

    def __init__(
        self,
        participant: str,
        ledger: Collection[Document],
        txs: Collection[Document],
        cas: _Cas,
    ) -> None:
        self.participant = participant
        self.ledger = ledger
        self.txs = txs
        self.cas = cas

    def due(self, horizon_ms: int, limit: int) -> dict[str, list[str]]:
        """Transactions with a document finished at or before ``horizon_ms`` (at most
        ``limit`` of each collection): tx id -> the ids of its step documents found."""
        due = {"participant": self.participant, "finished_ms": {"$lte": horizon_ms}}
        found: dict[str, list[str]] = {}
        query = {**due, "pending": {"$exists": False}, "purge": {"$exists": False}}
        for doc in self.ledger.find(query, {"tx_id": 1}).limit(limit):
            found.setdefault(doc["tx_id"], []).append(doc["_id"])
        for doc in self.txs.find(due, {"tx_id": 1}).limit(limit):
            found.setdefault(doc["tx_id"], [])
        return found

    def prune_tx(self, tx_id: str, step_ids: list[str], horizon_ms: int) -> int:
        """Remove the transaction's documents if every one of them finished at or before
        ``horizon_ms``; how many entries (steps and markers) went."""
        doc = self.txs.find_one({"_id": _tx_doc_id(self.participant, tx_id)})
        if doc is None:  # left behind by a crash between the two deletes below
            gone = self.ledger.delete_many({"_id": {"$in": step_ids}})
            return gone.deleted_count
        steps: list[Document] = []
        decisions: list[str] = []
        for step in doc.get("steps", []):
            step_id = _step_id(self.participant, tx_id, step)
            step_doc = self.ledger.find_one({"_id": step_id})
            if step_doc is None:
                if _pending_key(step) in (doc.get("pending") or {}):
                    return 0  # an unresolved creation: its step's next reader settles it
                continue
            if _may_be_decided(step_doc):
                decision = self.ledger.find_one({"_id": _decision_id(step_id)})
                if decision is not None:
                    decisions.append(decision["_id"])
                    step_doc = _decided(step_doc, decision)
            steps.append(step_doc)
        finishes = [
            None
            if "status" not in d or d.get("pending") or d.get("purge")
            else _finished_ms(_entry_of(d))
            for d in steps
        ]
        if not steps and int(doc.get("finished_ms", horizon_ms + 1)) > horizon_ms:
            return 0  # markers only, not finished long enough
        if any(f is None or f > horizon_ms for f in finishes):
            # Looked at again when the last step finishes (a held step included: it
            # carries finished_ms, which its decision raises to when it finished).
            for d in steps:
                if "finished_ms" in d:
                    self.ledger.update_one({"_id": d["_id"]}, {"$unset": {"finished_ms": ""}})
            for decision_id in decisions:
                self.ledger.update_one({"_id": decision_id}, {"$unset": {"finished_ms": ""}})
            return 0
        if not self.cas.delete(self.txs, doc["_id"], {"rev": doc["rev"]}):
            return 0  # changed meanwhile: a later run looks again
        if steps:
            ids = [d["_id"] for d in steps] + decisions
            self.ledger.delete_many({"_id": {"$in": ids}})
        return len(steps) + sum(1 for name in ("rolled_back", "seen") if doc.get(name))
