"""Single-document compare-and-set writes by ``_id`` (see *Concurrency* in
:mod:`saga.participants.mongo`), and the update operators applied to a document in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from pymongo import ReturnDocument
from pymongo.client_session import ClientSession
from pymongo.collection import Collection

from saga.participants.mongo._values import Document, _is_number

log = logging.getLogger("saga.participant.mongo")


class _Absent:
    """An expected value: the field must not exist."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Final = _Absent()


class _Integer:
    """An expected value: the field holds an integer."""

    def __repr__(self) -> str:
        return "INTEGER"


INTEGER: Final = _Integer()


class _Cas:
    """Single-document compare-and-set writes addressed by ``_id``.

    ``expect`` maps (dotted) field names to the value they must have (``None``:
    null or absent, :data:`ABSENT`: absent, :data:`INTEGER`: an integer). Server-side
    (MongoDB, or inside a transaction) the conditions join the filter. Client-side (FerretDB, whose
    filters other than ``{"_id": ...}`` scan the collection) the write is an
    ``_id``-only ``findAndModify`` returning the document as it was; when that
    document does not meet ``expect`` it is put back at once and the write counts
    as missed. Each method returns whether the write took effect.

    :meth:`update` also takes a ``check`` of the document as it was (client-side only:
    a write that needs one is not tried server-side), for a write made without
    reading first: when the check fails, the write is put back and counts as missed.
    """

    def __init__(self, server_side: bool) -> None:
        self.server_side = server_side

    def where(self, key: Any, expect: Mapping[str, Any]) -> Document:
        """The filter of a server-side compare-and-set of document ``key``."""
        where: Document = {"_id": key}
        for name, value in expect.items():
            if value is ABSENT:
                where[name] = {"$exists": False}
            elif value is INTEGER:
                where[name] = {"$type": ["int", "long"]}
            else:
                where[name] = value
        return where

    def update(
        self,
        collection: Collection[Document],
        key: Any,
        expect: Mapping[str, Any],
        change: Mapping[str, Any],
        session: ClientSession | None = None,
        check: Callable[[Document], bool] | None = None,
    ) -> bool:
        if self.server_side or session is not None:
            assert check is None, "a checked write is client-side only"
            found = collection.update_one(self.where(key, expect), change, session=session)
            return found.matched_count == 1
        before = collection.find_one_and_update(
            {"_id": key}, change, return_document=ReturnDocument.BEFORE
        )
        if before is not None and check is not None and _meets(before, expect):
            passed = False
            try:
                passed = check(before)
            finally:
                if not passed:  # failed (or raised): put the document back as it was
                    collection.replace_one({"_id": key}, before)
            return passed
        return self._kept(collection, key, before, expect)

    def replace(
        self,
        collection: Collection[Document],
        key: Any,
        expect: Mapping[str, Any],
        replacement: Mapping[str, Any],
        session: ClientSession | None = None,
    ) -> bool:
        if self.server_side or session is not None:
            found = collection.replace_one(self.where(key, expect), replacement, session=session)
            return found.matched_count == 1
        before = collection.find_one_and_replace(
            {"_id": key}, replacement, return_document=ReturnDocument.BEFORE
        )
        return self._kept(collection, key, before, expect)

    def delete(
        self,
        collection: Collection[Document],
        key: Any,
        expect: Mapping[str, Any],
        session: ClientSession | None = None,
    ) -> bool:
        if self.server_side or session is not None:
            found = collection.delete_one(self.where(key, expect), session=session)
            return found.deleted_count == 1
        before = collection.find_one_and_delete({"_id": key})
        if before is None:
            return False
        if _meets(before, expect):
            return True
        collection.insert_one(before)
        log.warning("%s/%r changed concurrently; the delete was undone", collection.name, key)
        return False

    @staticmethod
    def _kept(
        collection: Collection[Document],
        key: Any,
        before: Document | None,
        expect: Mapping[str, Any],
    ) -> bool:
        if before is None:
            return False
        if _meets(before, expect):
            return True
        collection.replace_one({"_id": key}, before)
        log.warning("%s/%r changed concurrently; the write was undone", collection.name, key)
        return False


_SERVER_CAS: Final = _Cas(server_side=True)


def _meets(doc: Mapping[str, Any], expect: Mapping[str, Any]) -> bool:
    return all(_field_meets(_get(doc, name), value) for name, value in expect.items())


def _field_meets(actual: Any, expected: Any) -> bool:
    if expected is ABSENT:
        return actual is ABSENT
    if expected is INTEGER:
        return isinstance(actual, int) and not isinstance(actual, bool)
    if expected is None:
        return actual is ABSENT or actual is None
    return actual is not ABSENT and _same(actual, expected)


def _same(a: Any, b: Any) -> bool:
    """BSON equality as a filter sees it: numbers by value, everything else by type and value."""
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


def _get(doc: Mapping[str, Any], path: str) -> Any:
    value: Any = doc
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return ABSENT
        value = value[part]
    return value


def _changed(doc: Mapping[str, Any], change: Mapping[str, Any]) -> Document:
    """``doc`` after the update operators ``$set``, ``$unset`` and ``$addToSet`` of ``change``."""
    out: Document = dict(doc)

    def parent(path: str) -> tuple[Document, str]:
        *parents, last = path.split(".")
        node = out
        for part in parents:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, Mapping) else {}
            node = node[part]
        return node, last

    for path, value in change.get("$set", {}).items():
        node, last = parent(path)
        node[last] = value
    for path in change.get("$unset", {}):
        node, last = parent(path)
        node.pop(last, None)
    for path, value in change.get("$addToSet", {}).items():
        node, last = parent(path)
        items = list(node.get(last) or [])
        if not any(_same(item, value) for item in items):
            items.append(value)
        node[last] = items
    return out
