"""What the MongoDB storages of one process share: document locks, the memo of markers
known to be recorded, and the step documents created but not inserted yet.

See *Concurrency* and the write protocol in :mod:`saga.participants.mongo`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Generic, TypeVar

from pymongo import errors as mongo_errors
from pymongo.collection import Collection

from saga.participants.mongo._errors import _DUPLICATE_KEY
from saga.participants.mongo._values import Document

if TYPE_CHECKING:
    from saga.participants.mongo._batch import BatchWrites


SETTLED_CACHE_SIZE: Final = 100_000
"""Business documents whose marker a :class:`SharedState` knows to be recorded."""


_K = TypeVar("_K")
_V = TypeVar("_V")


class _DocumentLocks:
    """Re-entrant locks per ``(scope, collection, key)``, created on demand."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._locks: dict[tuple[str, str, str], tuple[threading.RLock, int]] = {}

    def acquire(self, name: tuple[str, str, str], *, blocking: bool = True) -> bool:
        """Take the lock (``blocking=False``: only if free now); whether it was taken."""
        with self._mutex:
            lock, users = self._locks.get(name, (threading.RLock(), 0))
            self._locks[name] = (lock, users + 1)
        if lock.acquire(blocking=blocking):
            return True
        self._leave(name)
        return False

    def release(self, name: tuple[str, str, str]) -> None:
        self._leave(name).release()

    def _leave(self, name: tuple[str, str, str]) -> threading.RLock:
        """One user fewer of ``name``'s lock (forgotten with its last user); the lock."""
        with self._mutex:
            lock, users = self._locks[name]
            if users == 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)
        return lock


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
    """A step document to insert: its write took effect, with ``marker``, on document ``lock``;
    ``owner``: the batch of the storage that deferred it."""

    owner: BatchWrites
    doc: Document
    lock: tuple[str, str, str]
    marker: str


class _Unrecorded:
    """The step documents created by a write that are not inserted yet.

    A storage inserts the step documents of the new steps it applied in batches
    (:meth:`~saga.participants.mongo._batch.BatchWrites.flush_records`); until then
    the write's intent and marker make them recoverable, and whoever touches the
    written document first inserts the record (:meth:`_MongoUnit.settle`), so a marker is never
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


class SharedState:
    """What the MongoDB storages of one process share, owned by one object.

    ``locks``: the per-document locks that serialise writers of one document
    (see *Concurrency* in :mod:`saga.participants.mongo`). ``settled``: document lock
    name -> a marker it carried whose write is known to be recorded in the ledger
    (it spares a ledger read). ``unrecorded``: the step documents created by a
    write and not inserted yet (:class:`_Unrecorded`). ``reserved``: the steps whose
    reservation this process wrote and has not removed since (by a commit, a release or
    a hold of its saga that took it in): only those are committed without a read (see
    :mod:`saga.participants.mongo._holds`), since only for them is the reservation sure
    to be there, which the write relies on should the process die before it could put
    back a write that did not fit.

    Every :class:`~saga.participants.mongo.MongoStorage` uses :data:`PROCESS` unless
    given another: storages that may write the same documents must share one, or
    they neither wait for each other nor find each other's unrecorded steps. A
    fresh one is what a new process would have (tests use that).
    """

    def __init__(self) -> None:
        self.locks = _DocumentLocks()
        self.settled = _Lru[tuple[str, str, str], str](SETTLED_CACHE_SIZE)
        self.unrecorded = _Unrecorded()
        self.reserved = _Lru[str, bool](SETTLED_CACHE_SIZE)

    def insert_records(self, ledger: Collection[Document], records: Sequence[_StepRecord]) -> None:
        """Insert deferred step documents (one already there was recorded by someone else)."""
        try:
            ledger.insert_many([record.doc for record in records], ordered=False)
        except mongo_errors.BulkWriteError as exc:
            errors = exc.details.get("writeErrors") or []
            if not errors or any(error.get("code") != _DUPLICATE_KEY for error in errors):
                raise
        for record in records:
            self.settled.put(record.lock, record.marker)
            self.unrecorded.done(record)


PROCESS: Final = SharedState()
"""The state the MongoDB storages of this process share by default."""
