"""The MongoDB storage (:class:`MongoStorage`): its collections, its mode, its batches,
reading its ledger and translating the driver's errors. The write protocol it runs is
described in the package doc (:mod:`saga.participants.mongo`).
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
from saga.participants._barrier import LedgerEntry, LedgerStatus, Requested
from saga.participants._handlers import Handler, combine
from saga.participants._ledger import seen_marker
from saga.participants._storage import (
    Actions,
    LedgerStorage,
    RequestSeen,
    Unit,
    WorkItem,
)
from saga.participants._store_errors import StoreErrors
from saga.participants.mongo._actions import MongoActions
from saga.participants.mongo._batch import BatchWrites
from saga.participants.mongo._cas import _SERVER_CAS, _Cas
from saga.participants.mongo._document import canonical_key
from saga.participants.mongo._errors import (
    _AUTHENTICATION_FAILED,
    _CONFIGURATION_CODES,
    _DUPLICATE_KEY,
    _detail,
    _is_transient,
    _Refused,
    _Speculation,
    _Stale,
    step_refusal,
)
from saga.participants.mongo._holds import SHADOW_SUFFIX
from saga.participants.mongo._ledger import (
    PARTICIPANT_NAME,
    TX_COLLECTION_SUFFIX,
    _check_tx_id,
    _decided,
    _decision_id,
    _entry_of,
    _find_step,
    _seen_doc,
    _step_id,
    _tx_doc_id,
    _TxView,
)
from saga.participants.mongo._prune import LedgerPruner
from saga.participants.mongo._session import MongoSession
from saga.participants.mongo._shared import PROCESS, SharedState, _Lru
from saga.participants.mongo._unit import _MongoUnit
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
"""Transactions whose ledger documents a storage remembers (see *Cache* in the package doc)."""


class MongoStorage(LedgerStorage[MongoSession, None]):
    """A participant's MongoDB database: its target collections and its ledger.

    ``url`` is a ``mongodb://`` URL; the database is ``database``, else the URL's
    path, else ``saga``. ``targets`` are the collections steps may touch (the
    allow-list); collections are created by their first write. The ledger lives in
    ``ledger_collection`` (its step documents) and ``ledger_collection + "_tx"``
    (its transaction documents); :meth:`setup` creates their indexes. The shadow
    documents of records held before they exist live in ``ledger_collection +
    "_holds"`` (see :mod:`saga.participants.mongo._holds`).

    ``transactions``: ``None`` detects (see the package doc); ``True`` requires
    them (a :class:`ConfigurationError` when the server has none); ``False`` uses
    single-document writes even on a replica set. ``intent_lease_ms`` is how long
    an unfinished write of another worker is left alone before it is resolved.
    :meth:`setup` also detects FerretDB, whose compare-and-set writes are checked
    by the adapter (see *Concurrency* in the package doc). ``shared``: the document
    locks and memories this storage shares with the others of the process
    (:class:`~saga.participants.mongo._shared.SharedState`).

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
        shadow_collection = f"{ledger_collection}{SHADOW_SUFFIX}"
        clash = sorted({ledger_collection, tx_collection, shadow_collection} & self.targets)
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
            # A request the server never answers fails (and its batch is retried)
            # instead of stopping the participant for ever.
            socketTimeoutMS=max(30_000, 3 * server_timeout_ms),
            connect=False,
        )
        self.db: Database[Document] = self.client[database]
        self.ledger_collection: Collection[Document] = self.db[ledger_collection]
        self.tx_collection: Collection[Document] = self.db[tx_collection]
        self.shadow_collection: Collection[Document] = self.db[shadow_collection]
        self.lock_scope = f"{hosts}/{database}"
        self.owner = uuid.uuid4().hex
        self.intent_lease_ms = intent_lease_ms
        self._want_transactions = transactions
        self.transactional = False
        self.ferretdb = False
        self.narrows_by_id = True
        self.cas = _SERVER_CAS
        self.tx_cache: _Lru[str, _TxView] = _Lru(TX_CACHE_SIZE)
        self.shared = shared
        self.batch = BatchWrites(
            name, self.tx_collection, self.ledger_collection, shared, self.tx_cache
        )
        builtin = MongoActions(self.targets)
        # What the server answers about an action's own operation is that step's refusal.
        self.actions: Actions[MongoSession] = StoreErrors(
            combine(builtin, handlers),
            lambda exc, what: step_refusal(exc, what, "FerretDB" if self.ferretdb else "MongoDB"),
        )

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
            self.narrows_by_id = not self.ferretdb or self._narrows_by_id()
        if self._want_transactions and not supported:
            raise ConfigurationError(
                f"{self.where} has no multi-document transactions (run MongoDB as a replica "
                "set, or leave transactions to be detected)"
            )
        self.transactional = supported and self._want_transactions is not False
        self.cas = _Cas(server_side=not self.ferretdb)

    def _narrows_by_id(self) -> bool:
        """Whether FerretDB hands SQLite the ``_id`` of a filter that names ``_id`` and more
        (``filterPushdown`` in its ``explain``): a stock FerretDB v1 does so only for a
        filter that is exactly ``{"_id": ...}``, and decodes the whole collection for any
        other; the build of ``infra/services.sh`` does so whenever the filter names
        ``_id`` (every handler still checks the whole filter on the document found)."""
        probe = {"find": self.ledger_collection.name, "filter": {"_id": "saga-probe", "rev": 1}}
        try:
            explained = self.db.command("explain", probe)
        except mongo_errors.OperationFailure:
            return False
        return explained.get("filterPushdown") is True

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
        self.batch.flush_records(quietly=True)
        self.batch.drop_writes()
        self.batch.drop_decisions()
        self.client.close()

    # -- work

    @contextmanager
    def open_batch(self, items: Sequence[WorkItem], attempt: int) -> Iterator[None]:
        """A batch has no scope of its own here: each item is atomic with its ledger record
        (the items before a failure took effect, the rest did not). The transaction
        documents of the batch's new transactions go in together, and their writes run
        after them (*Batched intents* in the package doc; on a first attempt only). The
        step documents of the batch's new steps are inserted at its end; after a failure
        too, unless the connection is lost (then the next flush or reader does it). The
        records of its idempotent decisions are inserted at its end too, after the writes
        of those left to the batch's bulk update (``BatchWrites.flush_writes``; after a
        failure both are given up: those decisions run again)."""
        batch = self.batch
        batch.deferring = attempt == 0 and not self.transactional
        try:
            yield None
            batch.flush_pending()
        except BaseException as exc:
            batch.drop_intents()
            batch.drop_writes()
            batch.drop_decisions()
            if not isinstance(exc, mongo_errors.ConnectionFailure):
                batch.flush_records(quietly=True)
            raise
        finally:
            batch.deferring = False
        batch.flush_records()
        batch.flush_decisions()

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
        """Run again after a failed speculation (the ledger knows the transaction), an
        optimistic write that missed (this time it reads), or a refused write (this time
        the action finds it refused, and the step or its compensation fails with the
        server's reason; a second refusal is raised)."""
        if isinstance(exc, _Speculation | _Stale):
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
        if any(self.batch.intent_for(item.tx_id) for item in items):
            self.batch.flush_intents()
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
        pruner = LedgerPruner(self.name, self.ledger_collection, self.tx_collection, self.cas)
        removed = 0
        with self.boundary("prune its ledger"):
            self.batch.flush_records()
            for tx_id, step_ids in pruner.due(horizon_ms, limit).items():
                self.tx_cache.pop(tx_id)
                removed += pruner.prune_tx(tx_id, step_ids, horizon_ms)
        return removed

    # -- reading the ledger

    def ledger(self, tx_id: str | None = None) -> list[LedgerEntry]:
        """The recorded step entries as stored (unfinished writes are not resolved here)."""
        with self.boundary("read its ledger"):
            ledger = self.ledger_collection
            if tx_id is None:
                query = {"participant": self.name, "step": {"$gte": 0}, "status": {"$exists": True}}
                decided = {"participant": self.name, "decides": {"$gte": 0}}
                decisions = {d["_id"]: d for d in ledger.find(decided)}
                docs = [
                    _decided(doc, decisions.get(_decision_id(doc["_id"])))
                    for doc in ledger.find(query)
                ]
            else:
                found = self.tx_collection.find_one({"_id": _tx_doc_id(self.name, tx_id)})
                docs = []
                for step in [] if found is None else found.get("steps", []):
                    doc = _find_step(ledger, _step_id(self.name, tx_id, step))
                    if doc is not None and "status" in doc:
                        docs.append(doc)
        docs.sort(key=lambda doc: (doc["tx_id"], doc["step"]))
        return [_entry_of(doc) for doc in docs]

    def in_flight_sequential(self) -> set[str]:
        """Sequential transactions with a step waiting for its predecessor, or applied or
        failed and not decided yet (its rollback may wait for its successor's
        compensation, and the predecessor's event, read again after a crash, reports it
        again). A commit leaves an applied step as it is, so a committed sequential saga
        stays listed until its entries are pruned; so does one whose decision is recorded
        in a decision document (its step document still says applied).

        The runtime calls this at start-up and after every partition assignment, so
        the storage also forgets the ledger state it remembered (see *Cache* in the
        package doc): transactions may have been worked on elsewhere meanwhile.
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
        """The saga error for a driver error (see *Errors* in the package doc)."""
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
