"""The MongoDB storage: documents and the step ledger, changed together as far as the server allows.

pymongo is imported here only. Target collections hold the business documents
(``_id`` = the step's key). The ledger is two collections in the same database:

* ``saga_ledger`` (``ledger_collection``): one **step document** per
  ``(participant, tx_id, step)``, ``_id = "<participant>:<tx_id>:<step>"``
  (participant names have no ``:``), with the ledger entry's fields, a revision
  counter ``rev`` and, while a change of a recorded step is unfinished, ``pending``;
* ``saga_ledger_tx``: one **transaction document** per ``(participant, tx_id)``,
  ``_id = "<participant>:<tx_id>"``, with ``steps`` (the steps whose step
  document may exist: a step is listed *before* its document is created),
  ``rolled_back`` (the transaction-level rollback marker: a rollback came before
  any step of it was known here), ``seen`` (the seen marker: the request had no
  step here), ``fingerprint`` (of the request this participant acted on),
  ``pending`` (the intents of steps being created, below) and its own ``rev``.

Pruning. Step documents carry ``finished_ms`` once finished
(:func:`participants._barrier.finished_ms`), and so do transaction documents
that hold only markers; both collections have a ``(participant, finished_ms)``
index (``saga_by_finish``). :meth:`MongoStorage.prune` removes a transaction's
documents once all of them finished before the horizon. The seen
markers of a run of requests without a step here are inserted with one
``insert_many`` (a duplicate key means the transaction is known: nothing to do).

Only ``_id``. Every operation of the work itself addresses one document by
``_id`` and nothing else: FerretDB v1 (the local MongoDB-wire server) hands a
filter to SQLite only when it is exactly ``{"_id": <string or ObjectId>}``; any
other filter, ``{"_id": k, "rev": r}`` included, makes it decode the whole
collection. So a transaction's steps are found through its transaction document,
unfinished writes through the marker on the business document, and
compare-and-set conditions are checked as described under *Concurrency*.
(FerretDB v1.24's SQLite backend also misses its own ``_id`` index when it looks
documents up, so there a read or update by ``_id`` is still a table scan,
cheap per row but linear in the collection's size, while an insert uses the
index. The adapter therefore creates records by insert and reads or updates a
ledger document only when it must.)

Effects are staged, not run
---------------------------
A built-in action reads what it needs through :class:`MongoSession`, checks it
(raising :class:`~streams.BusinessRejection`), and *stages* one
:class:`DocumentWrite`: a single-document insert, update, replace or delete,
compare-and-set on the ``_saga`` field it read. The unit runs the staged write
when the step's ledger entry is written (:meth:`Unit.write`), so a rejected step
has nothing to undo (:meth:`Unit.rollback_effect` drops the staged write) and
the write knows the ledger record it belongs to. Every write sets ``_saga`` on
the document to a *marker* ``"<step id>#<rev>.<nonce>"``, unique per write; a
delete's marker ends with ``!deleted`` (see below).

Two modes (``transactions=None`` detects at :meth:`MongoStorage.setup`)
-------------------------------------------------------------------------
* **Transactions** (MongoDB as a replica set or a sharded cluster; ``hello``
  names a ``setName`` and a probe transaction succeeds): the ledger writes and
  the staged write they record run in one multi-document transaction, committed
  before the next step of the batch; reads run inside it too. Custom handlers
  may write directly with ``session=native.session``.
* **Single-document writes** (FerretDB, a standalone ``mongod``): no
  multi-document atomicity, so each staged write ``W`` goes through an *intent*
  (the write, the entry to record, the marker, the owner and the time) recorded
  before ``W``:

  - *A new step*: (1) the intent goes into the transaction document, which also
    lists the step. For a transaction this storage does not know, that is an
    *insert* of the document, which doubles as the check that the ledger knows
    nothing of the transaction: the request is run without reading the ledger,
    and if the insert finds the document it is run again, reading. Otherwise a
    compare-and-set on its ``rev``. (2) ``W``. (3) The step document is
    inserted, with the entry. The step documents of a batch are inserted
    together (one ``insert_many``) at the end of the batch, or earlier when
    their step or document is touched again (:class:`_Unrecorded`); until then
    the intent and the marker stand for them. A new step without a write
    inserts or updates the transaction document, then inserts its step document.
  - *A recorded step changes* (a compensation, a confirmation that writes,
    applying a waiting step): (1) ``pending`` = the intent is set on the step
    document, (2) ``W``, (3) the entry is set and ``pending`` removed; each a
    compare-and-set on ``rev``.
  - *A delete* only marks the document in ``W`` (``_saga`` = its ``!deleted``
    marker) and removes it once (3) is done. Until it is gone the step document
    names it (``purge``), so after a crash in between whoever next loads the step
    or reads the document removes it. A marked document reads as absent.

  ``W`` happened iff the business document carries the intent's marker. That
  holds because a marker stays on its document until the ledger records its
  write: whoever reads a document first makes sure the write its marker names is
  recorded (reading the step document the marker names, or its transaction
  document when the step document does not exist yet, and finishing the intent);
  a process-wide memo of the markers known to be recorded spares that read in
  the usual case. A delete keeps its mark until recorded for the same reason.
  An intent found unresolved is therefore finished when the marker is there
  (roll forward: record the entry), and otherwise discarded (roll back) after
  *fencing*: if the document still carries the ``_saga`` the write expects,
  ``_saga`` is changed, so a late ``W`` from a paused worker misses its
  compare-and-set. An intent whose ``W`` never happened concerns nobody but its
  own step: any other writer of the document changes ``_saga``, which fences it
  too. So intents are resolved where they can matter: by the unit that reads the
  step (a re-delivered request or decision after a crash) and by whoever reads a
  document carrying their marker. An intent of another live worker is left alone
  for ``intent_lease_ms`` (the batch fails with a :class:`~streams.TransientError`
  and is retried); one written by this storage is never live when found, because
  it holds the document's lock while an intent is open, and a step document it
  has not inserted yet is found in :class:`_Unrecorded` by any storage of the
  process. An intent left in the transaction document once its step document
  exists is spent and ignored.

  Round trips without transactions: a new step of a new transaction costs a read
  of the business document, the insert of the transaction document, the write
  and a share of one batched insert; a decision on a step this storage recorded
  costs one update of its step document (see *Cache*).

Cache. Without transactions each :class:`MongoStorage` remembers the ledger
documents it read or wrote (up to :data:`TX_CACHE_SIZE` transactions), so a
decision on a transaction it applied reads nothing. That is sound because the
runtime gives a transaction's records to one worker at a time, and every ledger
write is a compare-and-set on what was remembered: a stale memory makes the
write fail, the batch is retried and the ledger read again. Any failure forgets
the transactions the item touched, and :meth:`MongoStorage.in_flight_sequential`
(which the runtime calls at start-up and after every partition assignment)
forgets everything.

Concurrency. FerretDB v1 runs an update as read-then-write, so two concurrent
writers of one document can lose an update even with a compare-and-set filter.
The adapter therefore serialises writes per ``(database, collection, key)``
inside the process (a lock held from the action's read to its ledger write),
across every :class:`MongoStorage` of the process. On FerretDB (detected from
``buildInfo``) a compare-and-set is an ``_id``-only ``findAndModify`` returning
the document as it was, checked by the adapter; a mismatch (a change made since
the read, by someone else) is put back at once and counts as a conflict. On
MongoDB the conditions are part of the filter, atomic. The runtime handles one
batch at a time and owns a transaction's partition alone, so one process per
participant is safe on FerretDB. Several processes writing the *same* documents
(two workers of one participant, or another application) rely on the server's
single-document atomicity: correct on MongoDB, lossy on FerretDB.

Guarantees (DESIGN §4). On MongoDB with transactions each step's change and its
ledger record commit atomically, and concurrent workers are safe. Without
transactions a crash at any point leaves each step applied 0 or 1 times and the
ledger agreeing with the documents once the intent is resolved (idempotency,
null compensation, hanging prevention and exactly-once effect hold); a custom
handler writing directly through ``native.db`` is not atomic with the ledger
(it should stage its writes through ``native.stage`` instead).

Values. Fields are JSON scalars stored as BSON (``null`` is stored, not
removed); ``_id`` and names starting with ``_saga`` are reserved. A key that is a
canonical decimal integer string (``"9"``, not ``"09"``) addresses the integer
``_id`` 9, so ``9`` and ``"9"`` name one record here as in the SQL and Redis
storages. Increments on fractions are computed in decimal on the shortest
representation of each number, and a compensation that lands on the old value
writes the old value back exactly (type included). Before-images are relaxed
Extended JSON (so dates and ObjectIds round-trip); the ledger keeps ``args`` and
``before`` as JSON text, since MongoDB field names may not contain ``.`` or
``$``.

Errors, translated at this boundary: the server unreachable, a lost connection,
a write conflict or another worker changing the same ledger record or document
at the same time are a :class:`~streams.TransientError`; a write the server
refuses for its content (a document too large) fails the step with a
:class:`~streams.BusinessRejection`; missing privileges or an unsupported
feature are a :class:`~streams.ConfigurationError`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Final, Generic, Literal, NoReturn, TypeVar

from bson import json_util
from bson.json_util import JSONMode, JSONOptions
from pymongo import ASCENDING, MongoClient, ReturnDocument
from pymongo import errors as mongo_errors
from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.uri_parser import parse_uri

from participants._actions import (
    IDENTIFIER,
    INT64_MAX,
    INT64_MIN,
    BuiltinAction,
    BuiltinActions,
    Increment,
    Key,
    RecordOps,
)
from participants._barrier import LedgerEntry, LedgerStatus, Requested, finished_ms
from participants._handlers import Handler, combine
from participants._storage import (
    Actions,
    Report,
    RequestSeen,
    Storage,
    Unit,
    WorkItem,
    run_item,
)
from streams import (
    TX_ID_PATTERN,
    BusinessRejection,
    ConfigurationError,
    InvalidRecord,
    Mode,
    TransientError,
)
from streams._secrets import redact, redact_url

log = logging.getLogger("saga.participant.mongo")

Document = dict[str, Any]

MARKER_FIELD: Final = "_saga"
"""The field of a business document naming the last saga write (see :func:`_new_marker`)."""
DELETED: Final = "!deleted"
"""Ends the marker of a delete: the document is removed once the ledger records the step."""
FENCED: Final = "!fenced"
"""Ends a marker set by fencing: the write it names did not happen and never will."""
PARTICIPANT_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""Participant names as the wire contract allows them (no ``:``: it separates ledger ids)."""
DEFAULT_DATABASE: Final = "saga"
DEFAULT_INTENT_LEASE_MS: Final = 15_000
TX_COLLECTION_SUFFIX: Final = "_tx"
"""The transaction documents live in the ledger collection's name plus this suffix."""
TX_CACHE_SIZE: Final = 10_000
"""Transactions whose ledger documents a storage remembers (see *Cache* in the module doc)."""
SETTLED_CACHE_SIZE: Final = 100_000
"""Business documents whose marker this process knows to be recorded in the ledger."""

