"""The MongoDB storage: documents and the step ledger, changed together as far as the server allows.

pymongo is imported here only. Target collections hold the business documents
(``_id`` = the step's key); the ledger is one collection (``saga_ledger`` by
default) in the same database, one document per ``(participant, tx_id, step)``
with ``_id = "<participant>:<tx_id>:<step>"`` (participant names have no ``:``,
so the id is unambiguous) and a revision counter ``rev``. Step ``-1`` is the
transaction-level rollback marker, as in the SQL ledger.

Effects are staged, not run
---------------------------
A built-in action reads what it needs through :class:`MongoSession`, checks it
(raising :class:`~streams.BusinessRejection`), and *stages* one
:class:`DocumentWrite`: a single-document insert, update, replace or delete,
compare-and-set on the ``_saga`` field it read. The unit runs the staged write
when the step's ledger entry is written (:meth:`Unit.write`), so a rejected step
has nothing to undo (:meth:`Unit.rollback_effect` drops the staged write) and
the write knows the ledger record it belongs to. Every write sets ``_saga`` on
the document to a marker ``"<ledger id>#<rev>"``, unique per ledger transition.

Two modes (``transactions=None`` detects at :meth:`MongoStorage.setup`)
-------------------------------------------------------------------------
* **Transactions** (MongoDB as a replica set or a sharded cluster; ``hello``
  names a ``setName`` and a probe transaction succeeds): every ledger write and
  the staged write it records run in one multi-document transaction, committed
  before the next step of the batch; reads run inside it too. Custom handlers
  may write directly with ``session=native.session``.
* **Single-document writes** (FerretDB, a standalone ``mongod``): no
  multi-document atomicity, so each staged write ``W`` goes through an intent
  recorded in the ledger document itself:

  1. *intent* — the ledger document gets ``pending`` = {the write, the entry
     to record, the marker, the owner and time} (compare-and-set on ``rev``);
  2. *W* — one single-document write that sets ``_saga`` to the marker (or, for
     a delete, removes the document), compare-and-set on the ``_saga`` it read;
  3. *finalise* — the ledger document gets the entry and loses ``pending``.

  Whoever finds a ``pending`` intent resolves it before going on: the unit when
  it reads the transaction's ledger (a re-delivered request or decision after a
  crash), and any action about to touch the same document (an index on
  ``pending.doc`` finds them). ``W`` happened iff the document carries the
  marker (for a delete: iff the document is gone — nothing else may touch a
  document with an unresolved intent, so nothing else can have removed it). If
  it happened the intent is finalised (roll forward), otherwise discarded (roll
  back) after *fencing*: the document's ``_saga`` is changed, so a late ``W``
  from a paused worker fails its compare-and-set. An intent of another live
  worker is left alone for ``intent_lease_ms`` (the batch fails with a
  :class:`~streams.TransientError` and is retried); one written by this process
  is never live when found, because this process holds the document's lock
  while an intent is open.

Concurrency. FerretDB v1 runs an update as read-then-write, so two concurrent
writers of one document can lose an update even with a compare-and-set filter.
The adapter therefore serialises writes per ``(database, collection, key)``
inside the process (a lock held from the action's read to its ledger write),
across every :class:`MongoStorage` of the process. The runtime handles one batch
at a time and owns a transaction's partition alone, so one process per
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
import re
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Final, Literal, NoReturn

from bson import json_util
from bson.json_util import JSONMode, JSONOptions
from pymongo import ASCENDING, MongoClient
from pymongo import errors as mongo_errors
from pymongo.client_session import ClientSession
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.uri_parser import parse_uri

from participants._actions import (
    IDENTIFIER,
    INT64_MAX,
    INT64_MIN,
    Delete,
    Increment,
    Insert,
    Key,
    Put,
    Update,
    parse_action,
)
from participants._barrier import LedgerEntry, LedgerStatus
from participants._handlers import Handler, combine
from participants._storage import Actions, Report, Storage, Unit, WorkItem, run_item
from streams import (
    TX_ID_PATTERN,
    BusinessRejection,
    ConfigurationError,
    InvalidRecord,
    Mode,
    TransientError,
)

log = logging.getLogger("saga.participant.mongo")

Document = dict[str, Any]

MARKER_STEP: Final = -1
"""The ledger step of the transaction-level rollback marker (as in the SQL ledger)."""
MARKER_FIELD: Final = "_saga"
"""The field of a business document naming the last saga write (``<ledger id>#<rev>``)."""
PARTICIPANT_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""Participant names as the wire contract allows them (no ``:``: it separates ledger ids)."""
DEFAULT_DATABASE: Final = "saga"
DEFAULT_INTENT_LEASE_MS: Final = 15_000

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
_CONFIGURATION_CODES: Final = frozenset(
    {
        13,  # Unauthorized
        18,  # AuthenticationFailed
        20,  # IllegalOperation (e.g. transactions on a standalone server)
        115,  # CommandNotSupported
        238,  # NotImplemented (FerretDB)
    }
)


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

    def run(self, collection: Collection[Document], marker: str, session: Any) -> bool:
        """Run the write; whether it took effect (``False``: the document changed meanwhile)."""
        where: Document = {"_id": self.key, MARKER_FIELD: self.expect, **self.guard}
        if self.kind == "insert":
            try:
                collection.insert_one(
                    {"_id": self.key, **self.document, MARKER_FIELD: marker}, session=session
                )
            except mongo_errors.DuplicateKeyError:
                return False
            return True
        if self.kind == "delete":
            return collection.delete_one(where, session=session).deleted_count == 1
        if self.kind == "replace":
            replacement = {**self.document, MARKER_FIELD: marker}
            return collection.replace_one(where, replacement, session=session).matched_count == 1
        change: Document = {"$set": {**self.set, MARKER_FIELD: marker}}
        if self.unset:
            change["$unset"] = dict.fromkeys(self.unset, "")
        return collection.update_one(where, change, session=session).matched_count == 1

    def happened(self, current: Document | None, marker: str) -> bool:
        """Whether this write (with ``marker``) is what ``current`` shows."""
        if self.kind == "delete":
            return current is None
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


def _doc_id(target: str, key: Any) -> str:
    """A string naming one document of the database, for the ``pending.doc`` index."""
    kind = "i" if isinstance(key, int) else "s"
    return f"{target}/{kind}:{key}"


# ---------------------------------------------------------------- per-document locks


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


_LOCKS: Final = _DocumentLocks()


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

        Resolves any unfinished write of another step on it first (see the module doc).
        """
        collection = self.collection(target)
        self._unit.lock(target, key)
        self._unit.settle_document(target, key)
        return collection.find_one({"_id": key}, session=self.session)

    def stage(self, write: DocumentWrite) -> None:
        """Run ``write`` together with this step's ledger entry (one write per step)."""
        self.collection(write.target)
        refused = self._unit.refused.get((write.target, _doc_id(write.target, write.key)))
        if refused is not None:
            raise BusinessRejection(refused)
        if self._staged is not None:
            raise RuntimeError("a step may stage one document write; this one staged two")
        if not self._unit.holds(write.target, write.key):
            # A handler that writes without reading first still waits its turn.
            self._unit.lock(write.target, write.key)
            self._unit.settle_document(write.target, write.key)
        self._staged = write

    def take_staged(self) -> DocumentWrite | None:
        staged, self._staged = self._staged, None
        return staged


def _session(native: Any) -> MongoSession:
    if not isinstance(native, MongoSession):
        raise TypeError(f"Mongo actions need a MongoSession as native, not {type(native).__name__}")
    return native


# ---------------------------------------------------------------- built-in actions


class MongoActions(Actions):
    """The built-in actions on documents (``native`` must be a :class:`MongoSession`).

    ``put`` sets the given fields and keeps the others; its compensation puts the
    whole old document back (or deletes a created one). ``update``'s before-image
    is ``{"fields": {old values}, "absent": [fields it added]}``. ``increment``
    checks the bounds on the value it read and writes the result with that value
    as a guard; its compensation subtracts ``by`` without bounds. Every write is a
    :class:`DocumentWrite` staged for the ledger write.
    """

    def __init__(self, targets: Iterable[str]) -> None:
        self.targets = frozenset(targets)

    def apply(self, native: Any, action: str, args: Mapping[str, Any]) -> Any:
        session = _session(native)
        parsed = parse_action(action, args, self.targets)
        record = _Record(session, parsed.target, parsed.key)
        if isinstance(parsed, Insert):
            return record.insert(parsed.value)
        if isinstance(parsed, Put):
            return record.put(parsed.value)
        if isinstance(parsed, Update):
            return record.update(parsed.set)
        if isinstance(parsed, Delete):
            return record.delete()
        return record.increment(parsed)

    def compensate(self, native: Any, action: str, args: Mapping[str, Any], before: Any) -> None:
        session = _session(native)
        parsed = parse_action(action, args, self.targets)
        record = _Record(session, parsed.target, parsed.key)
        if isinstance(parsed, Insert):
            record.remove()
        elif isinstance(parsed, Put):
            record.restore_put(before)
        elif isinstance(parsed, Update):
            record.restore_fields(before)
        elif isinstance(parsed, Delete):
            record.reinsert(before)
        else:
            record.increment_back(parsed, before)

    def confirm(self, native: Any, action: str, args: Mapping[str, Any]) -> None:
        """Nothing to do: a built-in action holds nothing beyond its write."""


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
    )


