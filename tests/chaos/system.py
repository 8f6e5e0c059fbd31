"""One saga system under test: its topics, stores, processes, load and history.

A :class:`System` owns a topic prefix, a token naming its PostgreSQL schema, Mongo
database and Redis key prefix, a :class:`~tests.chaos.cluster.Cluster` of real
processes, and the run's own clients (a producer, and tails of the decisions and
status topics). It submits transfers and records the history of every
submission (acknowledged or not, its final state as the status topic shows it),
injects the record faults (duplicates, the barrier trio, poison) and finally
gathers everything the checker needs.

Signed records (``signing``, the default): the system gets a key folder of its
own (``<workdir>/keys``: every principal's keys, :func:`streams._signing.create_key`),
its processes get ``SAGA_KEYS_DIR``, the run's sender signs as the ``client``, and
the run's readers take only records signed by one allowed to write them. A
duplicate is the original record with its original headers; poison is unsigned,
and with ``forged`` the forged records of :func:`tests.chaos.poison.forged` join it.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from saga.streams import Mode, SagaAbort, SagaRequest, encode
from saga.streams._errors import SagaError
from saga.streams._signing import (
    CLIENT,
    COORDINATOR,
    OPERATOR,
    Keyring,
    create_key,
    participant_principal,
)
from saga.streams.kafka import Consumer, KafkaSettings, create_topics, delete_topics, partition_for
from tests._infra import Services
from tests.chaos import poison
from tests.chaos.checker import CheckInput, Verdict, check
from tests.chaos.cluster import Cluster
from tests.chaos.faults import FaultBook
from tests.chaos.log import (
    DecisionSeen,
    DecisionTail,
    Delivery,
    LogView,
    Sender,
    StatusTail,
    read_log,
)
from tests.chaos.stores import Stores
from tests.chaos.workload import PARTICIPANTS, TARGET, Transfer, openings

SAGA_TIMEOUT_S = 6 * 3600
"""Deadline of every saga: longer than any run, so a lost record leaves its saga unfinished
instead of being papered over by a deadline rollback."""


@dataclass
class Submission:
    transfer: Transfer
    value: bytes
    sent_at: float
    acked: bool | None = None
    headers: tuple[tuple[str, bytes], ...] = ()  # as sent (a duplicate repeats them)


@dataclass
class Quiesce:
    """Time from each fault's recovery until every saga submitted before it is final."""

    label: str
    at: float
    waiting_for: frozenset[str]
    pending: set[str]
    seconds: float | None = None
    gone: bool = False  # timed from the kill of a process gone for good, not a recovery


@dataclass
class Record:
    """Record faults injected, by kind (duplicates, poison, trio steps)."""

    counts: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, n: int = 1) -> None:
        with self.lock:
            self.counts[kind] += n