_TX_ID: Final = re.compile(TX_ID_PATTERN)
_CANONICAL_INT: Final = re.compile(r"-?(0|[1-9][0-9]{0,18})")
_RELAXED: Final = JSONOptions(json_mode=JSONMode.RELAXED)
_TRANSIENT_CODES: Final = frozenset(
    {
        50,  # MaxTimeMSExpired
        91,  # ShutdownInProgress
        112,  # WriteConflict
        189,  # PrimarySteppedDown
        244,  # TransactionAborted
        251,  # NoSuchTransaction
        262,  # ExceededTimeLimit
        10107,  # NotWritablePrimary
        11600,  # InterruptedAtShutdown
        11602,  # InterruptedDueToReplStateChange
        13435,  # NotPrimaryNoSecondaryOk
        13436,  # NotPrimaryOrSecondary
    }
)
_AUTHENTICATION_FAILED: Final = 18
_CONFIGURATION_CODES: Final = frozenset(
    {
        13,  # Unauthorized
        18,  # AuthenticationFailed
        20,  # IllegalOperation (e.g. transactions on a standalone server)
        115,  # CommandNotSupported
        238,  # NotImplemented (FerretDB)
    }
)
_DUPLICATE_KEY: Final = 11000

_K = TypeVar("_K")
_V = TypeVar("_V")


# ---------------------------------------------------------------- compare-and-set


class _Absent:
    """An expected value: the field must not exist."""

    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Final = _Absent()


class _Cas:
    """Single-document compare-and-set writes addressed by ``_id``.

    ``expect`` maps (dotted) field names to the value they must have (``None``:
    null or absent, :data:`ABSENT`: absent). Server-side (MongoDB, or inside a
    transaction) the conditions join the filter. Client-side (FerretDB, whose
    filters other than ``{"_id": ...}`` scan the collection) the write is an
    ``_id``-only ``findAndModify`` returning the document as it was; when that
    document does not meet ``expect`` it is put back at once and the write counts
    as missed. Each method returns whether the write took effect.
    """

    def __init__(self, server_side: bool) -> None:
        self.server_side = server_side

    def _where(self, key: Any, expect: Mapping[str, Any]) -> Document:
        where: Document = {"_id": key}
        for name, value in expect.items():
            where[name] = {"$exists": False} if value is ABSENT else value
        return where

    def update(
        self,
        collection: Collection[Document],
        key: Any,
        expect: Mapping[str, Any],
        change: Mapping[str, Any],
        session: ClientSession | None = None,
    ) -> bool:
        if self.server_side or session is not None:
            found = collection.update_one(self._where(key, expect), change, session=session)
            return found.matched_count == 1
        before = collection.find_one_and_update(
            {"_id": key}, change, return_document=ReturnDocument.BEFORE
        )
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
            found = collection.replace_one(self._where(key, expect), replacement, session=session)
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
            found = collection.delete_one(self._where(key, expect), session=session)
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


# ---------------------------------------------------------------- staged writes


@dataclass(frozen=True, slots=True)
class DocumentWrite:
    """One single-document write, run when the step's ledger entry is written.

    ``kind``: ``insert`` (``document``, fails when the key exists), ``update``
    (``set`` and ``unset`` field names), ``replace`` (the whole ``document``) or
    ``delete``. Every kind but ``insert`` applies only while the document's
    ``_saga`` field still equals ``expect`` (``None``: absent) and it matches
    ``guard`` (extra equality conditions), so a change made in between makes the
    write miss instead of overwrite it. The write sets ``_saga`` to the step's
    marker; ``_id`` and ``_saga`` must not appear in ``document``/``set``.
    """

    target: str
    key: Any
    kind: Literal["insert", "update", "replace", "delete"]
    expect: Any = None
    document: Mapping[str, Any] = field(default_factory=dict)
    set: Mapping[str, Any] = field(default_factory=dict)
    unset: Sequence[str] = ()
    guard: Mapping[str, Any] = field(default_factory=dict)

    def run(
        self,
        collection: Collection[Document],
        marker: str,
        session: Any,
        cas: _Cas = _SERVER_CAS,
    ) -> bool:
        """Run the write; whether it took effect (``False``: the document changed meanwhile).

        A ``delete`` only marks the document (``marker`` ends with ``!deleted``);
        :func:`_purge` removes it once the ledger records the step.
        """
        if self.kind == "insert":
            try:
                collection.insert_one(
                    {"_id": self.key, **self.document, MARKER_FIELD: marker}, session=session
                )
            except mongo_errors.DuplicateKeyError:
                return False
            return True
        expect = {MARKER_FIELD: self.expect, **self.guard}
        if self.kind == "replace":
            replacement = {**self.document, MARKER_FIELD: marker}
            return cas.replace(collection, self.key, expect, replacement, session)
        change: Document = {"$set": {MARKER_FIELD: marker}}
        if self.kind == "update":
            change["$set"] = {**self.set, MARKER_FIELD: marker}
            if self.unset:
                change["$unset"] = dict.fromkeys(self.unset, "")
        return cas.update(collection, self.key, expect, change, session)

    def happened(self, current: Document | None, marker: str) -> bool:
        """Whether this write (with ``marker``) is what ``current`` shows."""
        return current is not None and current.get(MARKER_FIELD) == marker

    def to_bson(self) -> Document:
        return {
            "target": self.target,
            "key": self.key,
            "kind": self.kind,
            "expect": self.expect,
            "document": _to_text(dict(self.document)),
            "set": _to_text(dict(self.set)),
            "unset": list(self.unset),
            "guard": _to_text(dict(self.guard)),
        }

    @classmethod
    def from_bson(cls, doc: Mapping[str, Any]) -> DocumentWrite:
        return cls(
            target=doc["target"],
            key=doc["key"],
            kind=doc["kind"],
            expect=doc.get("expect"),
            document=_from_text(doc.get("document")) or {},
            set=_from_text(doc.get("set")) or {},
            unset=tuple(doc.get("unset") or ()),
            guard=_from_text(doc.get("guard")) or {},
        )


def _purge(
    collection: Collection[Document], key: Any, marker: str, session: Any, cas: _Cas
) -> None:
    """Remove a document a recorded delete marked (gone already is fine)."""
    if not cas.delete(collection, key, {MARKER_FIELD: marker}, session):
        log.debug("%s/%r was removed already", collection.name, key)


def _purge_field(write: DocumentWrite, marker: str) -> Document:
    """What a delete's step document holds until the document is removed."""
    if write.kind != "delete":
        return {}
    return {"purge": {"target": write.target, "key": write.key, "marker": marker}}


def _doc_id(target: str, key: Any) -> str:
    """A string naming one document of the database (for locks and refusals)."""
    kind = "i" if isinstance(key, int) else "s"
    return f"{target}/{kind}:{key}"


def _new_marker(step_id: str, rev: int, write: DocumentWrite) -> str:
    """``<step id>#<rev>.<nonce>`` (``!deleted`` appended for a delete): unique per write."""
    marker = f"{step_id}#{rev}.{os.urandom(4).hex()}"
    return marker + DELETED if write.kind == "delete" else marker


def _marker_names(marker: Any) -> tuple[str, int] | None:
    """The step id and rev a marker names; ``None`` for no marker, a fenced or a foreign one."""
    if not isinstance(marker, str) or marker.endswith(FENCED):
        return None
    step_id, sep, rest = marker.removesuffix(DELETED).rpartition("#")
    rev = rest.split(".", 1)[0]
    if not sep or not rev.isdigit():
        return None
    return step_id, int(rev)


def _step_id(participant: str, tx_id: str, step: int) -> str:
    return f"{participant}:{tx_id}:{step}"


def _tx_doc_id(participant: str, tx_id: str) -> str:
    return f"{participant}:{tx_id}"


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


# ---------------------------------------------------------------- locks and memories