class _Conflict(TransientError):
    """Another worker changed the same ledger record or document at the same time."""


class _Refused(Exception):
    """The server refused a staged write for its content; the step must fail instead."""

    def __init__(self, target: str, key: Any, reason: str) -> None:
        super().__init__(reason)
        self.target = target
        self.key = key
        self.reason = reason


# ---------------------------------------------------------------- the unit


class _MongoUnit(Unit):
    """One work item's reads and writes; see the module doc for the write protocol.

    ``_revs`` remembers the ``rev`` of every ledger document read (``None``: none
    exists), so every ledger write is a compare-and-set on it (an insert when
    absent): a worker that lost a race gets a :class:`TransientError`, never
    overwrites the other's record.
    """

    def __init__(self, storage: MongoStorage, refused: Mapping[tuple[str, str], str]) -> None:
        self.storage = storage
        self.refused = refused
        self.native = MongoSession(self)
        self._ledger = storage.ledger_collection
        self._revs: dict[tuple[str, int], int | None] = {}
        self._held: list[tuple[str, str, str]] = []
        self._session: ClientSession | None = None

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

    def lock(self, target: str, key: Any) -> None:
        name = (self.storage.lock_scope, target, _doc_id(target, key))
        _LOCKS.acquire(name)
        self._held.append(name)

    def holds(self, target: str, key: Any) -> bool:
        return (self.storage.lock_scope, target, _doc_id(target, key)) in self._held

    def unlock_last(self) -> None:
        _LOCKS.release(self._held.pop())

    def release_locks(self) -> None:
        held, self._held = self._held, []
        for name in reversed(held):
            _LOCKS.release(name)

    # -- reads

    def _id(self, tx_id: str, step: int) -> str:
        return f"{self.storage.name}:{tx_id}:{step}"

    def _load(self, tx_id: str, step: int) -> Document | None:
        session = self.transaction_session()
        doc = self._ledger.find_one({"_id": self._id(tx_id, step)}, session=session)
        if doc is not None and doc.get("pending") is not None:
            self.resolve(doc)
            doc = self._ledger.find_one({"_id": self._id(tx_id, step)}, session=session)
        self._revs[(tx_id, step)] = None if doc is None else doc["rev"]
        return doc

    def entry(self, tx_id: str, step: int) -> LedgerEntry | None:
        _check_tx_id(tx_id)
        doc = self._load(tx_id, step)
        return None if doc is None or "status" not in doc else _entry_of(doc)

    def entries(self, tx_id: str) -> list[LedgerEntry]:
        _check_tx_id(tx_id)
        query = {"participant": self.storage.name, "tx_id": tx_id, "step": {"$gte": 0}}
        session = self.transaction_session()
        docs = list(self._ledger.find(query, session=session).sort("step", ASCENDING))
        unresolved = [doc for doc in docs if doc.get("pending") is not None]
        for doc in unresolved:
            self.resolve(doc)
        if unresolved:
            docs = list(self._ledger.find(query, session=session).sort("step", ASCENDING))
        for doc in docs:
            self._revs[(tx_id, doc["step"])] = doc["rev"]
        return [_entry_of(doc) for doc in docs if "status" in doc]

    def tx_rolled_back(self, tx_id: str) -> bool:
        return self.entry(tx_id, MARKER_STEP) is not None

    def mark_tx_rolled_back(self, tx_id: str, now_ms: int) -> None:
        marker = LedgerEntry(
            tx_id=tx_id,
            step=MARKER_STEP,
            status=LedgerStatus.COMPENSATED,
            reason="rolled back before this participant saw the request",
            updated_ms=now_ms,
        )
        self.write(marker)

    # -- writes

    def write(self, entry: LedgerEntry) -> None:
        key = (entry.tx_id, entry.step)
        if key not in self._revs:
            self._load(entry.tx_id, entry.step)
        rev = self._revs[key]
        ledger_id = self._id(entry.tx_id, entry.step)
        staged = self.native.take_staged()
        fields = _entry_fields(entry)
        try:
            if staged is None:
                self._revs[key] = self._put(ledger_id, entry, rev, fields)
            elif self.storage.transactional:
                marker = f"{ledger_id}#{(rev or 0) + 1}"
                self._run_staged(staged, marker)
                self._revs[key] = self._put(ledger_id, entry, rev, fields)
            else:
                self._revs[key] = self._write_through_intent(ledger_id, entry, rev, fields, staged)
            if self._session is not None and self._session.in_transaction:
                self._session.commit_transaction()
        finally:
            self.release_locks()

    def rollback_effect(self) -> None:
        self.native.take_staged()
        if self._session is not None and self._session.in_transaction:
            # A custom handler may have written directly inside the transaction.
            self._session.abort_transaction()
        self.release_locks()

    def _put(self, ledger_id: str, entry: LedgerEntry, rev: int | None, fields: Document) -> int:
        """Write the ledger record (compare-and-set on ``rev``); the new ``rev``."""
        session = self.transaction_session()
        if rev is None:
            doc = {
                "_id": ledger_id,
                "participant": self.storage.name,
                "tx_id": entry.tx_id,
                "step": entry.step,
                "rev": 1,
                **fields,
            }
            try:
                self._ledger.insert_one(doc, session=session)
            except mongo_errors.DuplicateKeyError as exc:
                raise self._raced(entry) from exc
            return 1
        change = {"$set": {**fields, "rev": rev + 1}, "$unset": {"pending": ""}}
        result = self._ledger.update_one({"_id": ledger_id, "rev": rev}, change, session=session)
        if result.matched_count != 1:
            raise self._raced(entry)
        return rev + 1

    def _raced(self, entry: LedgerEntry) -> _Conflict:
        return _Conflict(
            f"participant {self.storage.name!r}: another worker recorded {entry.tx_id} step "
            f"{entry.step} at the same time; the batch will be retried"
        )

    def _write_through_intent(
        self,
        ledger_id: str,
        entry: LedgerEntry,
        rev: int | None,
        fields: Document,
        staged: DocumentWrite,
    ) -> int:
        """Steps 1-3 of the module doc's protocol; the ledger record's new ``rev``."""
        marker = f"{ledger_id}#{(rev or 0) + 1}"
        pending = {
            "doc": _doc_id(staged.target, staged.key),
            "write": staged.to_bson(),
            "marker": marker,
            "entry": fields,
            "owner": self.storage.owner,
            "at_ms": _now_ms(),
        }
        if rev is None:
            doc = {
                "_id": ledger_id,
                "participant": self.storage.name,
                "tx_id": entry.tx_id,
                "step": entry.step,
                "rev": 1,
                "pending": pending,
            }
            try:
                self._ledger.insert_one(doc)
            except mongo_errors.DuplicateKeyError as exc:
                raise self._raced(entry) from exc
            opened = 1
        else:
            result = self._ledger.update_one(
                {"_id": ledger_id, "rev": rev}, {"$set": {"pending": pending, "rev": rev + 1}}
            )
            if result.matched_count != 1:
                raise self._raced(entry)
            opened = rev + 1
        try:
            self._run_staged(staged, marker)
        except (_Refused, _Conflict):
            self._discard(ledger_id, opened)
            raise
        return self._finalise(ledger_id, opened, fields, entry)

    def _run_staged(self, staged: DocumentWrite, marker: str) -> None:
        collection = self.storage.db[staged.target]
        try:
            done = staged.run(collection, marker, self.transaction_session())
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

    def _finalise(self, ledger_id: str, rev: int, fields: Document, entry: LedgerEntry) -> int:
        change = {"$set": {**fields, "rev": rev + 1}, "$unset": {"pending": ""}}
        if self._ledger.update_one({"_id": ledger_id, "rev": rev}, change).matched_count != 1:
            raise self._raced(entry)
        return rev + 1

    def _discard(self, ledger_id: str, rev: int) -> None:
        self._ledger.update_one(
            {"_id": ledger_id, "rev": rev}, {"$set": {"rev": rev + 1}, "$unset": {"pending": ""}}
        )

    # -- recovery

    def settle_document(self, target: str, key: Any) -> None:
        """Resolve unfinished writes of any step on ``target/key`` (the lock is held)."""
        session = self.transaction_session()
        for doc in self._ledger.find({"pending.doc": _doc_id(target, key)}, session=session):
            self.resolve(doc)

    def resolve(self, doc: Document) -> None:
        """Finish or undo the unfinished write recorded in ledger document ``doc``."""
        pending = doc["pending"]
        staged = DocumentWrite.from_bson(pending["write"])
        self.lock(staged.target, staged.key)
        try:
            self._resolve_locked(doc, pending, staged)
        finally:
            self.unlock_last()

    def _resolve_locked(self, doc: Document, pending: Document, staged: DocumentWrite) -> None:
        session = self.transaction_session()
        now = self._ledger.find_one({"_id": doc["_id"]}, session=session)
        if now is None or now.get("pending") is None or now["rev"] != doc["rev"]:
            return  # resolved meanwhile
        live = pending.get("owner") != self.storage.owner and (
            _now_ms() - int(pending.get("at_ms", 0)) < self.storage.intent_lease_ms
        )
        if live:
            raise _Conflict(
                f"participant {self.storage.name!r}: {staged.target}/{staged.key} has a "
                f"write of {doc['tx_id']} step {doc['step']} in progress by another "
                "worker; the batch will be retried"
            )
        collection = self.storage.db[staged.target]
        current = collection.find_one({"_id": staged.key}, session=session)
        rev = int(now["rev"])
        if staged.happened(current, pending["marker"]):
            change = {"$set": {**pending["entry"], "rev": rev + 1}, "$unset": {"pending": ""}}
            self._ledger.update_one({"_id": doc["_id"], "rev": rev}, change, session=session)
            log.info("finished the interrupted write of %s", doc["_id"])
            return
        if current is not None and current.get(MARKER_FIELD) == staged.expect:
            # Fence: the write may still be in flight from a paused worker; make it miss.
            collection.update_one(
                {"_id": staged.key, MARKER_FIELD: current.get(MARKER_FIELD)},
                {"$set": {MARKER_FIELD: f"{pending['marker']}!fenced"}},
                session=session,
            )
        self._ledger.update_one(
            {"_id": doc["_id"], "rev": rev},
            {"$set": {"rev": rev + 1}, "$unset": {"pending": ""}},
            session=session,
        )
        log.info("undid the interrupted write of %s", doc["_id"])


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
    details = getattr(exc, "details", None)
    text = str(details.get("errmsg")) if isinstance(details, Mapping) else str(exc)
    text = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."


