"""The decision documents of a MongoDB ledger, for the reconcile job's MongoDB reader
(:func:`streams.reconcile._sources._mongo_ledger_rows`)."""

from __future__ import annotations

import os
import tempfile
from itertools import islice
from typing import Any

__all__ = ["MongoDecisions"]


class MongoDecisions:
    """The decision documents of a MongoDB ledger (``participants.mongo._ledger._decision_doc``:
    the decision of an applied step, recorded beside its step document), spooled to a
    SQLite file in a temporary folder so that this process's memory does not grow with
    the ledger; :meth:`get` answers what the decision changed for one step document."""

    def __init__(self, ledger: Any) -> None:
        self._ledger = ledger
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        self._db: Any = None

    def __enter__(self) -> MongoDecisions:
        import sqlite3

        from saga.participants.mongo._ledger import DECISION_SUFFIX

        self._folder = tempfile.TemporaryDirectory(prefix="saga-reconcile-")
        self._db = sqlite3.connect(os.path.join(self._folder.name, "decisions.db"))
        self._db.execute(
            "CREATE TABLE d (id TEXT PRIMARY KEY, rev INTEGER, status TEXT, effect INTEGER, "
            "updated_ms INTEGER)"
        )
        projection = {"rev": 1, "set.status": 1, "set.effect": 1, "set.updated_ms": 1}
        cursor = self._ledger.find({"decides": {"$gte": 0}}, projection, batch_size=5000)
        rows = (
            (
                str(d["_id"])[: -len(DECISION_SUFFIX)],
                d.get("rev"),
                (d.get("set") or {}).get("status"),
                (d.get("set") or {}).get("effect"),
                (d.get("set") or {}).get("updated_ms"),
            )
            for d in cursor
        )
        while chunk := list(islice(rows, 5000)):
            self._db.executemany("INSERT OR REPLACE INTO d VALUES (?, ?, ?, ?, ?)", chunk)
        return self

    def get(self, step_id: str, rev: Any) -> tuple[Any, Any, Any] | None:
        """(status, effect, updated_ms) as the step's decision leaves them, or None when it
        has none for this revision of the step document. A field the decision did not
        change is None here (the caller keeps the step document's)."""
        row = self._db.execute(
            "SELECT rev, status, effect, updated_ms FROM d WHERE id = ?", (step_id,)
        ).fetchone()
        if row is None or row[0] != rev:
            return None
        return row[1], row[2], row[3]

    def __exit__(self, *exc: object) -> None:
        if self._db is not None:
            self._db.close()
        if self._folder is not None:
            self._folder.cleanup()
