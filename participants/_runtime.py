"""The participant runtime: consume -> barrier -> apply -> emit -> commit offsets.

One runtime serves one participant name and one storage. It consumes the
``requests``, ``decisions`` and ``events`` topics in one consumer group
(``<prefix>.participant.<name>``), turns records into work items for its own
steps, runs each batch in one local atomic unit of its storage, emits the step
events, waits until Kafka acknowledged them, and only then commits the consumed
offsets (without waiting for the answer; one commit in flight at a time, see
:mod:`streams.kafka._commits`). A crash anywhere in that sequence
re-delivers the batch, and the ledger makes the repeat take effect at most once
(docs/architecture.md §4).

Errors split three ways:

* business rejection: the storage writes ``failed`` and the saga rolls back;
* transient (storage or broker unavailable): the batch is retried with
  exponential backoff while the partitions are paused; nothing is lost;
* poison (undecodable or invalid record): skipped here; the coordinator, the
  one transactional DLQ writer, moves it to the DLQ exactly once.

Sequential sagas: the participant of step ``i`` acts when it sees step
``i - 1`` applied on the events topic. That event may be read before the
request, so recent ``applied`` events are remembered for ``event_window_ms``,
and the events topic's committed offset trails by the same window: after a
restart the window is read again and nothing between the two topics is lost.
The decisions topic's committed offset trails by the window too: a step whose
report a crash lost after a signal that is not read again (a sequential step
compensated on its successor's event) is reported again when its decision is
(found by the chaos suite).

Routing headers (:mod:`participants._routing`): a record whose headers say it is
not meant for this participant is skipped before it is decoded (its offset still
moves on); a record without them is decoded as it always was.

Requests carry their fingerprint to the storage (a request in which this
participant has no step becomes a :class:`~participants._storage.RequestSeen`),
and at most once per ``prune_interval_ms`` the runtime asks the storage to remove
up to ``prune_limit`` ledger entries finished more than ``retention_ms`` ago
(see *Retention* in :mod:`participants._barrier`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import replace

from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_never, wait_exponential

from saga.participants._acks import acknowledgements
from saga.participants._announce import DEFAULT_HEARTBEAT_MS, Announcer, storage_kind
from saga.participants._barrier import PredecessorApplied, Requested, SuccessorCompensated
from saga.participants._observe import ParticipantObserver, ParticipantStats
from saga.participants._pace import BatchPace, max_poll_interval_s
from saga.participants._routing import Router, Seen, Verdict
from saga.participants._storage import (
    DecisionArrived,
    Report,
    RequestSeen,
    Storage,
    WorkItem,
)
from saga.participants._work import unique
from saga.streams import (
    MAX_REASON_CHARS,
    ConfigurationError,
    Decision,
    FatalKafkaError,
    InvalidRecord,
    Mode,
    Outcome,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    StepEvent,
    StepsCommitted,
    StepStatus,
    StorageKind,
    TransientError,
    decode_keyed,
    encode,
)
from saga.streams._duration import DEFAULT_RETENTION_MS
from saga.streams._faults import NO_FAULTS, Faults
from saga.streams._lifecycle import Clock, Stoppable, wall_clock_ms
from saga.streams._routing import event_headers
from saga.streams._signed_log import signing
from saga.streams._signing import Keyring, allowed_signers
from saga.streams.kafka import KafkaSettings, Message, partition_for
from saga.streams.log import KafkaLog, Log

log = logging.getLogger("saga.participant")

# A neighbour's step event remembered: when seen, the event, the record it came in.
_Seen = tuple[int, StepEvent, Message]


class ParticipantRuntime(Stoppable):
    """Runs one participant until :meth:`stop` (or SIGTERM/SIGINT).

    ``log`` makes its Kafka clients (default: :class:`~streams.log.KafkaLog` of
    ``settings``; tests pass :class:`streams.testing.InMemoryLog`); ``faults`` are
    the crash suite's hooks (no-ops by default).

    ``keys`` (the participant's :class:`~streams._signing.Keyring`, principal
    ``participant-<name>``) turns signing on: its step events are signed, requests
    are acted on only when a client or an operator signed them, decisions only when
    the coordinator did, and a neighbour's step event only when its participant did,
    checked when a work item is made of it (not every event read). A record that
    fails is skipped (the coordinator moves it to the DLQ). Without ``keys`` nothing
    is signed or verified, and :meth:`run` says so.

    ``observer`` (:mod:`participants._observe`): its health, metrics and trace context.

    Registry (:mod:`participants._announce`): unless ``announce`` is false, the
    runtime announces itself on the participants topic (``kind``, default: the
    storage adapter's; ``targets``, default: the storage's allow-list) before it
    consumes, beats every ``heartbeat_interval_ms`` from its poll loop, and says
    ``stopping`` when stopped on purpose.

    ``worker_id`` makes the worker a static member of its group (Kafka's
    ``group.instance.id`` ``<prefix>.participant.<name>.<worker_id>``): restarted with
    the same id, it takes back its partitions at once, without a rebalance; gone for
    good, it loses them after the session timeout (6 s by default). It must be stable
    across restarts of one worker and unique among the live workers of a participant.
    Without one the worker is a dynamic member: its restart waits for the session
    timeout of its previous self before the group hands out partitions again.

    Commit decisions are skipped undecoded when the storage has nothing to confirm
    (:meth:`~participants._storage.Storage.needs_decision`; see :mod:`participants._routing`).
    """

    def __init__(
        self,
        name: str,
        storage: Storage,
        settings: KafkaSettings,
        *,
        batch_size: int = 1000,
        poll_timeout_s: float = 0.05,
        event_window_ms: int = 60_000,
        max_backoff_s: float = 5.0,
        clock: Clock = wall_clock_ms,
        retention_ms: int = DEFAULT_RETENTION_MS,
        prune_interval_ms: int = 60_000,
        prune_limit: int = 1000,
        log: Log | None = None,
        faults: Faults = NO_FAULTS,
        keys: Keyring | None = None,
        announce: bool = True,
        heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_MS,
        kind: StorageKind | None = None,
        targets: Sequence[str] | None = None,
        worker_id: str | None = None,
    ) -> None:
        self.name = name
        self.worker_id = worker_id
        self._keys = keys
        self._log: Log = signing(log if log is not None else KafkaLog(settings), keys)
        self.announcer: Announcer | None = None
        if announce:
            self.announcer = Announcer(
                self._log,
                settings.topics,
                name=name,
                storage=kind or storage_kind(storage),
                targets=targets if targets is not None else getattr(storage, "targets", ()),
                interval_ms=heartbeat_interval_ms,
                clock=clock,
            )
        self._faults = faults
        self.storage = storage
        self.settings = settings
        self.topics = settings.topics
        self.batch_size = batch_size
        self.pace = BatchPace(batch_size, max_poll_interval_s(settings) / 4)
        self.poll_timeout_s = poll_timeout_s
        self.event_window_ms = event_window_ms
        self.max_backoff_s = max_backoff_s
        self.clock = clock
        self.retention_ms = retention_ms
        self.prune_interval_ms = prune_interval_ms
        self.prune_limit = prune_limit
        self._next_prune_ms = 0  # the first run prunes soon after start
        self.stats = ParticipantStats()
        super().__init__()
        # (tx_id, step) of recently seen `applied` events -> (when seen, the event, its
        # record), the record verified only when a work item is made of it
        self._applied_seen: OrderedDict[tuple[str, int], _Seen] = OrderedDict()
        # (tx_id, step) of recently seen `compensated` events -> the same
        self._compensated_seen: OrderedDict[tuple[str, int], _Seen] = OrderedDict()
        # sequential transactions with a step here -> when last touched; only
        # their neighbours' events need a look at the ledger
        self._sequential: OrderedDict[str, int] = OrderedDict()
        # With keys: the participants of the steps of sequential transactions whose
        # request was read here (kept as long as _sequential keeps them): a neighbour's
        # event is believed only from the participant of that step.
        self._owners: dict[str, tuple[str, ...]] = {}
        self._carry: list[Message] = []
        self._router = Router(
            name, self.topics, keys, skip_commits=not storage.needs_decision(Outcome.COMMIT)
        )
        self._partition_count = 0  # of every saga topic; read at start
        # Partitions were assigned: sequential transactions another worker was
        # serving may have a step here that waits on a neighbour (see _handle).
        self._reload_sequential = False
        # per events or decisions partition: (offset, seen_ms) not yet committed
        self._event_offsets: dict[tuple[str, int], deque[tuple[int, int]]] = {}
        self._consumer = self._log.consumer(
            f"{self.topics.prefix}.participant.{name}",
            client_id=f"{self.topics.prefix}.participant.{name}",
            group_instance_id=(
                None
                if worker_id is None
                else f"{self.topics.prefix}.participant.{name}.{worker_id}"
            ),
            # One worker must see a transaction's request and its events (sequential
            # sagas: step i waits for step i-1's `applied`): the range assignor gives
            # each worker the same partition numbers of every topic; cooperative-sticky
            # does not, and a sequential step whose events went to the other worker
            # waited until its deadline.
            assignment_strategy="range",
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        self._producer = self._log.producer(client_id=f"{self.topics.prefix}.participant.{name}")
        self.observer = ParticipantObserver(self)  # health, metrics, trace context

    # ------------------------------------------------------------ lifecycle

    def run(self) -> None:
        self.storage.setup()
        now = self.clock()
        self._sequential = OrderedDict((tx, now) for tx in self.storage.in_flight_sequential())
        self._partition_count = self._consumer.list_partitions(self.topics.requests)
        if self.announcer is not None:
            # Before consuming: the coordinator rejects requests naming an unannounced name.
            self.announcer.announce()
        self._consumer.subscribe([self.topics.requests, self.topics.decisions, self.topics.events])
        if self._keys is None:
            log.warning(
                "records are not authenticated (anyone who can write to the topics can "
                "forge decisions and step events); set SAGA_KEYS_DIR"
            )
        log.info("participant %s running on %s", self.name, self.settings.bootstrap)
        try:
            while not self.stopping:
                messages, self._carry = self._carry, []
                messages += self._consumer.poll_batch(self.pace.limit, self.poll_timeout_s)
                self.observer.polled(messages)
                if messages:
                    started = time.monotonic()
                    self._handle(messages)
                    self.pace.took(len(messages), time.monotonic() - started)
                else:
                    self._commit({})  # let the events window move on while idle
                self._prune()
                if self.announcer is not None:
                    self.announcer.beat()
        finally:
            if self.announcer is not None and self.stopping:
                self.announcer.stop()
            self._producer.flush(10)
            self._consumer.close()
            self.storage.close()

    def _prune(self) -> None:
        """Remove ledger entries past the retention: a bounded amount, now and then."""
        now = self.clock()
        if now < self._next_prune_ms:
            return
        self._next_prune_ms = now + self.prune_interval_ms
        try:
            removed = self.storage.prune(now - self.retention_ms, self.prune_limit)
        except Exception as exc:  # pruning waits for the next run; the work goes on
            log.warning("could not prune the ledger, trying again later: %s", exc)
            return
        self.stats.pruned += removed
        if removed >= self.prune_limit:
            self._next_prune_ms = now + 1_000  # more to remove: again soon, between batches
        if removed:
            log.info("pruned %d ledger entries finished before the retention", removed)

    def _on_assign(self, partitions: list[tuple[str, int]]) -> None:
        self._reload_sequential = True

    def _on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        for t, p in partitions:
            if t in (self.topics.events, self.topics.decisions):
                self._event_offsets.pop((t, p), None)

    # ------------------------------------------------------------ batches

    def _handle(self, messages: list[Message]) -> None:
        now = self.clock()
        if self._reload_sequential:
            # Taken over from a worker that died or left: its sequential sagas are known
            # only to the ledger, and their neighbours' events (re-read from the trailing
            # events offset) must find them, as after a restart (see run()).
            self._reload_sequential = False
            for tx in self.storage.in_flight_sequential():
                self._sequential.setdefault(tx, now)
        items = unique(self._work_items(messages, now))
        # TEST-ONLY negative control: offsets committed before the work, for sure (if the
        # commit fails, the batch is not lost: the control shows nothing this time)
        if self._faults.unsafe("auto-commit"):
            with suppress(TransientError):
                self._consumer.commit({(m.topic, m.partition): m.offset + 1 for m in messages})
        reports = self._execute(items) if items else []
        if items:  # (a batch with no work has no local commit to crash after)
            self._faults.hit("participant.after_local_commit")
        events, acks = acknowledgements(self.name, now, reports, self._partition_count)
        for r in events:
            event = StepEvent(
                tx_id=r.tx_id,
                step=r.step,
                participant=self.name,
                status=r.status,
                at_ms=now,
                # a handler's or a driver's text: cut to what the contract allows
                reason=r.reason[:MAX_REASON_CHARS] if r.reason is not None else None,
                confirm=r.confirm,
            )
            headers = self._router.event_route(r.tx_id, r.step, r.status)
            headers += self.observer.event_headers(r) or ()
            self._producer.produce(self.topics.events, r.tx_id, encode(event), headers)
        for ack, single in acks:
            headers = event_headers(())  # no other participant acts on it
            headers += (self.observer.event_headers(single) or ()) if single else ()
            self._producer.produce(self.topics.events, ack.tx_id, encode(ack), headers)
        # The events must be in the log before the offsets say the inputs are done.
        self._producer.flush(30)
        offsets: dict[tuple[str, int], int] = {}
        for m in messages:
            if m.topic in (self.topics.events, self.topics.decisions):
                trailing = self._event_offsets.setdefault((m.topic, m.partition), deque())
                trailing.append((m.offset, now))
            else:
                offsets[(m.topic, m.partition)] = m.offset + 1
        self._faults.hit("participant.after_events")
        self._commit(offsets)
        self.stats.batches += 1
        self.stats.records += len(messages)
        self.stats.items += len(items)
        self.stats.events += len(reports)
        self.observer.handled(items, reports)

    def _execute(self, items: list[WorkItem]) -> list[Report]:
        try:
            return self._execute_retrying(items)
        except (ConfigurationError, FatalKafkaError):
            raise  # the storage refuses us (credentials, schema): exit, a restart can fix it
        except Exception as exc:  # one item must not stop the others, nor the process
            if len(items) == 1:
                return self._poisoned(items[0], exc)
            log.error(
                "a batch of %d items failed (%s: %s); running them one by one",
                len(items),
                type(exc).__name__,
                exc,
            )
        reports: list[Report] = []
        for item in items:
            try:
                reports += self._execute_retrying([item])
            except (ConfigurationError, FatalKafkaError):
                raise
            except Exception as exc:  # only after the batch failed
                reports += self._poisoned(item, exc)
        return reports

    def _poisoned(self, item: WorkItem, exc: Exception) -> list[Report]:
        """An item the storage fails on for good: its step fails; nothing else stops.

        The item's local transaction did not commit, so nothing of it took effect. A
        request's step is then recorded ``failed`` in the ledger, without running its
        action, and reported so: the saga rolls back, the rollback finds the entry (and
        reports the step compensated), and a repeat of the request fails the same way.
        A decision that cannot be carried out is left to the audit, which reports the
        saga stuck and can replay the decision once the cause is fixed.
        """
        self.stats.poisoned += 1
        reason = f"could not be handled: {type(exc).__name__}: {exc}"
        log.error(
            "%s of %s: %s", type(item).__name__, item.tx_id, reason, extra={"tx_id": item.tx_id}
        )
        if not isinstance(item, Requested):
            return []
        try:
            return self._execute_retrying([replace(item, fail_reason=reason[:MAX_REASON_CHARS])])
        except (ConfigurationError, FatalKafkaError):
            raise
        except Exception as again:  # the ledger itself fails on it: report, record nothing
            log.error(
                "could not record the failure of %s: %s",
                item.tx_id,
                again,
                extra={"tx_id": item.tx_id},
            )
            return [Report(item.tx_id, item.step, StepStatus.FAILED, reason)]

    def _execute_retrying(self, items: list[WorkItem]) -> list[Report]:
        paused = False

        def before_sleep(state: RetryCallState) -> None:
            nonlocal paused
            self.stats.retries += 1
            exc = state.outcome.exception() if state.outcome else None
            log.warning("storage unavailable, retrying the batch: %s", exc)
            if self.announcer is not None:
                self.announcer.beat()  # still there, though waiting for its storage
            self._consumer.pause_all()
            paused = True
            # Keep the group membership alive; a newly assigned partition may
            # still deliver: keep those records for the next batch.
            self._carry.extend(self._consumer.poll_batch(self.pace.limit, 0))

        retrying = Retrying(
            retry=retry_if_exception_type(TransientError),
            wait=wait_exponential(multiplier=0.1, max=self.max_backoff_s),
            stop=stop_never,
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            reports: list[Report] = retrying(self.observer.timed(self.storage.execute), items)
        finally:
            if paused:  # resuming after every batch cost a tenth of the main thread's CPU
                self._consumer.resume_all()
        return reports

    def _commit(self, offsets: dict[tuple[str, int], int]) -> None:
        horizon = self.clock() - self.event_window_ms
        for tp, pending in self._event_offsets.items():
            last = None
            while pending and pending[0][1] <= horizon:
                last = pending.popleft()[0]
            if last is not None:
                offsets[tp] = last + 1
        if offsets:
            # Not waited for: a commit that fails (a rebalance, a broker restart) only has
            # these records read again, and the ledger makes the repeat harmless.
            try:
                self._consumer.commit_async(offsets)
            except TransientError as exc:
                log.warning("offsets not committed, the records will be read again: %s", exc)

    # ------------------------------------------------------------ records -> work

    def _work_items(self, messages: list[Message], now: int) -> list[WorkItem]:
        items: list[WorkItem] = []
        for m in messages:
            verdict = self._router.screen(m)  # headers only: most records stop here
            if verdict is not Verdict.DECODE:
                self.stats.routed += 1
                if isinstance(verdict, Seen):
                    seen = self._router.seen(m, verdict, self._partition_count, now)
                    if isinstance(seen, str):  # not signed by a client or an operator
                        self.stats.unauthenticated += 1
                        log.warning(
                            "not acting on %s/%d@%d: %s", m.topic, m.partition, m.offset, seen
                        )
                    elif seen is not None:
                        items.append(seen)
                continue
            try:
                if m.topic == self.topics.requests:
                    # Aborts and resolves are the coordinator's business: read, not acted on.
                    record = decode_keyed(m.key, m.value, SagaRequest, SagaAbort, SagaResolve)
                elif m.topic == self.topics.decisions:
                    record = decode_keyed(m.key, m.value, Decision)
                else:
                    # (saga.committed: the coordinator's business, read and passed over)
                    record = decode_keyed(m.key, m.value, StepEvent, StepsCommitted)
                if partition_for(m.key or b"", self._partition_count) != m.partition:
                    # On another transaction's partition: the coordinator never decides it,
                    # so an effect here would never be settled.
                    raise InvalidRecord("record is not on its key's partition")
            except InvalidRecord as exc:
                # The coordinator moves it to the DLQ; here it only must not block.
                self.stats.skipped_invalid += 1
                log.debug(
                    "skipping invalid record at %s/%d@%d: %s", m.topic, m.partition, m.offset, exc
                )
                continue
            if isinstance(record, SagaRequest):
                if self._authentic(m, record):
                    items.extend(self._requested(record, now))
            elif isinstance(record, Decision):
                if self._authentic(m, record):
                    items.append(DecisionArrived(record.tx_id, record.outcome, now))
            elif isinstance(record, StepEvent):
                items.extend(self._neighbour(record, m, now))
        self._forget_old(now)
        return items

    def _authentic(self, m: Message, record: SagaRequest | Decision | StepEvent) -> bool:
        """Whether ``record`` (read as ``m``) may be acted on: signed by whom it must be."""
        if self._keys is None:
            return True
        reason = self._keys.check(m.topic, m.key, m.value, m.headers, allowed_signers(record))
        if reason is None and isinstance(record, StepEvent):
            owners = self._owners.get(record.tx_id)
            if owners is not None and (
                record.step >= len(owners) or owners[record.step] != record.participant
            ):
                # Signed by who it names, but that one speaks for another's step.
                reason = f"step {record.step} of {record.tx_id} is not {record.participant}'s"
        if reason is None:
            return True
        # The coordinator moves it to the DLQ (requests, decisions); here it is not acted on.
        self.stats.unauthenticated += 1
        log.warning(
            "not acting on %s/%d@%d (%s of %s): %s",
            m.topic,
            m.partition,
            m.offset,
            record.TYPE,
            record.tx_id,
            reason,
            extra={"tx_id": record.tx_id},
        )
        return False

    def _seen(self, memory: OrderedDict[tuple[str, int], _Seen], key: tuple[str, int]) -> bool:
        """Whether a neighbour's event ``key`` was seen, and is authentic (checked now)."""
        found = memory.get(key)
        if found is None:
            return False
        _, event, m = found
        if self._authentic(m, event):
            return True
        memory.pop(key, None)  # forged: checked once, forgotten
        return False

    def _requested(self, request: SagaRequest, now: int) -> list[WorkItem]:
        out: list[WorkItem] = []
        n = len(request.steps)
        fingerprint = request.fingerprint()
        owners = tuple(s.participant for s in request.steps)
        if self._keys is not None and request.mode is Mode.SEQUENTIAL and self.name in owners:
            self._owners[request.tx_id] = owners  # before the neighbours' events are checked
        for index, step in enumerate(request.steps):
            if step.participant != self.name:
                continue
            sequential = request.mode is Mode.SEQUENTIAL
            out.append(
                Requested(
                    tx_id=request.tx_id,
                    step=index,
                    action=step.action,
                    args=step.args,
                    mode=request.mode,
                    n_steps=n,
                    deadline_ms=request.deadline_ms,
                    now_ms=now,
                    predecessor_applied=sequential
                    and self._seen(self._applied_seen, (request.tx_id, index - 1)),
                    successor_compensated=sequential
                    and self._seen(self._compensated_seen, (request.tx_id, index + 1)),
                    fingerprint=fingerprint,
                    isolation=request.isolation,
                )
            )
            if sequential:
                self._sequential[request.tx_id] = now
                self._sequential.move_to_end(request.tx_id)
        if not out:  # no step here: remember the payload, so another one is recognised
            out.append(RequestSeen(request.tx_id, fingerprint, request.deadline_ms, now))
        else:
            self._router.remember(request)  # the readers of this step's events
        return out

    def _neighbour(self, event: StepEvent, m: Message, now: int) -> list[WorkItem]:
        if event.status is StepStatus.APPLIED:
            self._applied_seen[(event.tx_id, event.step)] = (now, event, m)
            if event.tx_id in self._sequential and self._authentic(m, event):
                return [PredecessorApplied(event.tx_id, event.step + 1, now)]
        elif event.status is StepStatus.COMPENSATED and event.step > 0:
            self._compensated_seen[(event.tx_id, event.step)] = (now, event, m)
            if event.tx_id in self._sequential and self._authentic(m, event):
                return [SuccessorCompensated(event.tx_id, event.step - 1, now)]
        return []

    def _forget_old(self, now: int) -> None:
        horizon = now - self.event_window_ms
        for seen in (self._applied_seen, self._compensated_seen):
            while seen and next(iter(seen.values()))[0] <= horizon:
                seen.popitem(last=False)
        # A sequential saga outlives its deadline by far less than an hour.
        horizon = now - max(self.event_window_ms, 3_600_000)
        while self._sequential and next(iter(self._sequential.values())) <= horizon:
            tx, _ = self._sequential.popitem(last=False)
            self._owners.pop(tx, None)