# ---------------------------------------------------------------- the storage


class MongoStorage(Storage):
    """A participant's MongoDB database: its target collections and its ledger.

    ``url`` is a ``mongodb://`` URL; the database is ``database``, else the URL's
    path, else ``saga``. ``targets`` are the collections steps may touch (the
    allow-list); collections are created by their first write. The ledger lives in
    ``ledger_collection``; :meth:`setup` creates its indexes.

    ``transactions``: ``None`` detects (see the module doc); ``True`` requires
    them (a :class:`ConfigurationError` when the server has none); ``False`` uses
    single-document writes even on a replica set. ``intent_lease_ms`` is how long
    an unfinished write of another worker is left alone before it is resolved.

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
        if ledger_collection in self.targets:
            raise ConfigurationError(
                f"the ledger collection {ledger_collection!r} cannot also be a target: steps "
                "would be able to rewrite the ledger"
            )
        try:
            parsed = parse_uri(url)
        except (mongo_errors.InvalidURI, mongo_errors.ConfigurationError, ValueError) as exc:
            raise ConfigurationError(
                f"{url!r} is not a MongoDB URL (e.g. mongodb://host:27017/saga): {exc}"
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
        self.lock_scope = f"{hosts}/{database}"
        self.owner = uuid.uuid4().hex
        self.intent_lease_ms = intent_lease_ms
        self._want_transactions = transactions
        self.transactional = False
        self._ready = False
        builtin = MongoActions(self.targets)
        self.actions: Actions = combine(builtin, handlers)

    # -- lifecycle

    def setup(self) -> None:
        """Create the ledger's indexes and decide the mode; idempotent.

        Raises :class:`TransientError` when the server is unreachable and
        :class:`ConfigurationError` when ``transactions=True`` but the server has none.
        """
        with self._boundary("set up its ledger"):
            self.client.admin.command("ping")
            ledger = self.ledger_collection
            ledger.create_index(
                [("participant", ASCENDING), ("tx_id", ASCENDING), ("step", ASCENDING)],
                name="saga_by_tx",
            )
            ledger.create_index(
                [("participant", ASCENDING), ("status", ASCENDING)], name="saga_by_status"
            )
            ledger.create_index([("pending.doc", ASCENDING)], name="saga_pending", sparse=True)
            supported = self._transactions_supported()
        if self._want_transactions and not supported:
            raise ConfigurationError(
                f"{self.where} has no multi-document transactions (run MongoDB as a replica "
                "set, or leave transactions to be detected)"
            )
        self.transactional = supported and self._want_transactions is not False
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
        with self._boundary("run a batch"):
            for item in items:
                reports.extend(self._run(item))
        return reports

    def _run(self, item: WorkItem) -> list[Report]:
        refused: dict[tuple[str, str], str] = {}
        while True:
            unit = _MongoUnit(self, refused)
            try:
                return run_item(unit, self.actions, item)
            except _Refused as exc:
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
            finally:
                unit.close()

    # -- reading the ledger

    def ledger(self, tx_id: str | None = None) -> list[LedgerEntry]:
        query: Document = {
            "participant": self.name,
            "step": {"$gte": 0},
            "status": {"$exists": True},
        }
        if tx_id is not None:
            query["tx_id"] = tx_id
        with self._boundary("read its ledger"):
            docs = list(self.ledger_collection.find(query))
        docs.sort(key=lambda doc: (doc["tx_id"], doc["step"]))
        return [_entry_of(doc) for doc in docs]

    def in_flight_sequential(self) -> set[str]:
        """Sequential transactions with a step waiting for its predecessor, or applied (not
        the last) and so possibly waiting for its successor's compensation."""
        query = {
            "participant": self.name,
            "step": {"$gte": 0},
            "mode": str(Mode.SEQUENTIAL),
            "$or": [
                {"status": str(LedgerStatus.WAITING)},
                {"status": str(LedgerStatus.APPLIED), "last": False},
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
