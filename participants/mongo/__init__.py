"""The participant storage adapter for MongoDB and MongoDB-wire servers (FerretDB) through
pymongo: documents and the step ledger, changed together as far as the server allows.

This package doc describes the write protocol, which every module here implements a
part of: ``_adapter`` (:class:`MongoStorage`: open, check, run a batch, read the
ledger), ``_batch`` (what a batch does together), ``_prune`` (retention), the three
layers of a unit (``_unitbase``: views and locks, ``_recovery``: staged writes and
unfinished ones, ``_unit``: the protocol of one step), ``_session``
(:class:`MongoSession`, what actions get), ``_actions`` (the built-in actions),
``_holds`` (isolation: holds, reservations, bounds), ``_ledger`` (the ledger's
documents), ``_writes``/``_cas`` (single-document writes), ``_shared`` (what the
storages of a process share), ``_values`` and ``_errors``.

Target collections hold the business documents (``_id`` = the step's key). The
ledger is two collections in the same database (and a third holds the shadow
documents of isolation, below):

* ``saga_ledger`` (``ledger_collection``): one **step document** per
  ``(participant, tx_id, step)``, ``_id = "<participant>:<tx_id>:<step>"``
  (participant names have no ``:``), with the ledger entry's fields, a revision
  counter ``rev`` and, while a change of a recorded step is unfinished, ``pending``;
  beside it, ``_id = "<step id>/d"``, the **decision document** of a decision whose
  write was idempotent (``_ledger._decision_doc``: the entry fields it changed, for
  the step document's ``rev``), which every reader of the step applies;
* ``saga_ledger_tx``: one **transaction document** per ``(participant, tx_id)``,
  ``_id = "<participant>:<tx_id>"``, with ``steps`` (the steps whose step
  document may exist: a step is listed *before* its document is created),
  ``rolled_back`` (the transaction-level rollback marker: a rollback came before
  any step of it was known here), ``seen`` (the seen marker: the request had no
  step here), ``fingerprint`` (of the request this participant acted on),
  ``pending`` (the intents of steps being created, below) and its own ``rev``.

Pruning. Step documents carry ``finished_ms`` once finished
(:func:`participants._barrier.finished_ms`), and so do decision documents and
transaction documents that hold only markers; both collections have a ``(participant, finished_ms)``
index (``saga_by_finish``). :meth:`MongoStorage.prune` removes a transaction's
documents once all of them finished before the horizon (a ``read_committed`` step
still applied has not: it holds or reserves until its decision). The seen
markers of a run of requests without a step here are inserted with one
``insert_many`` (a duplicate key means the transaction is known: nothing to do).

Only ``_id``. Every operation of the work itself addresses one document by
``_id`` and nothing else: FerretDB v1 (the local MongoDB-wire server) hands a
filter to SQLite only when it is exactly ``{"_id": <string or ObjectId>}``; any
other filter, ``{"_id": k, "rev": r}`` included, makes it decode the whole
collection. So a transaction's steps are found through its transaction document,
unfinished writes through the marker on the business document, and
compare-and-set conditions are checked as described under *Concurrency*. (The
FerretDB that ``infra/services.sh`` builds looks up any filter naming ``_id`` once by
``_id``; :meth:`MongoStorage.prepare` detects that from ``explain``
(``narrows_by_id``), and only then does a commit of a known reservation put its
conditions in the filter, see ``_holds``.)
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
    their step or document is touched again
    (:class:`~saga.participants.mongo._shared._Unrecorded`); until then the intent
    and the marker stand for them. A new step without a write
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
  *Cache*), or, when its write is idempotent (a commit or release under
  ``read_committed``), a share of the batch's one insert of decision documents. Under
  ``read_committed`` (see *Isolation*) an ``increment`` on a document this process
  wrote before costs one update to reserve (no read) and one conditional update to
  commit where the server checks the filter before it writes (MongoDB, and FerretDB as
  ``infra/services.sh`` builds it); a stock FerretDB reads first.

Batched intents. On a batch's first attempt without transactions, the transaction
documents of the new transactions whose step writes (not a delete) are not inserted
one by one: step (1) of each is left to one ``insert_many(ordered=False)`` of the
batch, and its (2) and (3) run after that insert, in batch order
(:meth:`~saga.participants.mongo._batch.BatchWrites.flush_intents`). On FerretDB
that insert costs the server about a twentieth of one insert per document. Until
then the step's document lock stays held, by the batch rather than by the item
(:class:`~saga.participants.mongo._batch._DeferredIntent`), and the intents go in
earlier whenever something would look past them: an item locking a document a
pending intent holds, or reading the ledger of a transaction
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
documents it read or wrote (up to
:data:`~saga.participants.mongo._adapter.TX_CACHE_SIZE` transactions), so a
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
the unrecorded steps above, belong to one :class:`~saga.participants.mongo._shared.SharedState`,
which all storages share by default). On FerretDB (detected from ``buildInfo``)
a compare-and-set is an ``_id``-only ``findAndModify`` returning
the document as it was, checked by the adapter; a mismatch (a change made since
the read, by someone else) is put back at once and counts as a conflict. The one
exception is the commit of a known reservation where FerretDB looks a filter naming
``_id`` and more up by ``_id`` (``narrows_by_id``): its conditions are in the filter,
checked by FerretDB when it reads the document to update it. On MongoDB the
conditions are part of the filter, atomic. The runtime handles one
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

Errors, translated at the storage's boundary: the server unreachable, a lost connection,
a write conflict or another worker changing the same ledger record or document
at the same time are a :class:`~streams.TransientError`; a write the server
refuses for its content (a document too large) fails the step with a
:class:`~streams.BusinessRejection`; missing privileges or an unsupported
feature are a :class:`~streams.ConfigurationError`.

Isolation (DESIGN §9; :mod:`~saga.participants.mongo._holds` has the details). Under
``read_committed`` a step's business fields change only when its saga's commit is
applied: apply checks and records a hold (``insert``/``put``/``update``/``delete``) or
an escrow reservation (``increment``) in reserved ``_saga_*`` fields of the document
(a reader projects them away with ``RESERVED_PROJECTION``), or, for a record that does
not exist yet, in its shadow document in ``<ledger_collection>_holds``, so that a plain
``find`` of the target never shows it before commit. Every hold, reservation, commit
and release is the step's one staged write, recorded with its ledger entry by the
protocol above; a step of another saga on a held record fails at once naming the
holder. A commit or release that removes what it acts on from the document it changes
needs no intent (running it again finds nothing to do), and its ledger record is a
decision document inserted with the batch's others (one ``insert_many``; a reader of the
step document applies it, see ``_ledger._decision_doc``). Where this process knows the
marker it last recorded for a document, a reservation and its commit are written without
reading the document first: the write is compare-and-set on that marker and checked on
the document as it was, and a miss is put back and the step run again, reading. A write
checked after it is made (FerretDB) is made so only when it changes reserved fields alone
(a reservation, a release): a commit changes business fields, which a reader must never
see changed by a write that is then put back, so there a commit reads first. Under ``none`` apply
writes at once, and a compensation first checks that it overwrites no one's work and
breaks no recorded bound. Participants that write the same documents must share the
ledger collection (as for markers).
"""

from saga.participants.mongo._adapter import MongoStorage
from saga.participants.mongo._session import MongoSession

__all__ = ["MongoSession", "MongoStorage"]