class _DocumentLocks:
    """Process-wide re-entrant locks per ``(scope, collection, key)``, created on demand."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._locks: dict[tuple[str, str, str], tuple[threading.RLock, int]] = {}

    def acquire(self, name: tuple[str, str, str]) -> None:
        with self._mutex:
            lock, users = self._locks.get(name, (threading.RLock(), 0))
            self._locks[name] = (lock, users + 1)
        lock.acquire()

    def release(self, name: tuple[str, str, str]) -> None:
        with self._mutex:
            lock, users = self._locks[name]
            if users == 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)
        lock.release()


class _Lru(Generic[_K, _V]):
    """A small thread-safe least-recently-used map."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._mutex = threading.Lock()
        self._data: OrderedDict[_K, _V] = OrderedDict()

    def get(self, key: _K) -> _V | None:
        with self._mutex:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: _K, value: _V) -> None:
        with self._mutex:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._size:
                self._data.popitem(last=False)

    def pop(self, key: _K) -> None:
        with self._mutex:
            self._data.pop(key, None)

    def clear(self) -> None:
        with self._mutex:
            self._data.clear()


@dataclass(frozen=True, slots=True, eq=False)
class _StepRecord:
    """A step document to insert: its write took effect, with ``marker``, on document ``lock``."""

    owner: MongoStorage
    doc: Document
    lock: tuple[str, str, str]
    marker: str


class _Unrecorded:
    """Process-wide: the step documents created by a write that are not inserted yet.

    A storage inserts the step documents of the new steps it applied in batches
    (:meth:`MongoStorage.flush_records`); until then the write's intent and
    marker make them recoverable, and whoever touches the written document first
    inserts the record (:meth:`_MongoUnit.settle`), so a marker is never
    overwritten before the ledger records its write. One record per document at
    most: the next write of the document waits for it.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._records: dict[tuple[str, str, str], _StepRecord] = {}

    def add(self, record: _StepRecord) -> None:
        with self._mutex:
            self._records[record.lock] = record

    def get(self, lock: tuple[str, str, str]) -> _StepRecord | None:
        with self._mutex:
            return self._records.get(lock)

    def done(self, record: _StepRecord) -> None:
        with self._mutex:
            if self._records.get(record.lock) is record:
                del self._records[record.lock]


def _insert_records(ledger: Collection[Document], records: Sequence[_StepRecord]) -> None:
    """Insert deferred step documents (one already there was recorded by someone else)."""
    try:
        ledger.insert_many([record.doc for record in records], ordered=False)
    except mongo_errors.BulkWriteError as exc:
        errors = exc.details.get("writeErrors") or []
        if not errors or any(error.get("code") != _DUPLICATE_KEY for error in errors):
            raise
    for record in records:
        _SETTLED.put(record.lock, record.marker)
        _UNRECORDED.done(record)


_LOCKS: Final = _DocumentLocks()
_SETTLED: Final = _Lru[tuple[str, str, str], str](SETTLED_CACHE_SIZE)
"""Document lock name -> a marker it carried whose write this process knows is recorded."""
_UNRECORDED: Final = _Unrecorded()


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


# ---------------------------------------------------------------- native session


class MongoSession:
    """What actions get as ``native`` for one work item.

    ``db`` is the participant's :class:`~pymongo.database.Database`; ``session``
    the :class:`~pymongo.client_session.ClientSession` whose transaction holds the
    step when the server has transactions (``None`` otherwise): pass
    ``session=native.session`` to every call. For writes that are atomic with the
    ledger on every server, read with :meth:`read` and :meth:`stage` one
    :class:`DocumentWrite` per step instead of writing directly.
    """

    def __init__(self, unit: _MongoUnit) -> None:
        self._unit = unit
        self.db: Database[Document] = unit.storage.db
        self._staged: DocumentWrite | None = None

    @property
    def session(self) -> ClientSession | None:
        return self._unit.transaction_session()

    @property
    def transactional(self) -> bool:
        """Whether writes made directly through ``db`` commit with the ledger record."""
        return self._unit.storage.transactional

    def collection(self, target: str) -> Collection[Document]:
        """The collection of ``target``, one of the participant's targets."""
        if target not in self._unit.storage.targets:
            allowed = ", ".join(sorted(self._unit.storage.targets)) or "empty"
            raise BusinessRejection(
                f"target {target!r} is not in this participant's allow-list ({allowed})"
            )
        return self.db[target]

    def read(self, target: str, key: Any) -> Document | None:
        """The document ``target/key`` (``None``: absent), locked for this step.

        Makes sure the write whose marker it carries is recorded first (see the module doc).
        """
        collection = self.collection(target)
        self._unit.lock(target, key)
        doc = collection.find_one({"_id": key}, session=self.session)
        return self._unit.settle(target, key, doc)

    def stage(self, write: DocumentWrite) -> None:
        """Run ``write`` together with this step's ledger entry (one write per step)."""
        collection = self.collection(write.target)
        refused = self._unit.refused.get((write.target, _doc_id(write.target, write.key)))
        if refused is not None:
            raise BusinessRejection(refused)
        if self._staged is not None:
            raise RuntimeError("a step may stage one document write; this one staged two")
        if not self._unit.holds(write.target, write.key):
            # A handler that writes without reading first still waits its turn.
            self._unit.lock(write.target, write.key)
            found = collection.find_one({"_id": write.key}, session=self.session)
            self._unit.settle(write.target, write.key, found)
        self._staged = write

    def take_staged(self) -> DocumentWrite | None:
        staged, self._staged = self._staged, None
        return staged


def _session(native: Any) -> MongoSession:
    if not isinstance(native, MongoSession):
        raise TypeError(f"Mongo actions need a MongoSession as native, not {type(native).__name__}")
    return native


# ---------------------------------------------------------------- built-in actions


class MongoActions(BuiltinActions):
    """The built-in actions on documents (``native`` must be a :class:`MongoSession`).

    ``put`` sets the given fields and keeps the others; its compensation puts the
    whole old document back (or deletes a created one). ``update``'s before-image
    is ``{"fields": {old values}, "absent": [fields it added]}``. ``increment``
    checks the bounds on the value it read and writes the result with that value
    as a guard; its compensation subtracts ``by`` without bounds. Every write is a
    :class:`DocumentWrite` staged for the ledger write.
    """

    def record(self, native: Any, action: BuiltinAction) -> RecordOps:
        return _Record(_session(native), action.target, action.key)


def canonical_key(key: Key) -> int | str:
    """The ``_id`` a step's key addresses: canonical decimal integer strings become integers."""
    if isinstance(key, str) and _CANONICAL_INT.fullmatch(key):
        number = int(key)
        if INT64_MIN <= number <= INT64_MAX:
            return number
    return key


class _Record:
    """One document of a target collection, addressed by the step's key."""

    def __init__(self, session: MongoSession, target: str, key: Key) -> None:
        self.session = session
        self.target = target
        self.key = canonical_key(key)
        self.where = f"{target}/{key}"

    def _read(self) -> Document | None:
        return self.session.read(self.target, self.key)

    def _existing(self) -> Document:
        doc = self._read()
        if doc is None:
            raise BusinessRejection(f"{self.where} does not exist")
        return doc

    def _stage(self, kind: Literal["insert", "update", "replace", "delete"], **parts: Any) -> None:
        self.session.stage(DocumentWrite(self.target, self.key, kind, **parts))

    def _fields(self, fields: Mapping[str, Any], what: str, *, key_allowed: bool) -> Document:
        values: Document = {}
        for name, value in fields.items():
            if name.startswith(MARKER_FIELD):
                raise BusinessRejection(
                    f"{what} of {self.where} may not set {name!r}: names starting with "
                    f"{MARKER_FIELD!r} are reserved for the saga marker"
                )
            if name == "_id":
                # The key is the document's identity: it may be repeated, never changed.
                if not key_allowed or canonical_key(value) != self.key:
                    raise BusinessRejection(
                        f"{what} of {self.where} may not change the key field '_id'"
                    )
                continue
            values[name] = value
        return values

    # -- actions

    def insert(self, fields: Mapping[str, Any]) -> None:
        values = self._fields(fields, "insert", key_allowed=True)
        if self._read() is not None:
            raise BusinessRejection(f"{self.where} already exists")
        self._stage("insert", document=values)

    def put(self, fields: Mapping[str, Any]) -> Any:
        values = self._fields(fields, "put", key_allowed=True)
        doc = self._read()
        if doc is None:
            self._stage("insert", document=values)
            return None
        self._stage("update", expect=doc.get(MARKER_FIELD), set=values)
        return _image(doc)

    def update(self, fields: Mapping[str, Any]) -> Any:
        values = self._fields(fields, "update", key_allowed=False)
        doc = self._existing()
        self._stage("update", expect=doc.get(MARKER_FIELD), set=values)
        present = {name: doc[name] for name in values if name in doc}
        absent = sorted(name for name in values if name not in doc)
        return {"fields": _image(present), "absent": absent}

    def delete(self) -> Any:
        doc = self._existing()
        self._stage("delete", expect=doc.get(MARKER_FIELD))
        return _image(doc)

    def increment(self, action: Increment) -> Any:
        name = self._counter(action.field)
        doc = self._existing()
        current = self._number(doc, name)
        result = _add(current, action.by, f"{self.where} {name}")
        if action.min is not None and result < action.min:
            raise BusinessRejection(
                f"{self.where} {name} would be {_show_number(result)}, below the minimum "
                f"{_show_number(action.min)}"
            )
        if action.max is not None and result > action.max:
            raise BusinessRejection(
                f"{self.where} {name} would be {_show_number(result)}, above the maximum "
                f"{_show_number(action.max)}"
            )
        self._stage(
            "update", expect=doc.get(MARKER_FIELD), set={name: result}, guard={name: current}
        )
        return {name: current}

    # -- compensations

    def remove(self) -> None:
        doc = self._read()
        if doc is not None:  # already gone is fine: the compensation wants the key absent
            self._stage("delete", expect=doc.get(MARKER_FIELD))

    def restore_put(self, before: Any) -> None:
        if before is None:
            self.remove()
            return
        image = _restored(before, f"the before-image of {self.where} is missing")
        doc = self._read()
        if doc is None:
            self._stage("insert", document=image)
        else:
            self._stage("replace", expect=doc.get(MARKER_FIELD), document=image)

    def restore_fields(self, before: Any) -> None:
        if not isinstance(before, Mapping) or not isinstance(before.get("fields"), Mapping):
            raise BusinessRejection(
                f"the before-image of {self.where} is missing; the update cannot be undone"
            )
        doc = self._read()
        if doc is None:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its update cannot be undone"
            )
        self._stage(
            "update",
            expect=doc.get(MARKER_FIELD),
            set=_restored(before["fields"], ""),
            unset=[str(name) for name in before.get("absent", ())],
        )

    def reinsert(self, before: Any) -> None:
        image = _restored(
            before, f"the before-image of {self.where} is missing; it cannot be restored"
        )
        if self._read() is not None:
            raise BusinessRejection(
                f"{self.where} exists again, so the deleted document cannot be restored"
            )
        self._stage("insert", document=image)

    def increment_back(self, action: Increment, before: Any) -> None:
        name = self._counter(action.field)
        doc = self._read()
        if doc is None:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its increment of {name} cannot be undone"
            )
        current = self._number(doc, name)
        result = _add(current, -action.by, f"{self.where} {name}")
        old = before.get(name) if isinstance(before, Mapping) else None
        if _is_number(old) and old == result:
            result = old  # the old value exactly, type included (an int stays an int)
        self._stage(
            "update", expect=doc.get(MARKER_FIELD), set={name: result}, guard={name: current}
        )

    def _counter(self, name: str) -> str:
        if name == "_id" or name.startswith(MARKER_FIELD):
            raise BusinessRejection(f"increment may not change the field {name!r}")
        return name

    def _number(self, doc: Document, name: str) -> int | float:
        value = doc.get(name)
        if value is None:
            raise BusinessRejection(f"{self.where} has no value in {name}")
        if not _is_number(value):
            raise BusinessRejection(f"{self.where} {name} is not a number ({_show(value)})")
        number: int | float = value
        return number


