"""An in-memory log for fast unit tests of the services, with no broker.

:class:`InMemoryLog` implements :class:`streams.log.Log` well enough to drive the
coordinator service and the participant runtime step by step:

* **topics** with N partitions (:meth:`InMemoryLog.create_topics` makes the saga
  topics of the settings); keys go to partitions as Kafka puts them
  (:func:`streams.kafka.partition_for`, murmur2); every record has an offset,
  headers and a timestamp (the log's clock unless the producer sets one);
* **consumer groups**: :meth:`~InMemoryConsumer.subscribe` joins, ``close`` leaves,
  :meth:`InMemoryLog.drop` removes a member that did not close (its session timed
  out, as after a kill). Every membership change starts a new *generation* and
  assigns partitions as the *range* assignor does (members sorted by member id;
  each member gets the same partition numbers of every topic of equal size). A
  member learns of the rebalance in its next ``poll_batch``, which runs its
  callbacks there, eagerly as the range assignor does: ``on_revoke`` with its whole
  old assignment (``on_lost`` instead when it had been dropped), then
  ``on_assign`` with the new one. With :attr:`InMemoryLog.fetch_before_rebalance`
  set, that poll returns the records it fetched from the old assignment *before*
  the rebalance ran (a real client can return records prefetched before it);
* **offsets**: ``commit`` (refused with :class:`~streams.TransientError` by a member
  whose generation is stale), ``committed``, ``position``, ``seek``,
  ``pause_all``/``resume_all``, ``watermarks``, ``list_partitions``, and ``assign``
  for readers without a group. A newly assigned partition starts at the group's
  committed offset, else at the beginning, resolved at its first fetch;
* **transactions**: a transactional producer's records enter the log at once but
  stay invisible to ``read_committed`` readers until the commit, and every
  transaction end writes a *marker* that occupies an offset on each partition the
  transaction wrote to (so a reader's ``position`` can be past its last record).
  A ``read_committed`` reader stops at the first record of an open transaction
  (the last stable offset, also its high watermark) and skips aborted records.
  ``init`` fences the previous producer of the same transactional id (its next
  call raises :class:`~streams.FatalKafkaError`) and aborts its open transaction.
  ``send_offsets`` from a member whose generation is stale makes ``commit`` raise
  :class:`~streams.kafka.TransactionAborted` (the broker checks the generation, not
  which partitions the member owns). Offsets sent in an open transaction are
  *pending*: ``committed`` raises :class:`~streams.TransientError` for them and a
  newly assigned partition does not fetch until the transaction ends;
* the **plain producer** buffers records until ``flush`` (or ``close``): a crash
  before the flush loses them.

Test hooks: :meth:`InMemoryLog.fail_next_commit` (the next transaction commit
raises ``TransactionAborted``), :meth:`InMemoryLog.fail_next_call` (the next
``init``/``begin``/``send_offsets``/``commit``/``abort`` of a transactional id
raises a given error, before or after doing its work; a ``FatalKafkaError`` leaves
that producer unusable), :meth:`InMemoryLog.drop`, :meth:`InMemoryLog.kill`
(every client last used by a thread dies with it: buffered records are lost, open
transactions stay open, group members are dropped, and any further call raises
:class:`Killed`), :class:`KillAt` (fault hooks that kill at a fault point),
:class:`Stepper` (runs a service loop in a thread, one poll at a time) and
:class:`ManualClock`. Inspection: :meth:`InMemoryLog.records` (what a
``read_committed`` reader sees), ``end_offset``, ``committed_offset``, ``members``
and ``generation``.

Use::

    clock = ManualClock()
    log = InMemoryLog(KafkaSettings(bootstrap="memory:9092", prefix="t"), clock=clock)
    log.create_topics(partitions=2)
    service = CoordinatorService(log.settings, instance_id="a", clock=clock, log=log)
    stepper = Stepper(log, service.run, stop=service.stop).start()  # at its first poll
    ...                        # produce requests and events with log.producer()
    stepper.step()             # one poll (rebalance callbacks run in it) and its batch
    clock.advance(5_000)
    stepper.step()             # a poll with nothing: deadline ticks
    stepper.stop()

The clients are thread-safe enough for one service thread at a time next to the
test (a :class:`Stepper` never lets both run at once). Every group assigns by
range, whatever ``assignment_strategy`` says. A killed transactional producer's
open transaction holds back ``read_committed`` readers of its partitions until its
id is initialised again (there are no transaction timeouts).

Modules (private; import from here): ``_model`` (records, transactions, groups,
:class:`Killed`, :class:`ManualClock`), ``_log`` (:class:`InMemoryLog`),
``_clients`` (the consumer and producers), ``_stepper`` (:class:`KillAt`,
:class:`Stepper`).

Not modelled: brokers, replication, network errors and timeouts (nothing ever
waits: ``poll_batch`` returns what is there at once, and ``committed`` raises
:class:`~streams.TransientError` at once where Kafka would wait for a pending
transaction, as if its timeout had passed: a test cannot show a service waiting
for a previous owner's commit), the order of a batch (a poll returns records
partition by partition in assignment order, topics sorted by name, each as far as
``max_messages`` allows; a real client interleaves partitions in no set order),
incremental (cooperative) rebalances, static membership (except that a member
joining with a live member's ``group_instance_id`` fences it: its next call raises
:class:`~streams.FatalKafkaError`), sticky assignment,
session timeouts by time, transaction timeouts, compaction, retention and deletion
(the low watermark is always 0), the idempotent producer's sequence numbers,
``poll`` delivering records (only ``flush`` does), quotas and record size limits,
and producing to a missing topic raises :class:`~streams.ConfigurationError` at
once (Kafka times out later).
"""

from __future__ import annotations

from saga.streams.testing._clients import (
    InMemoryConsumer,
    InMemoryProducer,
    InMemoryTransactionalProducer,
)
from saga.streams.testing._log import InMemoryLog
from saga.streams.testing._model import Killed, ManualClock
from saga.streams.testing._stepper import KillAt, Stepper, key_on

__all__ = [
    "InMemoryConsumer",
    "InMemoryLog",
    "InMemoryProducer",
    "InMemoryTransactionalProducer",
    "KillAt",
    "Killed",
    "ManualClock",
    "Stepper",
    "key_on",
]