class System:
    def __init__(
        self,
        services: Services,
        *,
        label: str,
        workdir: Path,
        seed: int,
        stores: tuple[str, ...],
        partitions: int,
        book: FaultBook,
        coordinators: int = 2,
        workers: dict[str, int] | None = None,
        unsafe: str | None = None,
        signing: bool = True,
        forged: bool = False,
        replication_factor: int = 1,
        targets: tuple[str, ...] = (TARGET,),
    ) -> None:
        self.services = services
        self.label = label
        # A plain name: an SQL schema, a Mongo database, a Redis prefix and a topic prefix.
        self.token = f"chaos{re.sub('[^a-z0-9]', '', label)[:4]}{uuid.uuid4().hex[:8]}"
        self.prefix = self.token
        self.settings = KafkaSettings(bootstrap=services.kafka_bootstrap, prefix=self.prefix)
        self.topics = self.settings.topics
        self.partitions = partitions
        self.replication_factor = replication_factor
        self.stores_used = stores
        self.stores = Stores(services, self.token)
        self.workdir = workdir / label
        self.book = book
        self.rnd = random.Random(f"{seed}:{label}")
        self.keys_dir: Path | None = None
        self.keys: Keyring | None = None  # the client's: signs what the run sends
        self.signers: dict[str, Keyring] = {}  # every principal's, and a stranger's
        self.forged = forged and signing
        if signing:
            self.keys_dir = self.workdir / "keys"
            self.keys, self.signers = _make_keys(self.keys_dir, self.workdir / "stranger-keys")
        self.cluster = Cluster(
            services,
            prefix=self.prefix,
            token=self.token,
            logs=self.workdir / "logs",
            stores=stores,
            coordinators=coordinators,
            workers=workers,
            unsafe=unsafe,
            clock_start=book.t0,
            keys_dir=self.keys_dir,
            targets=targets,
        )
        self.submissions: dict[str, Submission] = {}
        self.order: list[str] = []
        self.trio_ids: set[str] = set()
        self.poison: list[Delivery] = []
        self.records = Record()
        self.quiesce: list[Quiesce] = []
        self.late: set[str] = set()  # not final when their recovery window ended
        self.openings: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        self._sender: Sender | None = None
        self._decisions: DecisionTail | None = None
        self._status: StatusTail | None = None
        self._monitor_stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.dup_decision_share = 0.0

    # ------------------------------------------------------------ lifecycle

    def create(self, transfers: Iterable[Transfer]) -> None:
        """Topics and stores with every account the planned transfers use."""
        self.openings = openings(transfers, self.stores_used)
        self.stores.create(self.openings)
        create_topics(self.settings, self.partitions, self.replication_factor)

    def start(self) -> None:
        self._sender = Sender(self.settings, self.keys)
        self._decisions = DecisionTail(self.settings, self.partitions, self.keys)
        self._decisions.listeners.append(self._maybe_duplicate_decision)
        self._decisions.start()
        self._status = StatusTail(self.settings, self.partitions, self.keys).start()
        self.cluster.start()
        self._monitor = threading.Thread(target=self._watch_quiesce, name="quiesce", daemon=True)
        self._monitor.start()

    @property
    def sender(self) -> Sender:
        assert self._sender is not None
        return self._sender

    @property
    def status(self) -> StatusTail:
        assert self._status is not None
        return self._status

    @property
    def decisions(self) -> DecisionTail:
        assert self._decisions is not None
        return self._decisions

    def stop(self) -> None:
        """Stop the processes, then the run's own clients."""
        self.cluster.stop()
        self._monitor_stop.set()
        if self._monitor is not None:
            self._monitor.join(10)
        if self._sender is not None:
            self._sender.close()
        for tail in (self._decisions, self._status):
            if tail is not None:
                tail.stop()

    def destroy(self) -> None:
        """Delete the topics and the stores' data."""
        delete_topics(self.settings, list(self.topics.all))
        self.stores.drop()

    # ------------------------------------------------------------ load

    def submit(self, t: Transfer, *, duplicate_share: float = 0.0) -> None:
        now = int(time.time() * 1000)
        request = SagaRequest(
            tx_id=t.tx_id,
            saga="transfer",
            mode=Mode(t.mode),
            steps=tuple(t.steps()),
            deadline_ms=now + SAGA_TIMEOUT_S * 1000,
            created_ms=now,
            meta={"chaos": self.label},
        )
        value = encode(request)
        topic = self.topics.requests
        headers = tuple(self.keys.sign(topic, t.tx_id, value)) if self.keys is not None else ()
        sub = Submission(t, value, time.monotonic(), headers=headers)
        with self._lock:
            self.submissions[t.tx_id] = sub
            self.order.append(t.tx_id)

        def done(d: Delivery) -> None:
            sub.acked = bool(d.acked)

        self.sender.send(topic, t.tx_id, value, label="request", on_done=done, headers=headers)
        if duplicate_share and self.rnd.random() < duplicate_share:
            self.duplicate_request(t.tx_id, "duplicate.request.in_flight")

    def duplicate_request(self, tx_id: str, kind: str) -> None:
        sub = self.submissions[tx_id]
        # The original record as it was sent: value, headers and signature.
        self.sender.send(
            self.topics.requests,
            tx_id,
            sub.value,
            label=kind,
            injected="duplicate",
            headers=sub.headers,
        )
        self.records.add(kind)
        for store in {sub.transfer.src, sub.transfer.dst}:
            self.records.add(f"barrier.duplicate_request.{store}")

    def duplicate_decision(self, seen: DecisionSeen, kind: str) -> None:
        # The coordinator's decision as it is in the log: value, headers and signature.
        self.sender.send(
            self.topics.decisions,
            seen.tx_id,
            seen.value,
            label=kind,
            injected="duplicate",
            headers=seen.headers,
        )
        sub = self.submissions.get(seen.tx_id)
        what = "duplicate_compensation" if seen.outcome == "rollback" else "duplicate_decision"
        self.records.add(f"{kind}.{seen.outcome}")
        if sub is not None:
            for store in {sub.transfer.src, sub.transfer.dst}:
                self.records.add(f"barrier.{what}.{store}")

    def _maybe_duplicate_decision(self, seen: DecisionSeen) -> None:
        if self.dup_decision_share and self.rnd.random() < self.dup_decision_share:
            with contextlib.suppress(SagaError):
                self.duplicate_decision(seen, "duplicate.decision.in_flight")

    def submitted_ids(self) -> list[str]:
        with self._lock:
            return list(self.order)

    # ------------------------------------------------------------ record faults

    def trio(self, t: Transfer, timeout: float = 120) -> str:
        """Rollback before request (null compensation), then the request (hanging), then a
        repeated request: each participant must leave its account as it was."""
        now = int(time.time() * 1000)
        abort = SagaAbort(t.tx_id, "chaos: rollback before the request", now)
        with self._lock:
            self.trio_ids.add(t.tx_id)
        self.sender.send(self.topics.requests, t.tx_id, encode(abort), label="abort")
        deadline = time.monotonic() + timeout
        seen = None
        while seen is None and time.monotonic() < deadline:
            seen = self.decisions.get(t.tx_id)
            time.sleep(0.2)
        # Each participant has the rollback once its ledger records it (the marker of a
        # transaction it knows no step of): only then does the request go out.
        waiting = {t.src, t.dst} if seen is not None else set()
        while waiting and time.monotonic() < deadline:
            for store in list(waiting):
                try:
                    if self.stores.rollback_recorded(store, t.tx_id):
                        waiting.discard(store)
                except Exception:  # a store being restarted: ask again
                    pass
            if waiting:
                time.sleep(0.3)
        ordered = seen is not None and not waiting
        self.submit(t)
        for store in {t.src, t.dst}:
            self.records.add(f"barrier.null_compensation.{store}")
            self.records.add(f"barrier.hanging.{store}")
        time.sleep(2)
        self.duplicate_request(t.tx_id, "duplicate.request.after_rollback")
        if not ordered:
            return "the rollback was not seen processed before the request was sent"
        return "rollback processed before the request"

    def inject_poison(self, tag: str) -> int:
        ids = self.submitted_ids()
        real = ids[-1] if ids else f"nothing-{tag}"
        now = int(time.time() * 1000)
        topic = {
            "requests": self.topics.requests,
            "events": self.topics.events,
            "decisions": self.topics.decisions,
        }
        sent = 0
        for label, kind, key, value in poison.batch(f"{tag}", real, now):
            record = self.sender.send(topic[kind], key, value, label=label, sign=False)
            with self._lock:
                self.poison.append(record)
            self.records.add(f"poison.{kind}")
            sent += 1
        for label, kind, key, value in poison.misplaced_ack(tag, real, now, self.partitions):
            record = self.sender.send(topic[kind], key, value, label=label, sign=False)
            with self._lock:
                self.poison.append(record)
            self.records.add(f"poison.{kind}")
            sent += 1
        for label, kind, key, value in poison.misplaced(tag, now):
            wrong = (partition_for(key or "", self.partitions) + 1) % self.partitions
            record = self.sender.send(
                topic[kind], key, value, label=label, partition=wrong, sign=False
            )
            with self._lock:
                self.poison.append(record)
            self.records.add(f"poison.{kind}")
            sent += 1
        if self.forged and ids:
            names = {**topic, "status": self.topics.status}
            for label, kind, key, value, headers in poison.forged(real, now, self.signers, names):
                record = self.sender.send(names[kind], key, value, label=label, headers=headers)
                self.records.add(f"forged.{kind}")
                if kind in poison.FORGED_IN_DLQ:
                    with self._lock:
                        self.poison.append(record)
                    sent += 1
        return sent

    def duplicates_after(self, tx_ids: list[str], share: float) -> None:
        """Repeat the request and the decision of some finished sagas."""
        finals = self.status.finals()
        for tx in tx_ids:
            if tx in finals and self.rnd.random() < share:
                self.duplicate_request(tx, "duplicate.request.after_final")
                seen = self.decisions.get(tx)
                if seen is not None:
                    self.duplicate_decision(seen, "duplicate.decision.after_final")

    # ------------------------------------------------------------ quiescence

    def after_fault(self, label: str, *, since: float | None = None, gone: bool = False) -> None:
        """Start the clock: every saga submitted so far must become final.

        ``since`` (a ``time.monotonic()``, default now) is when the clock started: the
        kill of a process gone for good (``gone``), whose sagas are timed from then.
        """
        finals = self.status.finals()
        pending = {tx for tx in self.submitted_ids() if tx not in finals}
        at = time.monotonic() if since is None else since
        q = Quiesce(label, at, frozenset(pending), set(pending), gone=gone)
        if not pending:
            q.seconds = 0.0
        with self._lock:
            self.quiesce.append(q)

    def _watch_quiesce(self) -> None:
        while not self._monitor_stop.wait(0.5):
            with self._lock:
                open_ = [q for q in self.quiesce if q.seconds is None]
            if not open_:
                continue
            finals = self.status.finals()
            for q in open_:
                q.pending = {tx for tx in q.pending if tx not in finals}
                if not q.pending:
                    last = max((finals[tx] for tx in q.waiting_for), default=q.at)
                    q.seconds = max(0.0, last - q.at)

    def settle(self, within_s: float) -> float | None:
        """Wait until every fault's sagas are final (see :meth:`after_fault`); how long it
        took, or ``None`` when ``within_s`` passed first."""
        t0 = time.monotonic()
        while True:
            with self._lock:
                open_ = any(q.seconds is None for q in self.quiesce)
            if not open_:
                return time.monotonic() - t0
            if time.monotonic() - t0 >= within_s:
                return None
            time.sleep(0.25)

    def all_final(self, tx_ids: Iterable[str]) -> bool:
        finals = self.status.finals()
        return all(tx in finals for tx in tx_ids)

    def _data_ends(self, topics: tuple[str, ...]) -> dict[tuple[str, int], int]:
        """Per partition, the offset after its last record (transaction markers take
        offsets too, so a group that read everything may stay below the end offset)."""
        reader = Consumer(self.settings, group_id=None, client_id="chaos.lag")
        try:
            ends = {}
            starts = []
            for t in topics:
                for p in range(self.partitions):
                    low, high = reader.watermarks(t, p)
                    ends[(t, p)] = max(low, high - 50)  # no record seen: assume the window start
                    if high > low:
                        starts.append((t, p, max(low, high - 50), high))
            if not starts:
                return ends
            reader.assign([(t, p, start) for t, p, start, _ in starts])
            todo = {(t, p): high for t, p, _, high in starts}
            deadline = time.monotonic() + 20
            while todo and time.monotonic() < deadline:
                for m in reader.poll_batch(500, 0.1):
                    ends[(m.topic, m.partition)] = max(ends[(m.topic, m.partition)], m.offset + 1)
                positions = reader.position(list(todo))
                for tp, pos in positions.items():
                    if pos is not None and pos >= todo[tp]:
                        todo.pop(tp, None)
            if todo:
                raise TimeoutError("could not read the tail of the topics")
            return ends
        finally:
            reader.close()

    def caught_up(self) -> bool:
        """Every consumer group has read its inputs to the end (participants: requests;
        their events and decisions offsets trail by design)."""
        t = self.topics
        groups = [(f"{self.prefix}.coordinator", (t.requests, t.events, t.decisions))]
        groups += [
            (f"{self.prefix}.participant.{PARTICIPANTS[s]}", (t.requests,))
            for s in self.stores_used
        ]
        try:
            ends = self._data_ends((t.requests, t.events, t.decisions))
            for group, topics in groups:
                member = Consumer(self.settings, group_id=group, client_id="chaos.lag")
                try:
                    got = member.committed([(x, p) for x in topics for p in range(self.partitions)])
                finally:
                    member.close()
                for tp, off in got.items():
                    if ends[tp] > 0 and (off is None or off < ends[tp]):
                        return False
        except (SagaError, TimeoutError):
            return False
        return True

    def wait_quiet(self, tx_ids: list[str], timeout: float) -> float | None:
        """Wait until every saga of ``tx_ids`` is final and every group caught up; when
        ``timeout`` (the recovery window) passes first, the sagas not final are *late*."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.all_final(tx_ids) and self.caught_up():
                return time.monotonic() - t0
            time.sleep(2)
        finals = self.status.finals()
        with self._lock:
            self.late.update(tx for tx in tx_ids if tx not in finals)
        return None

    # ------------------------------------------------------------ judging

    def write_history(self, log: LogView) -> Path:
        """One JSON line per submission: the transfer, whether Kafka acknowledged it, the
        outcome the client saw (``ok``, ``failed`` or ``unknown``) and the log's decision."""
        path = self.workdir / "history.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        seen = {"committed": "ok", "rolled_back": "failed", "failed": "failed"}
        with self._lock, path.open("w", encoding="utf-8") as out:
            for tx in self.order:
                sub = self.submissions[tx]
                status = log.statuses.get(tx)
                decisions = [d.outcome for d in log.decisions.get(tx, []) if not d.injected]
                row = {
                    **sub.transfer.to_json(),
                    "acknowledged": sub.acked,
                    "trio": tx in self.trio_ids,
                    "outcome": seen.get(str(status.state), "unknown") if status else "unknown",
                    "decisions": decisions,
                }
                out.write(json.dumps(row) + "\n")
        return path

    def check(self) -> Verdict:
        """Read the log, the stores and the ledgers (the processes are stopped) and judge."""
        log = read_log(self.settings, self.keys)
        self.write_history(log)
        with self._lock:
            transfers = [self.submissions[tx].transfer for tx in self.order]
            acked = {tx: s.acked for tx, s in self.submissions.items()}
            trio = set(self.trio_ids)
            poison_records = list(self.poison)
            late = set(self.late)
        return check(
            CheckInput(
                transfers=transfers,
                acked=acked,
                trio=trio,
                openings=self.openings,
                balances=self.stores.balances(),
                ledgers=self.stores.ledgers(),
                log=log,
                poison=poison_records,
                late=late,
            )
        )


def _make_keys(folder: Path, stranger: Path) -> tuple[Keyring, dict[str, Keyring]]:
    """Every principal's keys in ``folder`` (as ``saga keys create`` makes them) and a
    client key in ``stranger`` (a key the folder does not know); the client's keyring
    and every principal's, by name (``stranger`` too)."""
    principals = [
        COORDINATOR,
        CLIENT,
        OPERATOR,
        *(participant_principal(p) for p in PARTICIPANTS.values()),
    ]
    for principal in principals:
        create_key(folder, principal)
    create_key(stranger, CLIENT)
    signers = {p: Keyring.load(folder, p) for p in principals}
    signers["stranger"] = Keyring.load(stranger, CLIENT)
    return signers[CLIENT], signers