# ---------------------------------------------------------------- values


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _add(current: int | float, by: int | float, what: str) -> int | float:
    """``current + by``: integers exactly; fractions in decimal on the shortest spelling."""
    if isinstance(current, int) and isinstance(by, int):
        result = current + by
        if not INT64_MIN <= result <= INT64_MAX:
            raise BusinessRejection(f"{what} would be {result}, which does not fit in 64 bits")
        return result
    total = Decimal(repr(current)) + Decimal(repr(by))
    return float(total)


def _show_number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def _show(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _image(doc: Mapping[str, Any]) -> Any:
    """A document's fields (not ``_id``, not the marker) as relaxed Extended JSON."""
    fields = {k: v for k, v in doc.items() if k != "_id" and not k.startswith(MARKER_FIELD)}
    return json.loads(json_util.dumps(fields, json_options=_RELAXED))


def _restored(image: Any, missing: str) -> Document:
    """The inverse of :func:`_image`."""
    if not isinstance(image, Mapping):
        raise BusinessRejection(missing)
    restored: Document = json_util.loads(json.dumps(image))
    return restored


def _to_text(value: Any) -> str:
    """A JSON value (or a BSON document) as Extended JSON text, for the ledger."""
    return json_util.dumps(value, json_options=_RELAXED)


def _from_text(text: Any) -> Any:
    if text is None:
        return None
    return json_util.loads(text)


def _plain(text: Any) -> Any:
    """Ledger text back to plain JSON values (what :class:`LedgerEntry` holds)."""
    if text is None:
        return None
    return json.loads(text)


# ---------------------------------------------------------------- ledger documents


def _entry_fields(entry: LedgerEntry) -> Document:
    return {
        "status": str(entry.status),
        "action": entry.action,
        "args": None if entry.args is None else json.dumps(_json_ready(entry.args)),
        "mode": str(entry.mode),
        "n_steps": entry.n_steps,
        "deadline_ms": entry.deadline_ms,
        "effect": entry.effect,
        "before": json.dumps(_json_ready(entry.before)),
        "reason": entry.reason,
        "rollback_pending": entry.rollback_pending,
        "successor_compensated": entry.successor_compensated,
        "updated_ms": entry.updated_ms,
        "last": entry.step >= entry.n_steps - 1,
        "fingerprint": entry.fingerprint,
        "finished_ms": finished_ms(entry),
    }


def _json_ready(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    return value


def _entry_of(doc: Mapping[str, Any]) -> LedgerEntry:
    return LedgerEntry(
        tx_id=doc["tx_id"],
        step=doc["step"],
        status=LedgerStatus(doc["status"]),
        action=doc.get("action"),
        args=_plain(doc.get("args")),
        mode=Mode(doc["mode"]),
        n_steps=doc["n_steps"],
        deadline_ms=doc["deadline_ms"],
        effect=bool(doc["effect"]),
        before=_plain(doc.get("before")),
        reason=doc.get("reason"),
        rollback_pending=bool(doc["rollback_pending"]),
        successor_compensated=bool(doc["successor_compensated"]),
        updated_ms=doc["updated_ms"],
        fingerprint=doc.get("fingerprint"),
    )


def _seen_doc(participant: str, item: RequestSeen) -> Document:
    """The transaction document of a transaction first known by its seen marker."""
    return {
        "_id": _tx_doc_id(participant, item.tx_id),
        "participant": participant,
        "tx_id": item.tx_id,
        "rev": 1,
        "steps": [],
        "seen": {"deadline_ms": item.deadline_ms, "updated_ms": item.now_ms},
        "fingerprint": item.fingerprint,
        "finished_ms": max(item.deadline_ms, item.now_ms),
    }


class _Conflict(TransientError):
    """Another worker changed the same ledger record or document at the same time."""


class _Refused(Exception):
    """The server refused a staged write for its content; the step must fail instead."""

    def __init__(self, target: str, key: Any, reason: str) -> None:
        super().__init__(reason)
        self.target = target
        self.key = key
        self.reason = reason


class _Speculation(Exception):
    """The transaction a request was run for as new is known to the ledger: run it again."""


# ---------------------------------------------------------------- the unit


class _MongoUnit(Unit):
    """One work item's reads and writes; see the module doc for the write protocol.

    The unit sees each transaction's ledger documents through a :class:`_TxView`
    (remembered by the storage, or read). Every ledger write is a compare-and-set
    on the ``rev`` it saw (an insert when the document is absent): a worker that
    lost a race gets a :class:`TransientError`, never overwrites the other's record.
    ``speculate``: a request for a transaction the storage does not remember is
    run as new without reading the ledger (see the module doc).
    """

    def __init__(
        self,
        storage: MongoStorage,
        refused: Mapping[tuple[str, str], str],
        *,
        speculate: bool = False,
    ) -> None:
        self.storage = storage
        self.refused = refused
        self.native = MongoSession(self)
        self._ledger = storage.ledger_collection
        self._txs = storage.tx_collection
        self._cas = storage.cas
        self._views: dict[tuple[str, str], _TxView] = {}
        self._held: list[tuple[str, str, str]] = []
        self._session: ClientSession | None = None
        self._speculate = speculate and not storage.transactional

    # -- lifecycle

    def transaction_session(self) -> ClientSession | None:
        """The session whose transaction is open (transactional mode), opening one if needed."""
        if not self.storage.transactional:
            return None
        if self._session is None:
            self._session = self.storage.client.start_session()
        if not self._session.in_transaction:
            self._session.start_transaction()
        return self._session

    def close(self) -> None:
        """End the item: abort an unfinished transaction, release the document locks."""
        try:
            if self._session is not None:
                if self._session.in_transaction:
                    self._session.abort_transaction()
                self._session.end_session()
        finally:
            self._session = None
            self.release_locks()

    def forget(self) -> None:
        """Make the storage forget what this unit saw: after a failure it reads again."""
        for participant, tx_id in self._views:
            if participant == self.storage.name:
                self.storage.tx_cache.pop(tx_id)

    def _lock_name(self, target: str, key: Any) -> tuple[str, str, str]:
        return (self.storage.lock_scope, target, _doc_id(target, key))

    def lock(self, target: str, key: Any) -> None:
        name = self._lock_name(target, key)
        _LOCKS.acquire(name)
        self._held.append(name)

    def holds(self, target: str, key: Any) -> bool:
        return self._lock_name(target, key) in self._held

    def unlock_last(self) -> None:
        _LOCKS.release(self._held.pop())

    def release_locks(self) -> None:
        held, self._held = self._held, []
        for name in reversed(held):
            _LOCKS.release(name)

    # -- views of the ledger

    def _remembered(self, tx_id: str) -> _TxView | None:
        key = (self.storage.name, tx_id)
        view = self._views.get(key)
        if view is None and not self.storage.transactional:
            view = self.storage.tx_cache.get(tx_id)
            if view is not None:
                self._views[key] = view
        return view

    def _keep(self, view: _TxView) -> None:
        self._views[(view.participant, view.tx_id)] = view
        own = view.participant == self.storage.name
        if own and not view.speculative and not self.storage.transactional:
            self.storage.tx_cache.put(view.tx_id, view)

    def _view(self, tx_id: str, participant: str | None = None) -> _TxView:
        """The transaction's ledger documents as known, reading its document if need be."""
        participant = participant or self.storage.name
        if participant == self.storage.name:
            view = self._remembered(tx_id)
        else:
            view = self._views.get((participant, tx_id))
        if view is not None and not view.speculative:
            return view
        session = self.transaction_session()
        doc = self._txs.find_one({"_id": _tx_doc_id(participant, tx_id)}, session=session)
        if view is not None:
            if doc is not None:
                raise _Speculation(tx_id)
            view.speculative = False
            return view
        view = _TxView(participant, tx_id, doc)
        self._keep(view)
        return view

    def _entry_view(self, tx_id: str) -> _TxView:
        """As :meth:`_view`, but speculating that an unknown transaction is new."""
        view = self._remembered(tx_id)
        if view is not None:
            return view
        if self._speculate:
            view = _TxView(self.storage.name, tx_id, None, speculative=True)
            self._views[(self.storage.name, tx_id)] = view
            return view
        return self._view(tx_id)

    def _read_step(self, view: _TxView, step: int) -> Document | None:
        """The step document as stored (``None``: absent), without resolving anything."""
        if step not in view.steps:
            doc = None
            if view.listed(step):  # a step is listed before its document is created
                session = self.transaction_session()
                doc = self._ledger.find_one({"_id": view.step_id(step)}, session=session)
            view.steps[step] = doc
        return view.steps[step]

    def _step(self, view: _TxView, step: int) -> Document | None:
        """The step document (``None``: absent) once its unfinished write is resolved."""
        doc = self._read_step(view, step)
        if doc is None:
            intent = view.creation(step)
            if intent is not None:
                doc = self._resolve_creation(view, step, intent)
        elif doc.get("pending") is not None:
            doc = self._resolve_step(view, step, doc)
        if doc is not None and doc.get("purge") is not None:
            doc = self._purge_named(view, step, doc)
        return doc

    # -- reads

    def entry(self, tx_id: str, step: int) -> LedgerEntry | None:
        _check_tx_id(tx_id)
        doc = self._step(self._entry_view(tx_id), step)
        return None if doc is None or "status" not in doc else _entry_of(doc)

    def entries(self, tx_id: str) -> list[LedgerEntry]:
        _check_tx_id(tx_id)
        view = self._view(tx_id)
        if view.doc is None:
            return []
        docs = [self._step(view, step) for step in sorted(view.doc.get("steps", ()))]
        return [_entry_of(doc) for doc in docs if doc is not None and "status" in doc]

    def tx_rolled_back(self, tx_id: str) -> bool:
        view = self._entry_view(tx_id)
        return view.doc is not None and bool(view.doc.get("rolled_back"))

    def mark_tx_rolled_back(self, tx_id: str, now_ms: int) -> None:
        view = self._view(tx_id)
        marker = {
            "reason": "rolled back before this participant saw the request",
            "updated_ms": now_ms,
        }
        try:
            if view.doc is None:
                doc = {
                    "_id": view.doc_id,
                    "participant": view.participant,
                    "tx_id": tx_id,
                    "rev": 1,
                    "steps": [],
                    "rolled_back": marker,
                    "finished_ms": now_ms,
                }
                try:
                    self._txs.insert_one(doc, session=self.transaction_session())
                except mongo_errors.DuplicateKeyError as exc:
                    raise self._tx_raced(tx_id) from exc
                view.doc = doc
                self._keep(view)
            elif not view.doc.get("rolled_back"):
                rev = int(view.doc["rev"])
                change: Document = {"rolled_back": marker, "rev": rev + 1}
                if not view.doc.get("steps"):
                    change["finished_ms"] = max(int(view.doc.get("finished_ms") or 0), now_ms)
                self._update_tx(view, {"rev": rev}, {"$set": change})
            self._commit()
        finally:
            self.release_locks()

    def known_fingerprint(self, tx_id: str) -> str | None:
        _check_tx_id(tx_id)
        view = self._entry_view(tx_id)  # a speculated-new transaction has none
        fingerprint = None if view.doc is None else view.doc.get("fingerprint")
        return fingerprint if isinstance(fingerprint, str) else None

    def mark_tx_seen(self, item: RequestSeen) -> None:
        view = self._view(item.tx_id)
        try:
            if view.doc is None:
                doc = _seen_doc(view.participant, item)
                try:
                    self._txs.insert_one(doc, session=self.transaction_session())
                except mongo_errors.DuplicateKeyError as exc:
                    raise self._tx_raced(item.tx_id) from exc
                view.doc = doc
                self._keep(view)
            elif not view.doc.get("steps") and not view.doc.get("fingerprint"):
                rev = int(view.doc["rev"])
                seen = _seen_doc(view.participant, item)
                change = {k: seen[k] for k in ("seen", "fingerprint")}
                finished = max(int(view.doc.get("finished_ms") or 0), seen["finished_ms"])
                self._update_tx(
                    view,
                    {"rev": rev},
                    {"$set": {**change, "finished_ms": finished, "rev": rev + 1}},
                )
            self._commit()
        finally:
            self.release_locks()

    # -- writes

    def write(self, entry: LedgerEntry) -> None:
        staged = self.native.take_staged()
        try:
            view = self._views.get((self.storage.name, entry.tx_id)) or self._view(entry.tx_id)
            current = self._step(view, entry.step)
            if self.storage.transactional:
                self._write_in_transaction(view, entry, current, staged)
            else:
                self._write_through_intent(view, entry, current, staged)
            self._commit()
        finally:
            self.release_locks()

    def rollback_effect(self) -> None:
        self.native.take_staged()
        if self._session is not None and self._session.in_transaction:
            # A custom handler may have written directly inside the transaction.
            self._session.abort_transaction()
        self.release_locks()

    def _commit(self) -> None:
        if self._session is not None and self._session.in_transaction:
            self._session.commit_transaction()

    def _created(self, view: _TxView, step: int, fields: Mapping[str, Any]) -> Document:
        return {
            "_id": view.step_id(step),
            "participant": view.participant,
            "tx_id": view.tx_id,
            "step": step,
            "rev": 1,
            **fields,
        }

    def _write_in_transaction(
        self,
        view: _TxView,
        entry: LedgerEntry,
        current: Document | None,
        staged: DocumentWrite | None,
    ) -> None:
        fields = _entry_fields(entry)
        if staged is not None:
            rev = 1 if current is None else int(current["rev"]) + 1
            marker = _new_marker(view.step_id(entry.step), rev, staged)
            self._run_staged(staged, marker)
            if staged.kind == "delete":
                collection = self.storage.db[staged.target]
                _purge(collection, staged.key, marker, self.transaction_session(), self._cas)
        if current is None:
            self._register(view, entry, None, self._created(view, entry.step, fields))
        else:
            rev = int(current["rev"])
            change = {"$set": {**fields, "rev": rev + 1}, "$unset": {"pending": ""}}
            self._update_step(view, entry, change)

    def _write_through_intent(
        self,
        view: _TxView,
        entry: LedgerEntry,
        current: Document | None,
        staged: DocumentWrite | None,
    ) -> None:
        """The module doc's protocol for one ledger entry and the write it records."""
        step = entry.step
        fields = _entry_fields(entry)
        if current is None:
            if staged is None:
                self._register(view, entry, None, self._created(view, step, fields))
                return
            marker = _new_marker(view.step_id(step), 1, staged)
            self._register(view, entry, self._intent(staged, marker, fields), None)
            self._write_document(staged, marker, lambda: self._discard_creation(view, step, marker))
            self._finalise(view, entry, None, fields, staged, marker)
        else:
            rev = int(current["rev"])
            if staged is None:
                self._update_step(view, entry, {"$set": {**fields, "rev": rev + 1}})
                return
            marker = _new_marker(view.step_id(step), rev + 1, staged)
            intent = self._intent(staged, marker, fields)
            self._update_step(view, entry, {"$set": {"pending": intent, "rev": rev + 1}})
            discard = {"$set": {"rev": rev + 2}, "$unset": {"pending": ""}}
            self._write_document(staged, marker, lambda: self._update_step(view, entry, discard))
            self._finalise(view, entry, rev + 1, fields, staged, marker)

    def _intent(self, staged: DocumentWrite, marker: str, fields: Document) -> Document:
        return {
            "doc": _doc_id(staged.target, staged.key),
            "write": staged.to_bson(),
            "marker": marker,
            "entry": fields,
            "owner": self.storage.owner,
            "at_ms": _now_ms(),
        }

    def _register(
        self,
        view: _TxView,
        entry: LedgerEntry,
        intent: Document | None,
        created: Document | None,
    ) -> None:
        """List a new step in the transaction document (with its creation ``intent``), then
        insert its step document ``created`` if given; both by insert when the
        transaction is new."""
        step = entry.step
        session = self.transaction_session()
        if view.doc is None:
            doc: Document = {
                "_id": view.doc_id,
                "participant": view.participant,
                "tx_id": view.tx_id,
                "rev": 1,
                "steps": [step],
            }
            if entry.fingerprint is not None:
                doc["fingerprint"] = entry.fingerprint
            if intent is not None:
                doc["pending"] = {_pending_key(step): intent}
            try:
                self._txs.insert_one(doc, session=session)
            except mongo_errors.DuplicateKeyError as exc:
                if view.speculative:
                    raise _Speculation(view.tx_id) from exc
                raise self._tx_raced(view.tx_id) from exc
            view.doc = doc
            view.speculative = False
            self._keep(view)
            if created is not None:
                self._insert_step(created, entry, session)
        else:
            rev = int(view.doc["rev"])
            change: Document = {"$set": {"rev": rev + 1}}
            expect: Document = {"rev": rev}
            if not view.listed(step):
                change["$addToSet"] = {"steps": step}
            if entry.fingerprint is not None and "fingerprint" not in view.doc:
                change["$set"]["fingerprint"] = entry.fingerprint
            if "finished_ms" in view.doc:
                change["$unset"] = {"finished_ms": ""}  # its steps decide from now on
            if intent is not None:
                change["$set"][f"pending.{_pending_key(step)}"] = intent
                expect[f"pending.{_pending_key(step)}"] = ABSENT
            self._update_tx(view, expect, change)
            if created is not None:
                self._insert_step(created, entry, session)
        if created is not None:
            view.steps[step] = created

    def _insert_step(self, created: Document, entry: LedgerEntry, session: Any) -> None:
        try:
            self._ledger.insert_one(created, session=session)
        except mongo_errors.DuplicateKeyError as exc:
            raise self._raced(entry.tx_id, entry.step) from exc

    def _finalise(
        self,
        view: _TxView,
        entry: LedgerEntry,
        rev: int | None,
        fields: Document,
        staged: DocumentWrite,
        marker: str,
    ) -> None:
        """Record the entry once the write with ``marker`` took effect: create the step
        document (``rev`` ``None``), or set the entry and drop the intent.

        A new step's document is inserted with the storage's next batch of records
        (see :class:`_Unrecorded`), a delete's at once (the document is removed after).
        """
        fields = {**fields, **_purge_field(staged, marker)}
        if rev is not None:
            change = {"$set": {**fields, "rev": rev + 1}, "$unset": {"pending": ""}}
            self._update_step(view, entry, change)
        else:
            created = self._created(view, entry.step, fields)
            view.steps[entry.step] = created
            if staged.kind != "delete":
                lock = self._lock_name(staged.target, staged.key)
                self.storage.defer(_StepRecord(self.storage, created, lock, marker))
                return
            self._insert_step(created, entry, None)
        self._recorded(view, entry.step, staged, marker)

    def _update_step(
        self, view: _TxView, entry: LedgerEntry | tuple[str, int], change: Document
    ) -> Document:
        """Compare-and-set the step document on the ``rev`` last seen; the new document."""
        tx_id, step = (entry.tx_id, entry.step) if isinstance(entry, LedgerEntry) else entry
        current = view.steps[step]
        assert current is not None
        self.storage.record_now(current["_id"])
        ok = self._cas.update(
            self._ledger,
            current["_id"],
            {"rev": current["rev"]},
            change,
            self.transaction_session(),
        )
        if not ok:
            view.steps.pop(step, None)
            raise self._raced(tx_id, step)
        updated = _changed(current, change)
        view.steps[step] = updated
        return updated

    def _update_tx(self, view: _TxView, expect: Mapping[str, Any], change: Document) -> None:
        assert view.doc is not None
        ok = self._cas.update(self._txs, view.doc_id, expect, change, self.transaction_session())
        if not ok:
            raise self._tx_raced(view.tx_id)
        view.doc = _changed(view.doc, change)

    def _discard_creation(self, view: _TxView, step: int, marker: str) -> None:
        assert view.doc is not None
        rev = int(view.doc["rev"])
        key = f"pending.{_pending_key(step)}"
        self._update_tx(
            view,
            {"rev": rev, f"{key}.marker": marker},
            {"$set": {"rev": rev + 1}, "$unset": {key: ""}},
        )

    def _raced(self, tx_id: str, step: int) -> _Conflict:
        return _Conflict(
            f"participant {self.storage.name!r}: another worker recorded {tx_id} step "
            f"{step} at the same time; the batch will be retried"
        )

    def _tx_raced(self, tx_id: str) -> _Conflict:
        return _Conflict(
            f"participant {self.storage.name!r}: another worker recorded {tx_id} at the same "
            "time; the batch will be retried"
        )

    def _write_document(
        self, staged: DocumentWrite, marker: str, discard: Callable[[], Any]
    ) -> None:
        try:
            self._run_staged(staged, marker)
        except (_Refused, _Conflict):
            discard()
            raise

    def _run_staged(self, staged: DocumentWrite, marker: str) -> None:
        collection = self.storage.db[staged.target]
        try:
            done = staged.run(collection, marker, self.transaction_session(), self._cas)
        except mongo_errors.DocumentTooLarge as exc:
            reason = f"{staged.target}/{staged.key} would be too large a document ({exc})"
            raise _Refused(staged.target, staged.key, reason) from exc
        except mongo_errors.WriteError as exc:
            if _is_transient(exc):
                raise
            reason = f"{staged.target}/{staged.key}: the server refused the write ({_detail(exc)})"
            raise _Refused(staged.target, staged.key, reason) from exc
        if not done:
            raise _Conflict(
                f"participant {self.storage.name!r}: {staged.target}/{staged.key} changed while "
                "a step was writing it; the batch will be retried"
            )

    def _recorded(self, view: _TxView, step: int, staged: DocumentWrite, marker: str) -> None:
        """Step ``step`` records the write with ``marker``: remember that; after a delete,
        remove the document (see :meth:`_purge_named`)."""
        _SETTLED.put(self._lock_name(staged.target, staged.key), marker)
        doc = view.steps.get(step)
        if doc is not None and doc.get("purge") is not None:
            self._purge_named(view, step, doc)

    def _purge_named(self, view: _TxView, step: int, doc: Document) -> Document:
        """Remove the document a recorded delete marked, then the step's ``purge`` naming it.

        A delete's step document names the document until it is removed, so that a
        crash in between leaves the removal to whoever next loads the step.
        """
        purge = doc["purge"]
        collection = self.storage.db[purge["target"]]
        _purge(collection, purge["key"], purge["marker"], self.transaction_session(), self._cas)
        return self._update_step(
            view,
            (view.tx_id, step),
            {"$set": {"rev": int(doc["rev"]) + 1}, "$unset": {"purge": ""}},
        )

    # -- recovery

    def settle(self, target: str, key: Any, doc: Document | None) -> Document | None:
        """``doc`` as read under its lock, once the write whose marker it carries is recorded.

        A document a recorded delete marked is removed here and reads as absent.
        """
        if doc is None:
            return None
        marker = doc.get(MARKER_FIELD)
        names = _marker_names(marker)
        if names is None:
            return doc
        assert isinstance(marker, str)
        name = self._lock_name(target, key)
        record = _UNRECORDED.get(name)
        if record is not None:
            self._make_durable(record)
        if _SETTLED.get(name) != marker:
            self._ensure_recorded(names[0], marker)
            _SETTLED.put(name, marker)
        if marker.endswith(DELETED):
            collection = self.storage.db[target]
            _purge(collection, key, marker, self.transaction_session(), self._cas)
            return None
        return doc

    def _make_durable(self, record: _StepRecord) -> None:
        if record.owner is self.storage:
            self.storage.flush_records()  # this storage's whole batch, in one insert
        else:
            _insert_records(self._ledger, [record])

    def _ensure_recorded(self, step_id: str, marker: str) -> None:
        """Finish the intent with ``marker`` if it is unresolved (its write happened)."""
        parts = _split_step_id(step_id)
        if parts is None:
            return
        participant, tx_id, step = parts
        view = self._view(tx_id, participant)
        if step not in view.steps:  # read even if unlisted: the marker says it was written
            session = self.transaction_session()
            view.steps[step] = self._ledger.find_one({"_id": step_id}, session=session)
        doc = view.steps[step]
        if doc is not None:
            pending = doc.get("pending")
            if pending is not None and pending.get("marker") == marker:
                self._resolve_step(view, step, doc)
            return
        intent = view.creation(step)
        if intent is not None and intent.get("marker") == marker:
            self._resolve_creation(view, step, intent)
            return
        log.warning("a document carries the marker %s, which no ledger record names", marker)

    def _live(self, intent: Mapping[str, Any]) -> bool:
        return intent.get("owner") != self.storage.owner and (
            _now_ms() - int(intent.get("at_ms", 0)) < self.storage.intent_lease_ms
        )

    def _in_progress(self, view: _TxView, step: int, staged: DocumentWrite) -> _Conflict:
        return _Conflict(
            f"participant {self.storage.name!r}: {staged.target}/{staged.key} has a "
            f"write of {view.tx_id} step {step} in progress by another worker; the batch "
            "will be retried"
        )

    def _resolve_creation(self, view: _TxView, step: int, intent: Document) -> Document | None:
        """Finish or undo the write that was to create ``step``'s document."""
        staged = DocumentWrite.from_bson(intent["write"])
        marker = intent["marker"]
        session = self.transaction_session()
        self.lock(staged.target, staged.key)
        try:
            record = _UNRECORDED.get(self._lock_name(staged.target, staged.key))
            if record is not None and record.marker == marker:
                self._make_durable(record)  # written by a live storage of this process
                view.steps[step] = record.doc
                return record.doc
            if self._live(intent):
                raise self._in_progress(view, step, staged)
            collection = self.storage.db[staged.target]
            current = collection.find_one({"_id": staged.key}, session=session)
            if staged.happened(current, marker):
                created = self._created(
                    view, step, {**intent["entry"], **_purge_field(staged, marker)}
                )
                try:
                    self._ledger.insert_one(created, session=session)
                except mongo_errors.DuplicateKeyError:
                    # Recorded meanwhile by someone else: take theirs.
                    view.steps.pop(step, None)
                    view.steps[step] = self._ledger.find_one({"_id": created["_id"]})
                    return self._step(view, step)
                view.steps[step] = created
                self._recorded(view, step, staged, marker)
                log.info("finished the interrupted write of %s", view.step_id(step))
                return view.steps[step]
            self._fence(staged, current, marker)
            self._discard_creation(view, step, marker)
            view.steps[step] = None
            log.info("undid the interrupted write of %s", view.step_id(step))
            return None
        finally:
            self.unlock_last()

    def _resolve_step(self, view: _TxView, step: int, doc: Document) -> Document:
        """Finish or undo the write recorded as ``pending`` in step document ``doc``."""
        pending = doc["pending"]
        staged = DocumentWrite.from_bson(pending["write"])
        marker = pending["marker"]
        self.lock(staged.target, staged.key)
        try:
            if self._live(pending):
                raise self._in_progress(view, step, staged)
            collection = self.storage.db[staged.target]
            current = collection.find_one({"_id": staged.key}, session=self.transaction_session())
            rev = int(doc["rev"])
            if staged.happened(current, marker):
                fields = {**pending["entry"], **_purge_field(staged, marker)}
                change = {"$set": {**fields, "rev": rev + 1}, "$unset": {"pending": ""}}
                self._update_step(view, (view.tx_id, step), change)
                self._recorded(view, step, staged, marker)
                log.info("finished the interrupted write of %s", doc["_id"])
                updated = view.steps[step]
                assert updated is not None
                return updated
            self._fence(staged, current, marker)
            change = {"$set": {"rev": rev + 1}, "$unset": {"pending": ""}}
            updated = self._update_step(view, (view.tx_id, step), change)
            log.info("undid the interrupted write of %s", doc["_id"])
            return updated
        finally:
            self.unlock_last()

    def _fence(self, staged: DocumentWrite, current: Document | None, marker: str) -> None:
        """Make a write that did not happen miss for good, should a paused worker still run it."""
        if staged.kind == "insert" or current is None:
            return  # an insert misses once the document exists; nothing to fence on absence
        if current.get(MARKER_FIELD) != staged.expect:
            return  # changed since the intent was written: the write can no longer match
        self._cas.update(
            self.storage.db[staged.target],
            staged.key,
            {MARKER_FIELD: staged.expect},
            {"$set": {MARKER_FIELD: marker + FENCED}},
            self.transaction_session(),
        )


def _check_tx_id(tx_id: str) -> None:
    if not isinstance(tx_id, str) or not _TX_ID.fullmatch(tx_id):
        raise InvalidRecord(f"transaction id {tx_id!r} breaks the wire contract")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


# ---------------------------------------------------------------- error translation


def _is_transient(exc: mongo_errors.PyMongoError) -> bool:
    if isinstance(exc, mongo_errors.ConnectionFailure):
        return True
    if exc.has_error_label("TransientTransactionError") or exc.has_error_label(
        "RetryableWriteError"
    ):
        return True
    code = getattr(exc, "code", None)
    return code in _TRANSIENT_CODES


def _detail(exc: BaseException) -> str:
    """The first line of the server's or driver's message, passwords hidden."""
    details = getattr(exc, "details", None)
    text = str(details.get("errmsg")) if isinstance(details, Mapping) else str(exc)
    text = redact(text)
    text = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."


# ---------------------------------------------------------------- the storage


class MongoStorage(Storage):
    """A participant's MongoDB database: its target collections and its ledger.

    ``url`` is a ``mongodb://`` URL; the database is ``database``, else the URL's
    path, else ``saga``. ``targets`` are the collections steps may touch (the
    allow-list); collections are created by their first write. The ledger lives in
    ``ledger_collection`` (its step documents) and ``ledger_collection + "_tx"``
    (its transaction documents); :meth:`setup` creates their indexes.

    ``transactions``: ``None`` detects (see the module doc); ``True`` requires
    them (a :class:`ConfigurationError` when the server has none); ``False`` uses
    single-document writes even on a replica set. ``intent_lease_ms`` is how long
    an unfinished write of another worker is left alone before it is resolved.
    :meth:`setup` also detects FerretDB, whose compare-and-set writes are checked
    by the adapter (see *Concurrency* in the module doc).

    ``handlers`` as for :class:`~participants._sql.SqlStorage`; handlers receive a
    :class:`MongoSession` as ``native``. :meth:`execute` acts on every item in
    order, repeats included.
    """

    def __init__(
        self,
        name: str,
        url: str,
        targets: Iterable[str],
        *,
        database: str | None = None,
        ledger_collection: str = "saga_ledger",
        handlers: Actions | Mapping[str, Handler] | None = None,
        transactions: bool | None = None,
        intent_lease_ms: int = DEFAULT_INTENT_LEASE_MS,
        server_timeout_ms: int = 10_000,
    ) -> None:
        if not isinstance(name, str) or not PARTICIPANT_NAME.fullmatch(name):
            raise ConfigurationError(
                f"participant name {name!r} must be 1-64 letters, digits, '.', '_' or '-'"
            )
        self.name = name
        self.targets = frozenset(targets)
        for target in sorted(self.targets):
            _check_identifier(target, "target collection")
        _check_identifier(ledger_collection, "ledger collection")
        tx_collection = f"{ledger_collection}{TX_COLLECTION_SUFFIX}"
        clash = sorted({ledger_collection, tx_collection} & self.targets)
        if clash:
            raise ConfigurationError(
                f"the ledger collection {clash[0]!r} cannot also be a target: steps "
                "would be able to rewrite the ledger"
            )
        try:
            parsed = parse_uri(url)
        except (mongo_errors.InvalidURI, mongo_errors.ConfigurationError, ValueError) as exc:
            shown = redact_url(url)
            raise ConfigurationError(
                f"{shown!r} is not a MongoDB URL ({_detail(exc)}); give one such as "
                "mongodb://host:27017/saga"
            ) from exc
        database = database or parsed.get("database") or DEFAULT_DATABASE
        _check_database(database)
        hosts = ", ".join(f"{host}:{port}" for host, port in parsed["nodelist"])
        self.where = f"MongoDB at {hosts}/{database}"
        self.client: MongoClient[Document] = MongoClient(
            url,
            serverSelectionTimeoutMS=server_timeout_ms,
            connectTimeoutMS=server_timeout_ms,
            connect=False,
        )
        self.db: Database[Document] = self.client[database]
        self.ledger_collection: Collection[Document] = self.db[ledger_collection]
        self.tx_collection: Collection[Document] = self.db[tx_collection]
        self.lock_scope = f"{hosts}/{database}"
        self.owner = uuid.uuid4().hex
        self.intent_lease_ms = intent_lease_ms
        self._want_transactions = transactions
        self.transactional = False
        self.ferretdb = False
        self.cas = _SERVER_CAS
        self.tx_cache: _Lru[str, _TxView] = _Lru(TX_CACHE_SIZE)
        self._unrecorded: dict[str, _StepRecord] = {}
        self._ready = False
        builtin = MongoActions(self.targets)
        self.actions: Actions = combine(builtin, handlers)

    # -- lifecycle

    def setup(self) -> None:
        """Create the ledger's indexes and decide the mode; idempotent.

        The indexes serve audits (:meth:`ledger`, :meth:`in_flight_sequential`) on
        MongoDB; the work itself addresses documents by ``_id`` only. The index on
        ``pending.doc`` an earlier layout used is dropped.

        Raises :class:`TransientError` when the server is unreachable and
        :class:`ConfigurationError` when ``transactions=True`` but the server has none.
        """
        with self._boundary("set up its ledger"):
            self.client.admin.command("ping")
            self.ferretdb = "ferretdbVersion" in self.client.admin.command("buildInfo")
            ledger = self.ledger_collection
            ledger.create_index(
                [("participant", ASCENDING), ("tx_id", ASCENDING), ("step", ASCENDING)],
                name="saga_by_tx",
            )
            ledger.create_index(
                [("participant", ASCENDING), ("status", ASCENDING)], name="saga_by_status"
            )
            for collection in (ledger, self.tx_collection):
                collection.create_index(
                    [("participant", ASCENDING), ("finished_ms", ASCENDING)],
                    name="saga_by_finish",
                )
            if "saga_pending" in {index["name"] for index in ledger.list_indexes()}:
                ledger.drop_index("saga_pending")
            supported = self._transactions_supported()
        if self._want_transactions and not supported:
            raise ConfigurationError(
                f"{self.where} has no multi-document transactions (run MongoDB as a replica "
                "set, or leave transactions to be detected)"
            )
        self.transactional = supported and self._want_transactions is not False
        self.cas = _Cas(server_side=not self.ferretdb)
        self._ready = True

    def _transactions_supported(self) -> bool:
        hello = self.client.admin.command("hello")
        if "setName" not in hello and hello.get("msg") != "isdbgrid":
            return False
        try:
            with self.client.start_session() as session, session.start_transaction():
                self.ledger_collection.find_one({"_id": None}, session=session)
        except mongo_errors.OperationFailure:
            return False
        return True

    def close(self) -> None:
        self.flush_records(quietly=True)
        self.client.close()

    # -- work

    def execute(self, items: Sequence[WorkItem]) -> list[Report]:
        """Run the batch item by item, each step's write atomic with its ledger record.

        Raises :class:`TransientError` when the server is unavailable or a write
        conflicted: the items before took effect, the rest did not, and retrying
        the batch is safe because the finished items re-report from the ledger.
        """
        if not self._ready:
            self.setup()
        reports: list[Report] = []
        seen: list[RequestSeen] = []
        with self._boundary("run a batch"):
            try:
                for item in items:
                    if isinstance(item, RequestSeen):
                        seen.append(item)
                        continue
                    self._mark_seen(seen)  # before any item that may read those ledgers
                    seen = []
                    reports.extend(self._run(item))
                self._mark_seen(seen)
            except BaseException as exc:
                if not isinstance(exc, mongo_errors.ConnectionFailure):
                    self.flush_records(quietly=True)  # else the next flush or reader does
                raise
            self.flush_records()
        return reports

    def _mark_seen(self, items: Sequence[RequestSeen]) -> None:
        """Insert the seen markers of a run of requests without a step here (one
        ``insert_many``; a transaction document already there means the transaction is
        known, and stays as it is)."""
        docs: dict[str, Document] = {}
        for item in items:
            _check_tx_id(item.tx_id)
            if self.tx_cache.get(item.tx_id) is None:
                docs.setdefault(item.tx_id, _seen_doc(self.name, item))
        if not docs:
            return
        try:
            self.tx_collection.insert_many(list(docs.values()), ordered=False)
        except mongo_errors.BulkWriteError as exc:
            errors = exc.details.get("writeErrors") or []
            if not errors or any(error.get("code") != _DUPLICATE_KEY for error in errors):
                raise

    def defer(self, record: _StepRecord) -> None:
        """Insert ``record`` with the next batch of records (see :class:`_Unrecorded`)."""
        self._unrecorded[record.doc["_id"]] = record
        _UNRECORDED.add(record)

    def record_now(self, step_id: str) -> None:
        """Make sure the step document ``step_id`` is inserted before it is changed."""
        if step_id in self._unrecorded:
            self.flush_records()

    def flush_records(self, *, quietly: bool = False) -> None:
        """Insert the step documents deferred so far, in one ``insert_many``.

        ``quietly``: a failure is logged, not raised (another error is on its way);
        the records stay registered, so they are inserted by the next flush or by
        whoever touches their documents first, and their intents cover a crash.
        """
        if not self._unrecorded:
            return
        records = list(self._unrecorded.values())
        try:
            _insert_records(self.ledger_collection, records)
        except mongo_errors.PyMongoError as exc:
            if not quietly:
                raise
            log.warning(
                "participant %r could not record %d applied steps yet (%s); they are recorded "
                "later, or recovered from their intents",
                self.name,
                len(records),
                _detail(exc),
            )
            return
        for record in records:
            self._unrecorded.pop(record.doc["_id"], None)

    def _run(self, item: WorkItem) -> list[Report]:
        refused: dict[tuple[str, str], str] = {}
        speculate = isinstance(item, Requested)
        while True:
            unit = _MongoUnit(self, refused, speculate=speculate)
            try:
                return run_item(unit, self.actions, item)
            except _Speculation:
                speculate = False  # the ledger knows the transaction: run it reading the ledger
            except _Refused as exc:
                unit.forget()
                speculate = False  # the intent made the transaction known to the ledger
                # Run the item again; this time the action finds the write refused and
                # the step fails (or its compensation does) with the server's reason.
                if (exc.target, _doc_id(exc.target, exc.key)) in refused:
                    raise
                refused[(exc.target, _doc_id(exc.target, exc.key))] = exc.reason
            except BusinessRejection as exc:
                # Only a custom confirm gets here (run_item turns the others into
                # events): the step stays applied and a replayed decision retries it.
                log.error(
                    "participant %r: confirming %s was rejected and is left for a replayed "
                    "decision: %s",
                    self.name,
                    item.tx_id,
                    exc.reason,
                )
                return []
            except BaseException:
                unit.forget()
                raise
            finally:
                unit.close()

    # -- pruning

    def prune(self, horizon_ms: int, limit: int) -> int:
        """Remove the ledger documents of up to ``limit`` transactions finished at or before
        ``horizon_ms`` (found through step documents, or transaction documents holding
        only markers); return how many entries (steps and markers) went.

        A transaction goes as a whole, its transaction document first (it holds the
        intents, and a spent intent would otherwise re-create a removed step document
        from its marker); step documents a crash left behind are found again and removed.
        A transaction with a step not finished yet keeps everything, and its finished
        step documents lose ``finished_ms`` (they are looked at again when that step
        finishes), so it never blocks the next runs.
        """
        if not self._ready:
            self.setup()
        due = {"participant": self.name, "finished_ms": {"$lte": horizon_ms}}
        removed = 0
        with self._boundary("prune its ledger"):
            self.flush_records()
            found: dict[str, list[str]] = {}
            query = {**due, "pending": {"$exists": False}, "purge": {"$exists": False}}
            for doc in self.ledger_collection.find(query, {"tx_id": 1}).limit(limit):
                found.setdefault(doc["tx_id"], []).append(doc["_id"])
            for doc in self.tx_collection.find(due, {"tx_id": 1}).limit(limit):
                found.setdefault(doc["tx_id"], [])
            for tx_id, step_ids in found.items():
                removed += self._prune_tx(tx_id, step_ids, horizon_ms)
        return removed

    def _prune_tx(self, tx_id: str, step_ids: list[str], horizon_ms: int) -> int:
        self.tx_cache.pop(tx_id)
        doc = self.tx_collection.find_one({"_id": _tx_doc_id(self.name, tx_id)})
        if doc is None:  # left behind by a crash between the two deletes below
            gone = self.ledger_collection.delete_many({"_id": {"$in": step_ids}})
            return gone.deleted_count
        steps: list[Document] = []
        for step in doc.get("steps", []):
            step_doc = self.ledger_collection.find_one({"_id": _step_id(self.name, tx_id, step)})
            if step_doc is None:
                if _pending_key(step) in (doc.get("pending") or {}):
                    return 0  # an unresolved creation: its step's next reader settles it
                continue
            steps.append(step_doc)
        finishes = [
            None
            if "status" not in d or d.get("pending") or d.get("purge")
            else finished_ms(_entry_of(d))
            for d in steps
        ]
        if not steps and int(doc.get("finished_ms", horizon_ms + 1)) > horizon_ms:
            return 0  # markers only, not finished long enough
        if any(f is None or f > horizon_ms for f in finishes):
            for d, f in zip(steps, finishes, strict=True):
                if f is not None and "finished_ms" in d:
                    self.ledger_collection.update_one(
                        {"_id": d["_id"]}, {"$unset": {"finished_ms": ""}}
                    )
            return 0
        if not self.cas.delete(self.tx_collection, doc["_id"], {"rev": doc["rev"]}):
            return 0  # changed meanwhile: a later run looks again
        if steps:
            self.ledger_collection.delete_many({"_id": {"$in": [d["_id"] for d in steps]}})
        return len(steps) + sum(1 for name in ("rolled_back", "seen") if doc.get(name))

    # -- reading the ledger

    def ledger(self, tx_id: str | None = None) -> list[LedgerEntry]:
        """The recorded step entries as stored (unfinished writes are not resolved here)."""
        with self._boundary("read its ledger"):
            if tx_id is None:
                query = {"participant": self.name, "step": {"$gte": 0}, "status": {"$exists": True}}
                docs = list(self.ledger_collection.find(query))
            else:
                found = self.tx_collection.find_one({"_id": _tx_doc_id(self.name, tx_id)})
                docs = []
                for step in [] if found is None else found.get("steps", []):
                    doc = self.ledger_collection.find_one({"_id": _step_id(self.name, tx_id, step)})
                    if doc is not None and "status" in doc:
                        docs.append(doc)
        docs.sort(key=lambda doc: (doc["tx_id"], doc["step"]))
        return [_entry_of(doc) for doc in docs]

    def in_flight_sequential(self) -> set[str]:
        """Sequential transactions with a step waiting for its predecessor, or applied or
        failed and not decided yet (its rollback may wait for its successor's
        compensation, and the predecessor's event, read again after a crash, reports it
        again).

        The runtime calls this at start-up and after every partition assignment, so
        the storage also forgets the ledger state it remembered (see *Cache* in the
        module doc): transactions may have been worked on elsewhere meanwhile.
        """
        self.tx_cache.clear()
        query = {
            "participant": self.name,
            "step": {"$gte": 0},
            "mode": str(Mode.SEQUENTIAL),
            "$or": [
                {"status": str(LedgerStatus.WAITING)},
                {"status": {"$in": [str(LedgerStatus.APPLIED), str(LedgerStatus.FAILED)]}},
            ],
        }
        with self._boundary("read its ledger"):
            return {doc["tx_id"] for doc in self.ledger_collection.find(query, {"tx_id": 1})}

    # -- errors

    @contextmanager
    def _boundary(self, what: str) -> Iterator[None]:
        """Translate the driver's errors into the saga error tree (see the module doc)."""
        try:
            yield
        except mongo_errors.PyMongoError as exc:
            self._translate(exc, what)

    def _translate(self, exc: mongo_errors.PyMongoError, what: str) -> NoReturn:
        prefix = f"participant {self.name!r} could not {what}"
        if getattr(exc, "code", None) == _AUTHENTICATION_FAILED:
            raise ConfigurationError(
                f"{prefix}: authentication failure: {self.where} refused the credentials "
                f"({_detail(exc)}); fix the user name, password, authSource or authMechanism "
                "in the storage URL"
            ) from exc
        if isinstance(exc, mongo_errors.ConnectionFailure):
            raise TransientError(
                f"{prefix}: {self.where} is unavailable ({_detail(exc)}); retrying is safe"
            ) from exc
        code = getattr(exc, "code", None)
        if not _is_transient(exc) and code in _CONFIGURATION_CODES:
            raise ConfigurationError(
                f"{prefix}: {self.where} refused a command ({_detail(exc)}); check the user's "
                "privileges and that the server supports it"
            ) from exc
        raise TransientError(
            f"{prefix}: {self.where} failed ({_detail(exc)}); retrying is safe"
        ) from exc


def _check_identifier(name: Any, what: str) -> None:
    if not isinstance(name, str) or not IDENTIFIER.fullmatch(name):
        raise ConfigurationError(
            f"{what} name {name!r} is not a plain name (1-63 letters, digits or _, "
            "not starting with a digit)"
        )


def _check_database(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,63}", name):
        raise ConfigurationError(f"database name {name!r} must be 1-63 letters, digits, '_' or '-'")


__all__ = ["DocumentWrite", "MongoActions", "MongoSession", "MongoStorage", "canonical_key"]
