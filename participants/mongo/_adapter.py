"""The MongoDB storage: documents and the step ledger, changed together as far as the server allows.

Why this module is over 700 lines: most of it is this description of the
write protocol, which every other ``_mongo_*`` module implements a part of; it is
kept whole, next to the storage that runs it.

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
  of the business document, the write, and a share of two batched inserts (its
  transaction document, see *Batched intents*, and its step document); a decision
  on a step this storage recorded costs one update of its step document (see
  *Cache*).

Batched intents. On a batch's first attempt without transactions, the transaction
documents of the new transactions whose step writes (not a delete) are not inserted
one by one: step (1) of each is left to one ``insert_many(ordered=False)`` of the
batch, and its (2) and (3) run after that insert, in batch order
(:meth:`MongoStorage.flush_intents`). On FerretDB that insert costs the server about
a twentieth of one insert per document. Until then the step's document lock stays
held, by the batch rather than by the item (:class:`~participants._mongo_unit._DeferredIntent`),
and the intents go in earlier whenever something would look past them: an item
locking a document a pending intent holds, or reading the ledger of a transaction
with a pending intent, or any lock the batch would have to wait for (so a batch
never waits on another thread while holding the locks of its pending writes).
Why the protocol's guarantees hold unchanged:

* *Each intent is absent or present, and the write follows its own intent only.*
  No write of the batch runs before the insert returns, and a write runs only if
  its own document went in. So whatever part of the insert happened (``ordered=False``
  may insert any subset; a crash or a lost connection may stop it anywhere), every
  new step is in one of today's two states: no transaction document (the step never
  started: nothing here knows it, and its re-delivered request runs it as new), or
  a transaction document with its intent and, maybe, its write (the state a crash
  between (1) and (2) or (2) and (3) leaves on the one-by-one path, resolved the same
  way: rolled forward when the document carries the marker, else fenced and
  discarded). Intents of one batch are independent: each names its own document
  (two steps of a batch on one document are never pending together: the second one
  locks the document, which runs the first one's intent first).
* *No step applied twice.* A transaction document already there (a re-delivered
  request after a crash, a rollback marker, a seen marker, another worker's step)
  makes that document's insert fail alone, with a duplicate key, and its write is
  not run: the others' writes run, then the batch runs again
  (:class:`~participants._storage.RunBatchAgain`) with intents one by one, where the
  item reads the ledger and the barrier decides as before. The items of the batch that
  took effect are repeats in the second run and report the same.
* *Compensation only of what was applied; a late request after a rollback refused.*
  A decision or a request that reads the transaction's ledger sees its intent
  (inserted first, see above), never a guess: a rollback that finds an intent whose
  write did not happen discards it (null compensation, and the rollback marker
  refuses the request later); one whose write happened compensates it. A rollback
  marker written before the request makes the request's insert fail, as above.
* *A failed write.* A write that misses (its document changed) or that the server
  refuses discards its intent exactly as on the one-by-one path, and the batch runs
  again: this time the item meets the change or the refusal itself.

A failure of the batch before its insert gives the pending intents up (nothing of
them was written); after it, each intent left without its write is one more
interrupted write, resolved by its next reader.

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
across every :class:`MongoStorage` of the process (the locks, like the memo and
the unrecorded steps above, belong to one :class:`~participants._mongo_shared.SharedState`,
which all storages share by default). On FerretDB (detected from ``buildInfo``)
a compare-and-set is an ``_id``-only ``findAndModify`` returning
the document as it was, checked by the adapter; a mismatch (a change made since
the read, by someone else) is put back at once and counts as a conflict. On
MongoDB the conditions are part of the filter, atomic. The runtime handles one
batch at a time and owns a transaction's partition alone, so one process per
participant is safe on FerretDB. Several processes writing the *same* documents
(two workers of one participant, or another application) rely on the server's
single-document atomicity: correct on MongoDB, lossy on FerretDB.

Guarantees (docs/architecture.md §4). On MongoDB with transactions each step's change and its
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

import logging
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import ClassVar, Final, NoReturn

from pymongo import ASCENDING, MongoClient
from pymongo import errors as mongo_errors
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.uri_parser import parse_uri

from saga.participants._actions import check_identifier
from saga.participants._barrier import LedgerEntry, LedgerStatus, Requested, finished_ms
from saga.participants._handlers import Handler, combine
from saga.participants._ledger import seen_marker
from saga.participants._storage import (
    Actions,
    LedgerStorage,
    RequestSeen,
    RunBatchAgain,
    Unit,
    WorkItem,
)
from saga.participants.mongo._actions import MongoActions, MongoSession, canonical_key
from saga.participants.mongo._cas import _SERVER_CAS, _Cas
from saga.participants.mongo._errors import (
    _AUTHENTICATION_FAILED,
    _CONFIGURATION_CODES,
    _DUPLICATE_KEY,
    _Conflict,
    _detail,
    _is_transient,
    _Refused,
    _Speculation,
)
from saga.participants.mongo._ledger import (
    PARTICIPANT_NAME,
    TX_COLLECTION_SUFFIX,
    _check_tx_id,
    _entry_of,
    _pending_key,
    _seen_doc,
    _step_id,
    _tx_doc_id,
    _TxView,
)
from saga.participants.mongo._shared import PROCESS, SharedState, _Lru, _StepRecord
from saga.participants.mongo._unit import _DeferredIntent, _MongoUnit
from saga.participants.mongo._values import Document
from saga.participants.mongo._writes import DocumentWrite, _doc_id
from saga.streams import (
    ConfigurationError,
    Mode,
    TransientError,
)
from saga.streams._faults import NO_FAULTS, Faults
from saga.streams._secrets import redact_url

log = logging.getLogger("saga.participant.mongo")

DEFAULT_DATABASE: Final = "saga"
DEFAULT_INTENT_LEASE_MS: Final = 15_000
TX_CACHE_SIZE: Final = 10_000
"""Transactions whose ledger documents a storage remembers (see *Cache* in the module doc)."""


class MongoStorage(LedgerStorage[MongoSession, None]):
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
    by the adapter (see *Concurrency* in the module doc). ``shared``: the document
    locks and memories this storage shares with the others of the process
    (:class:`~participants._mongo_shared.SharedState`).

    ``handlers`` as for :class:`~participants._sql.SqlStorage`; handlers receive a
    :class:`MongoSession` as ``native``. ``faults``: the crash tests' hooks
    (:mod:`streams._faults`). The batch loop, the error boundary and the policy for
    a rejected confirmation are :class:`~participants._storage.LedgerStorage`'s;
    each item is its own atomic unit here (a transaction, or the intent protocol).
    """

    driver_errors: ClassVar[tuple[type[BaseException], ...]] = (mongo_errors.PyMongoError,)

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
        shared: SharedState = PROCESS,
        faults: Faults = NO_FAULTS,
    ) -> None:
        super().__init__(faults=faults)
        if not isinstance(name, str) or not PARTICIPANT_NAME.fullmatch(name):
            raise ConfigurationError(
                f"participant name {name!r} must be 1-64 letters, digits, '.', '_' or '-'"
            )
        self.name = name
        self.targets = frozenset(targets)
        for target in sorted(self.targets):
            check_identifier(target, "target collection")
        check_identifier(ledger_collection, "ledger collection")
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
        self.shared = shared
        self._unrecorded: dict[str, _StepRecord] = {}
        self._deferring = False
        self._intents: list[_DeferredIntent] = []
        self._intent_locks: set[tuple[str, str, str]] = set()
        self._intent_txs: set[str] = set()
        builtin = MongoActions(self.targets)
        self.actions: Actions[MongoSession] = combine(builtin, handlers)

    # -- lifecycle

    def prepare(self) -> None:
        """Create the ledger's indexes and decide the mode; idempotent.

        The indexes serve audits (:meth:`ledger`, :meth:`in_flight_sequential`) on
        MongoDB; the work itself addresses documents by ``_id`` only. The index on
        ``pending.doc`` an earlier layout used is dropped.

        Raises :class:`TransientError` when the server is unreachable and
        :class:`ConfigurationError` when ``transactions=True`` but the server has none.
        """
        with self.boundary("set up its ledger"):
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

    @contextmanager
    def open_batch(self, items: Sequence[WorkItem], attempt: int) -> Iterator[None]:
        """A batch has no scope of its own here: each item is atomic with its ledger record
        (the items before a failure took effect, the rest did not). The transaction
        documents of the batch's new transactions go in together, and their writes run
        after them (*Batched intents* in the module doc; on a first attempt only). The
        step documents of the batch's new steps are inserted at its end; after a failure
        too, unless the connection is lost (then the next flush or reader does it)."""
        self._deferring = attempt == 0 and not self.transactional
        try:
            yield None
            self.flush_intents()
        except BaseException as exc:
            self._drop_intents()
            if not isinstance(exc, mongo_errors.ConnectionFailure):
                self.flush_records(quietly=True)
            raise
        finally:
            self._deferring = False
        self.flush_records()

    def open_unit(
        self, batch: None, item: WorkItem, previous: Unit[MongoSession] | None
    ) -> _MongoUnit:
        """A request runs as new without reading the ledger when this storage does not
        know its transaction (``speculate``); an attempt after another runs reading
        it, and knows the writes the server refused before."""
        if previous is None:
            return _MongoUnit(self, {}, speculate=isinstance(item, Requested))
        assert isinstance(previous, _MongoUnit)
        return _MongoUnit(self, previous.refused)

    def run_again(self, unit: Unit[MongoSession], exc: Exception) -> bool:
        """Run again after a failed speculation (the ledger knows the transaction) or a
        refused write (this time the action finds it refused, and the step or its
        compensation fails with the server's reason; a second refusal is raised)."""
        if isinstance(exc, _Speculation):
            return True
        if isinstance(exc, _Refused):
            assert isinstance(unit, _MongoUnit)
            document = (exc.target, _doc_id(exc.target, exc.key))
            if document in unit.refused:
                return False
            unit.refused[document] = exc.reason
            return True
        return False

    def mark_seen(self, batch: None, items: Sequence[RequestSeen]) -> None:
        """Insert the seen markers of a run of requests without a step here (one
        ``insert_many``; a transaction document already there means the transaction is
        known, and stays as it is)."""
        if any(item.tx_id in self._intent_txs for item in items):
            self.flush_intents()
        docs: dict[str, Document] = {}
        for item in items:
            _check_tx_id(item.tx_id)
            if self.tx_cache.get(item.tx_id) is None:
                marker = seen_marker(
                    item.tx_id,
                    fingerprint=item.fingerprint,
                    deadline_ms=item.deadline_ms,
                    now_ms=item.now_ms,
                )
                docs.setdefault(item.tx_id, _seen_doc(self.name, marker))
        if not docs:
            return
        try:
            self.tx_collection.insert_many(list(docs.values()), ordered=False)
        except mongo_errors.BulkWriteError as exc:
            errors = exc.details.get("writeErrors") or []
            if not errors or any(error.get("code") != _DUPLICATE_KEY for error in errors):
                raise

    # -- batched intents (see the module doc)

    def defers_intents(self) -> bool:
        """Whether a new transaction's document may wait for the batch's ``insert_many``."""
        return self._deferring

    def intents_pending(self) -> bool:
        return bool(self._intents)

    def intent_holds(self, lock: tuple[str, str, str]) -> bool:
        """Whether a pending intent of the batch holds the document lock ``lock``."""
        return lock in self._intent_locks

    def intent_for(self, tx_id: str) -> bool:
        """Whether a pending intent of the batch belongs to transaction ``tx_id``."""
        return tx_id in self._intent_txs

    def defer_intent(self, deferred: _DeferredIntent) -> None:
        self._intents.append(deferred)
        self._intent_locks.add(deferred.locks[0])
        self._intent_txs.add(deferred.view.tx_id)

    def flush_intents(self) -> None:
        """Insert the pending transaction documents in one ``insert_many``, then run the
        writes of those inserted, in batch order; their records join the next batch of
        records. Every pending document lock is released at the end, whatever happened.

        A document found already there (the transaction is known: the request ran on a
        guess, or another worker got there first), a write the server refused or one
        that found its document changed (its intent is discarded, as on the one-by-one
        path) make the batch run again (:class:`RunBatchAgain`), once the others are
        done: the second attempt runs item by item and reads what it needs.
        """
        group, self._intents = self._intents, []
        self._intent_locks.clear()
        self._intent_txs.clear()
        if not group:
            return
        try:
            again = False
            skipped: set[int] = set()
            try:
                self.tx_collection.insert_many([d.doc for d in group], ordered=False)
            except mongo_errors.BulkWriteError as exc:
                errors = exc.details.get("writeErrors") or []
                if not errors or any(error.get("code") != _DUPLICATE_KEY for error in errors):
                    raise
                skipped = {int(error["index"]) for error in errors}
                again = True
            for index, deferred in enumerate(group):
                if index in skipped:
                    continue
                try:
                    deferred.unit.run_deferred(deferred)
                except (_Refused, _Conflict):
                    deferred.unit.forget()
                    again = True
        finally:
            for deferred in group:
                for name in reversed(deferred.locks):
                    self.shared.locks.release(name)
        if again:
            raise RunBatchAgain

    def _drop_intents(self) -> None:
        """Give up the pending intents after a failure: nothing of them was written."""
        group, self._intents = self._intents, []
        self._intent_locks.clear()
        self._intent_txs.clear()
        for deferred in group:
            for name in reversed(deferred.locks):
                self.shared.locks.release(name)

    def defer(self, record: _StepRecord) -> None:
        """Insert ``record`` with the next batch of records (see :class:`_Unrecorded`)."""
        self._unrecorded[record.doc["_id"]] = record
        self.shared.unrecorded.add(record)

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
            self.shared.insert_records(self.ledger_collection, records)
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
        with self.boundary("prune its ledger"):
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
        with self.boundary("read its ledger"):
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
        again). A commit leaves an applied step as it is, so a committed sequential saga
        stays listed until its entries are pruned.

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
        with self.boundary("read its ledger"):
            return {doc["tx_id"] for doc in self.ledger_collection.find(query, {"tx_id": 1})}

    # -- errors

    def translate(self, exc: BaseException, what: str) -> NoReturn:
        """The saga error for a driver error (see *Errors* in the module doc)."""
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
        transient = isinstance(exc, mongo_errors.PyMongoError) and _is_transient(exc)
        if not transient and code in _CONFIGURATION_CODES:
            raise ConfigurationError(
                f"{prefix}: {self.where} refused a command ({_detail(exc)}); check the user's "
                "privileges and that the server supports it"
            ) from exc
        raise TransientError(
            f"{prefix}: {self.where} failed ({_detail(exc)}); retrying is safe"
        ) from exc


def _check_database(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,63}", name):
        raise ConfigurationError(f"database name {name!r} must be 1-63 letters, digits, '_' or '-'")


__all__ = ["DocumentWrite", "MongoActions", "MongoSession", "MongoStorage", "canonical_key"]
