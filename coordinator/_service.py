"""The coordinator service: the state machine between Kafka consumer and producer.

It consumes ``requests``, ``events`` and ``decisions`` (the last only to move
poison records to the DLQ: the coordinator is the one transactional writer of
the DLQ, so each rejected record lands there exactly once). Each batch runs in
one Kafka transaction that holds the decisions, the status records, the DLQ
records and the consumed offsets (read-process-write, exactly once).

State lives per partition. When partitions are assigned, their state is rebuilt
from the compacted status topic (the same partition number: all topics are
keyed by ``tx_id`` and have the same partition count) before any of their
records is processed. A batch's state changes are kept aside and merged only
after its transaction commits, timers too (deadlines, refreshes: coordinator._timers),
so an aborted transaction leaves memory as the log: the batch is re-read and
re-decided the same way, and no timer it fired is lost.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Literal

from saga.coordinator import _route
from saga.coordinator._chores import DEFAULT_REDRIVE, Chores, Redrive
from saga.coordinator._finished import FinishedStore
from saga.coordinator._known import DEFAULT_PARTICIPANT_GRACE_MS, KnownParticipants
from saga.coordinator._machine import (
    Ignored,
    Input,
    RequestReceived,
    Saga,
    Tick,
    decide,
    input_of,
    tx_of,
)
from saga.coordinator._machine_io import StepReported, acknowledged
from saga.coordinator._observe import CoordinatorObserver
from saga.coordinator._own import OwnRecords
from saga.coordinator._restore import restore
from saga.coordinator._retention import PartitionState, Sagas, due_to_forget, due_to_refresh, settle
from saga.coordinator._timers import TimerBatch
from saga.coordinator._txn import Transactions, await_previous_owner, next_offsets, rewind
from saga.streams import (
    Decision,
    FatalKafkaError,
    InvalidRecord,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    SagaStatus,
    StepEvent,
    StepsCommitted,
    TransientError,
    decode_keyed,
    encode,
)
from saga.streams._duration import DEFAULT_RETENTION_MS
from saga.streams._faults import NO_FAULTS, Faults
from saga.streams._lifecycle import Clock, Stoppable, wall_clock_ms
from saga.streams._routing import Headers
from saga.streams._signed_log import signing
from saga.streams._signing import CLIENT, OPERATOR, Keyring, allowed_signers
from saga.streams.kafka import (
    KafkaSettings,
    Message,
    partition_for,
    send_to_dlq,
)
from saga.streams.log import KafkaLog, Log, LogTransactionalProducer

log = logging.getLogger("saga.coordinator")

_OWN_RECORDS_REMEMBERED = 200_000  # see Keyring.remember_own


@dataclass(slots=True)
class CoordinatorStats:
    """Counters a monitor (or a test) can read while the service runs."""

    batches: int = 0
    records: int = 0
    decisions: int = 0
    commits: int = 0
    rollbacks: int = 0
    dlq: int = 0
    aborted_transactions: int = 0
    restored: int = 0
    forgotten: int = 0
    expired_requests: int = 0
    refreshed: int = 0
    unauthenticated: int = 0  # records refused for their signature (to the DLQ)
    forged_status: int = 0  # status records skipped by a restore for their signature
    redriven: int = 0  # decisions of stalled sagas sent again (coordinator._chores)


class CoordinatorService(Stoppable):
    """Runs one coordinator instance until :meth:`stop` (or SIGTERM/SIGINT).

    Instances share the partitions through one consumer group (``<prefix>.coordinator``).
    ``instance_id`` must be stable for an instance across restarts and unique among live
    instances: it names the transactional producer and the static group member, so a
    restarted instance fences its predecessor, aborts what that one left open and takes
    back its partitions at once (one gone for good loses them after the session timeout,
    6 s by default). ``participants``, when given, is the set of participant names that
    exist: a request naming another rolls back at once; else, with
    ``unknown_participants="reject"``, those that announced themselves on the participant
    registry (read to its end before any decision; :mod:`coordinator._known`), and a
    request naming one not announced yet waits for it ``participant_grace_ms`` (never
    past its deadline) before it rolls back; else (``"accept"``, the default here) any
    name.

    Retention (``retention_ms``): a saga that ended ``committed`` or ``rolled_back``
    leaves memory for a table on local disk (:mod:`coordinator._finished`), and is
    forgotten once ``retention_ms`` have passed since both its deadline and its last
    change: its row goes and it gets a tombstone on the status topic, so memory holds
    the sagas in flight only, and disk, the status topic and every restore the sagas
    of the last retention period. A placeholder (events, or an abort,
    whose request never came) is forgotten ``retention_ms`` after its last change.
    Sagas still pending, being confirmed or compensated, or ``failed`` (an
    operator must act) are kept, and their status is published again every half
    retention: the status topic deletes records older than twice the retention
    (``saga topics create --retention``), and must never lose what is kept. A
    request whose deadline passed more than ``retention_ms`` ago is rejected to
    the DLQ as expired: it may belong to a forgotten saga, so nothing is decided
    for it (its participants do not apply it either: its deadline has passed).
    The participants keep their ledgers by the same rule, so no decision ever
    reaches a step the coordinator forgot.

    ``redrive``: when the decision of a saga stalled ``committing`` or ``rolling_back``
    is sent again (:mod:`coordinator._chores`; by default after 30 s without a change,
    then 60 s, 120 s, ..., five times at most).

    ``log`` makes its Kafka clients (default: :class:`~streams.log.KafkaLog` of
    ``settings``; tests pass :class:`streams.testing.InMemoryLog`); ``faults`` are
    the crash suite's hooks (no-ops by default).

    ``keys`` (the coordinator's :class:`~streams._signing.Keyring`) turns signing
    on: every record it writes is signed (:class:`~streams._signed_log.SignedLog`),
    and before any effect it verifies every request and abort (``client`` or
    ``operator``; aborts by ``aborters``), every step event (the participant it
    names) and every record on the decisions topic (``coordinator``): a record
    that fails goes to the DLQ with the reason and is never decided on. A restore
    believes only status records and tombstones the coordinator signed. Without
    ``keys`` nothing is signed or verified, and :meth:`run` says so.

    ``observer`` (:mod:`coordinator._observe`): its health, metrics and trace context.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        instance_id: str = "0",
        participants: frozenset[str] | None = None,
        batch_size: int = 2000,
        poll_timeout_s: float = 0.05,
        transaction_timeout_ms: int = 10_000,
        retention_ms: int = DEFAULT_RETENTION_MS,
        clock: Clock = wall_clock_ms,
        log: Log | None = None,
        faults: Faults = NO_FAULTS,
        keys: Keyring | None = None,
        aborters: frozenset[str] = frozenset({CLIENT, OPERATOR}),
        unknown_participants: Literal["accept", "reject"] = "accept",
        redrive: Redrive = DEFAULT_REDRIVE,
        participant_grace_ms: int = DEFAULT_PARTICIPANT_GRACE_MS,
    ) -> None:
        self.settings = settings
        self._keys = keys
        if keys is not None and keys.signs:  # its own records, read back, pass on a digest
            keys.remember_own(_OWN_RECORDS_REMEMBERED)
        # ... or, read where their delivery reports put them, on a lookup (see _own).
        self._own = OwnRecords(_OWN_RECORDS_REMEMBERED) if keys is not None else None
        self.aborters = aborters
        self._log: Log = signing(log if log is not None else KafkaLog(settings), keys)
        self._faults = faults
        self.retention_ms = retention_ms
        self.chores = Chores(retention_ms, redrive)
        self.topics = settings.topics
        self.instance_id = instance_id
        self.participants = participants
        self.known = KnownParticipants(static=participants)
        if participants is None and unknown_participants == "reject":
            self.known = KnownParticipants.from_registry(
                self._log,
                keys=keys,
                clock=clock,
                client_id=f"{self.topics.prefix}.registry",
                grace_ms=participant_grace_ms,
            )
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self.clock = clock
        self.stats = CoordinatorStats()
        super().__init__()
        self._partitions: dict[int, PartitionState] = {}
        self._finished = FinishedStore()  # finished sagas, on disk (coordinator._finished)
        self._partition_count = 0  # of every saga topic; read at start
        self._next_refresh_ms = 0  # when to look for kept sagas to publish again
        self._consumer = self._log.consumer(
            f"{self.topics.prefix}.coordinator",
            client_id=f"{self.topics.prefix}.coordinator.{instance_id}",
            group_instance_id=f"{self.topics.prefix}.coordinator.{instance_id}",
            # The range assignor gives each instance the same partition numbers of every
            # topic: a transaction's request, events and decisions must be owned together
            # (with cooperative-sticky, events owned apart from their requests were skipped).
            assignment_strategy="range",
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        # Made again, in-process, when a broker failover leaves it unusable (coordinator._txn).
        self._txns = Transactions(
            lambda: self._log.transactional_producer(
                f"{self.topics.prefix}.coordinator.{instance_id}",
                transaction_timeout_ms=transaction_timeout_ms,
            ),
            self._consumer,
            self._reload,
        )
        self.observer = CoordinatorObserver(self)  # health, metrics, trace context

    @property
    def _producer(self) -> LogTransactionalProducer:
        return self._txns.producer

    # ------------------------------------------------------------ lifecycle

    def run(self) -> None:
        """Consume, decide and produce until stopped; raises FatalKafkaError when fenced.

        Fenced means replaced by a newer instance: a broker failover that leaves the
        producer unusable is ridden through in-process (coordinator._txn).
        """
        self._txns.init()
        self._partition_count = self._consumer.list_partitions(self.topics.requests)
        self._next_refresh_ms = self.clock() + self.retention_ms // 4
        topics = [self.topics.requests, self.topics.events, self.topics.decisions]
        if self._keys is not None:
            # Read only to move forged status records to the DLQ (see OwnRecords.forged).
            topics.append(self.topics.status)
        if self._keys is None:
            log.warning(
                "records are not authenticated (anyone who can write to the topics can "
                "forge decisions and step events); set SAGA_KEYS_DIR"
            )
        log.info("coordinator %s running on %s", self.instance_id, self.settings.bootstrap)
        try:
            # The registry first, then the group: no partition waits while it is read.
            if not self.known.start(lambda: self.stopping):
                return
            self._consumer.subscribe(topics)
            while not self.stopping:
                self.known.poll()
                messages = self._consumer.poll_batch(self.batch_size, self.poll_timeout_s)
                self.observer.polled(messages)
                now = self.clock()
                if (
                    messages
                    or self.chores.due(self._partitions.values(), now)
                    or now >= self._next_refresh_ms
                ):
                    if messages:
                        self._faults.hit("coordinator.after_read")
                    self._process(messages, now)
        finally:
            self.known.close()
            self._consumer.close()
            self._producer.close()
            self._finished.close()

    # ------------------------------------------------------------ rebalance

    def _on_assign(self, partitions: list[tuple[str, int]]) -> None:
        numbers = sorted({p for t, p in partitions if t == self.topics.requests})
        new = [p for p in numbers if p not in self._partitions]
        if not new:
            return
        rejoins = self._consumer.rejoins
        await_previous_owner(
            self._consumer,
            (self.topics.requests, self.topics.events, self.topics.decisions),
            new,
        )
        if self._consumer.rejoins != rejoins:
            return  # fenced meanwhile (in a reset): the rejoined consumer's assignment restores
        for p, part in self._restore(new).items():
            now = self.clock()
            for saga in part.sagas.live.values():  # finished ones have no timer but on disk
                self.chores.restored(part, saga)
                if (ends := self.known.restored_wait(saga, now)) is not None:
                    heapq.heappush(part.waits, (ends, saga.tx_id))
            heapq.heapify(part.forget)
            self._partitions[p] = part
            self.stats.restored += len(part.sagas)
        log.info("assigned partitions %s (restored %d sagas)", new, self.stats.restored)

    def _reload(self) -> None:
        """Rebuild the owned partitions' state from the status topic, as a restart does.

        After a transaction whose outcome only Kafka knows (coordinator._txn, which
        then moves the consumer to the committed offsets).
        """
        owned = sorted(self._partitions)
        for part in self._partitions.values():
            part.close()
        self._partitions.clear()
        self._on_assign([(self.topics.requests, p) for p in owned])

    def _on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        for t, p in partitions:
            if t == self.topics.requests and (part := self._partitions.pop(p, None)) is not None:
                part.close()

    def _restore(self, partitions: list[int]) -> dict[int, PartitionState]:
        """The state of ``partitions``, from the status topic (see coordinator._restore)."""

        def forged(m: Message, reason: str) -> None:
            self.stats.forged_status += 1
            log.warning(
                "restore: skipping the status record of %s at %s/%d@%d: %s",
                (m.key or b"").decode("utf-8", "replace"),
                m.topic,
                m.partition,
                m.offset,
                reason,
            )

        parts = {p: PartitionState(Sagas(self._finished.table(p))) for p in partitions}
        restore(
            self._log,
            self.topics.status,
            parts,
            client_id=f"{self.topics.prefix}.coordinator.{self.instance_id}.restore",
            keys=self._keys,
            on_forged=forged,
            forget_at=self.chores.forget_at,
        )
        return parts

    # ------------------------------------------------------------ processing

    @property
    def sagas_held(self) -> int:
        """How many sagas (and placeholders) the owned partitions hold, finished ones too."""
        return sum(len(part.sagas) for part in self._partitions.values())

    @property
    def sagas_in_memory(self) -> int:
        """How many of them are in memory: those in flight (finished ones are on disk)."""
        return sum(len(part.sagas.live) for part in self._partitions.values())

    def _process(self, messages: list[Message], now: int) -> None:
        changed: dict[str, tuple[int, Saga]] = {}
        outputs: list[tuple[int, Decision | SagaStatus | StepEvent, bytes]] = []
        rejected: list[tuple[Message, str]] = []
        timers = TimerBatch(now)  # applied only if the batch's transaction commits

        def current(partition: int, tx_id: str) -> Saga | None:
            if tx_id in changed:
                return changed[tx_id][1]
            part = self._partitions.get(partition)
            return part.sagas.get(tx_id) if part else None

        def feed(
            partition: int, tx_id: str, inp: Input, source: Message | None, wait: int | None = None
        ) -> None:
            before = current(partition, tx_id)
            try:
                after, outs = decide(before, inp)
                if self.chores.unpublished(before, after, inp):
                    outs = [out for out in outs if not isinstance(out, SagaStatus)]
                # Encoded here, not at commit: what the contract refuses is this input's fault.
                encoded = [(out, encode(out)) for out in outs if not isinstance(out, Ignored)]
            except Exception as exc:  # no record may stop the coordinator
                reason = f"could not be handled: {type(exc).__name__}: {exc}"
                if source is not None:
                    rejected.append((source, reason))
                log.error("transaction %s: %s", tx_id, reason, extra={"tx_id": tx_id})
                return
            if after is None:
                return
            if after is not before:  # unchanged (a repeat, a late event): nothing to merge
                changed[tx_id] = (partition, after)
            if after.request_seen and (before is None or not before.request_seen):
                part = self._partitions[partition]
                if not after.decided:
                    timers.push(part, "deadlines", (after.deadline_ms, tx_id))
                if wait is not None:  # a participant not announced yet (coordinator._known)
                    timers.push(part, "waits", (wait, tx_id))
            for out in outs:
                if isinstance(out, Ignored):
                    if source is not None and source.topic == self.topics.requests:
                        rejected.append((source, out.reason))
                    else:
                        log.warning("%s", out.reason, extra={"tx_id": out.tx_id})
            outputs.extend((partition, out, value) for out, value in encoded)

        # A batch can hold records of a partition revoked during the poll that returned
        # it (a rebalance runs inside the poll). Its new owner reads them again: neither
        # processed here nor counted in this transaction's offsets, which would otherwise
        # skip them for that owner (a saga whose events were all read stayed undecided;
        # found by the chaos suite).
        messages = [m for m in messages if m.partition in self._partitions]
        for m in messages:
            if m.topic == self.topics.status:
                assert self._keys is not None and self._own is not None
                if (reason := self._own.forged(m, self._keys)) is not None:
                    self.stats.unauthenticated += 1
                    rejected.append((m, reason))
                    # The topic is compacted: put the real status back on top of the forged one.
                    saga = current(m.partition, (m.key or b"").decode("utf-8", "replace"))
                    if saga is not None and saga.request_seen:
                        status = saga.status()
                        outputs.append((m.partition, status, encode(status)))
                continue
            try:
                inp = self._to_input(m, now, rejected)
            except Exception as exc:  # no record may stop the coordinator
                rejected.append((m, f"could not be handled: {type(exc).__name__}: {exc}"))
                continue
            if inp is None:
                continue
            if isinstance(inp, tuple):  # a saga.committed: one input per step
                for each in inp:
                    feed(m.partition, each.event.tx_id, each, m)
                continue
            wait = None
            if isinstance(inp, RequestReceived):
                inp, wait = self.known.wait_for(inp, now)
            tx_id = tx_of(inp)
            if (
                isinstance(inp, RequestReceived)
                and inp.request.deadline_ms + self.retention_ms <= now
                and current(m.partition, tx_id) is None
            ):
                # Maybe a saga forgotten long ago: deciding it now could roll back what
                # committed. Its participants do not apply it either (deadline passed).
                self.stats.expired_requests += 1
                rejected.append(
                    (
                        m,
                        f"request expired: its deadline passed more than the "
                        f"retention ({self.retention_ms} ms) ago; send a new transaction",
                    )
                )
                continue
            feed(m.partition, tx_id, inp, m, wait)

        for p, part in self._partitions.items():
            # First the waits that end: a deadline the same moment says less than they do.
            for _, tx_id in timers.fire(part, "waits"):
                saga = current(p, tx_id)
                if saga is not None and (missing := self.known.missing(saga, now)) is not None:
                    feed(p, tx_id, missing, None)
            for _, tx_id in timers.fire(part, "deadlines"):
                saga = current(p, tx_id)
                if saga is not None and not saga.decided:
                    feed(p, tx_id, Tick(now), None)

        redriven = [
            again
            for part in self._partitions.values()
            for again in self.chores.redriven(part, timers, changed)
        ]
        forgotten = due_to_forget(self._partitions, now, changed, self.chores.forget_at)
        if now >= self._next_refresh_ms:  # a sweep every quarter retention
            timers.next_refresh_ms = now + max(1, self.retention_ms // 4)
            again = due_to_refresh(
                self._partitions, now, changed, self.retention_ms, self.chores.forget_at
            )
            for p, status, _ in again:
                timers.refreshed(self._partitions[p], status.tx_id)
            outputs.extend(again)
        owners = dict(self._partitions)  # a failed transaction may reload them (coordinator._txn)
        if not self._commit_batch(messages, changed, outputs, rejected, forgotten, redriven):
            for p, at, tx_id in forgotten:  # still due: the next batch tries again
                if (owner := self._partitions.get(p)) is not None and owner is owners[p]:
                    owner.forget_later(at, tx_id)  # (one on disk is found there again)
            return
        self._next_refresh_ms = timers.commit() or self._next_refresh_ms
        self.stats.refreshed += timers.refreshes
        self.observer.committed(messages, changed, outputs, rejected)
        settle(self._partitions, forgotten, changed, self.chores.forget_at, self.chores.merged)
        self.stats.forgotten += len(forgotten)

    def _to_input(
        self, m: Message, now: int, rejected: list[tuple[Message, str]]
    ) -> Input | tuple[StepReported, ...] | None:
        try:
            if m.topic == self.topics.requests:
                record = decode_keyed(m.key, m.value, SagaRequest, SagaAbort, SagaResolve)
            elif m.topic == self.topics.events:
                record = decode_keyed(m.key, m.value, StepEvent, StepsCommitted)
            else:
                record = decode_keyed(m.key, m.value, Decision)  # checked (contract, key): ours
        except InvalidRecord as exc:
            rejected.append((m, exc.reason))
            return None
        if (home := partition_for(m.key or b"", self._partition_count)) != m.partition:
            # Its transaction's other records are on `home`: acted on here, it would be
            # a second, separate transaction of the same id that never settles.
            rejected.append((m, f"record is on partition {m.partition}, its key belongs on {home}"))
            return None
        own = self._own is not None and m.topic == self.topics.decisions and self._own.read_back(m)
        if self._keys is not None and not own:
            signers = allowed_signers(record, aborters=self.aborters)
            reason = self._keys.check(m.topic, m.key, m.value, m.headers, signers)
            if reason is not None:
                # Never acted on: a forged step event, abort or decision changes nothing.
                self.stats.unauthenticated += 1
                rejected.append((m, reason))
                return None
        if isinstance(record, SagaRequest):
            return RequestReceived(record, now, *self.known.check(record))
        if isinstance(record, StepsCommitted):
            steps = acknowledged(record, now, m.partition, self._partition_count)
            if isinstance(steps, str):
                rejected.append((m, steps))
                return None
            return steps
        return input_of(record, now, None)

    def _commit_batch(
        self,
        messages: list[Message],
        changed: dict[str, tuple[int, Saga]],
        outputs: list[tuple[int, Decision | SagaStatus | StepEvent, bytes]],
        rejected: list[tuple[Message, str]],
        forgotten: list[tuple[int, int, str]],
        redriven: list[tuple[Decision, bytes, Headers]],
    ) -> bool:
        """Produce the batch's outputs in one transaction; False when it was aborted.

        ``redriven``: decisions of stalled sagas sent again, with their headers.
        """
        # Only the last status of a transaction in this batch matters (the topic is compacted).
        last_status: dict[str, bytes] = {}
        decisions: list[tuple[Decision, bytes]] = []
        events: list[tuple[str, bytes, Headers]] = []  # of unknown participants (see _machine)
        for _, out, value in outputs:
            if isinstance(out, Decision):
                decisions.append((out, value))
            elif isinstance(out, StepEvent):
                route = _route.event_route(out, _route.changed_saga(changed, out.tx_id))
                events.append((out.tx_id, value, route))
            else:
                last_status[out.tx_id] = value
        offsets = next_offsets(messages)
        committing = False
        try:
            self._producer.begin()
            own = None if self._own is None else self._own.delivered
            for d, value in decisions:
                headers = _route.decision_route(d, _route.changed_saga(changed, d.tx_id))
                headers += self.observer.decision_headers(d) or ()
                self._producer.produce(self.topics.decisions, d.tx_id, value, headers, own)
            for d, value, headers in redriven:
                self._producer.produce(self.topics.decisions, d.tx_id, value, headers, own)
            for tx_id, value in last_status.items():
                trace = self.observer.status_headers(tx_id)
                self._producer.produce(self.topics.status, tx_id, value, trace, own)
            for tx_id, value, route in events:
                self._producer.produce(self.topics.events, tx_id, value, route)
            for _, _, tx_id in forgotten:
                self._producer.produce(self.topics.status, tx_id, None)  # a tombstone
            for m, reason in rejected:
                send_to_dlq(self._producer, self.topics, m, reason, component="coordinator")
            if offsets:
                self._producer.send_offsets(self._consumer, offsets)
            if decisions:
                self._faults.hit("coordinator.before_commit")
            committing = True
            self._producer.commit()
        except (TransientError, FatalKafkaError) as exc:  # TransactionAborted is transient
            log.warning("the batch's transaction failed: %s", exc)
            self.stats.aborted_transactions += 1
            self._txns.failed(
                exc,
                lambda: rewind(self._consumer, messages, self._partitions),
                committing=committing,
            )
            changed.clear()
            return False
        self._txns.committed()
        self.stats.batches += 1
        self.stats.records += len(messages)
        self.stats.dlq += len(rejected)
        self.stats.decisions += len(decisions)
        self.stats.redriven += len(redriven)
        for d, _ in decisions:
            if d.outcome == "commit":
                self.stats.commits += 1
            else:
                self.stats.rollbacks += 1
        return True
