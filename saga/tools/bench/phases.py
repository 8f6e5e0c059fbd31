"""The saga phases: fresh topics, data and processes; warm-up, measured window, drain.

A signed phase (``--signing on|both``) creates a key folder of its own (every
principal's keys, deleted with the phase), starts the processes with
``SAGA_KEYS_DIR`` naming it, signs its requests with the ``client`` key in batches
as ``SagaClient`` does, and verifies the final status record of each saga (the
coordinator's signature) as a client would: signing's cost is in every process's CPU.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from saga.streams import TransientError, encode
from saga.streams._lifecycle import wall_clock_ms
from saga.streams._routing import request_headers
from saga.streams._signed_log import signing
from saga.streams._signing import CLIENT as CLIENT_PRINCIPAL
from saga.streams._signing import (
    COORDINATOR,
    OPERATOR,
    Keyring,
    create_key,
    participant_principal,
)
from saga.streams.kafka import Consumer, KafkaLog, KafkaSettings, create_topics, delete_topics
from saga.streams.log import LogProducer
from saga.tools.bench.config import CLIENT, DEFAULT_LAYOUT, PARTICIPANTS, BenchConfig, Layout
from saga.tools.bench.proc import CpuMeter, settle
from saga.tools.bench.processes import check_alive, saga_processes
from saga.tools.bench.profile import Profiler
from saga.tools.bench.stores import prepare_data, store_totals
from saga.tools.bench.workload import Workload

_PROBE_TIMEOUT_S: Final = 120.0


def latency_summary(values: Sequence[int]) -> dict[str, float | None]:
    """p50 / p95 / p99 (nearest rank) and max, in ms; ``None`` without values."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "max": None, "n": 0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])

    return {
        "p50": rank(0.50),
        "p95": rank(0.95),
        "p99": rank(0.99),
        "max": float(ordered[-1]),
        "n": len(ordered),
    }


@dataclass
class SagaPhaseResult:
    name: str
    mode: str
    fail_share: float
    warmup_s: float
    duration_s: float
    offered_rate: float | None
    window: int | None
    sent: int = 0
    sent_in_window: int = 0
    completed_in_window: int = 0
    committed_in_window: int = 0
    rolled_back_in_window: int = 0
    failed: int = 0
    unexpected_rollbacks: int = 0
    unfinished: int = 0
    sagas_per_s: float = 0.0
    send_rate: float = 0.0
    shed: int = 0
    decision_latency_ms: dict[str, float | None] = field(default_factory=dict)
    completion_latency_ms: dict[str, float | None] = field(default_factory=dict)
    decision_seen_latency_ms: dict[str, float | None] = field(default_factory=dict)
    cpu_s: dict[str, float | None] = field(default_factory=dict)
    cpu_s_per_saga: dict[str, float | None] = field(default_factory=dict)
    cpu_cores_used: dict[str, float | None] = field(default_factory=dict)
    records_by_topic: dict[str, int] = field(default_factory=dict)
    records_per_saga: float | None = None
    records_per_saga_without_markers: float | None = None
    stores_agree: bool | None = None
    store_totals: dict[str, int] = field(default_factory=dict)
    expected_total: int = 0
    signed: bool = False
    settled_s: float = 0.0  # waited before the phase for the services to fall near idle
    settled_cores: float | None = None  # the services' cores when the wait ended
    forged_status: int = 0  # final status records whose signature did not hold (ignored)
    layout: str = "default"
    stores: dict[str, str] = field(default_factory=dict)  # participant -> store
    profile: dict[str, Any] | None = None  # --profile: files and top functions per process
    isolation: str = "read_committed"  # the level every saga of the phase asks for
    hot_records: int | None = None  # the hot phase: every step on one of this many records

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Tracker:
    """What the client knows about each saga it sent (wall-clock ms throughout)."""

    def __init__(self) -> None:
        self.created: dict[str, int] = {}
        self.amount: dict[str, int] = {}
        self.doomed: set[str] = set()
        self.decided_at: dict[str, int] = {}
        self.decision_seen: dict[str, int] = {}
        self.done: dict[str, tuple[int, str]] = {}
        self.forged = 0

    def on_records(
        self,
        messages: Sequence[Any],
        decisions_topic: str,
        authentic: Callable[[Any], bool] | None = None,
    ) -> int:
        """Take decision and status records; returns how many sagas became final.

        ``authentic`` (signed phases) must accept a final status record before it counts.
        """
        finished = 0
        now = wall_clock_ms()
        for m in messages:
            if m.value is None:
                continue
            try:
                data = orjson.loads(m.value)
            except orjson.JSONDecodeError:
                continue
            tx = data.get("tx_id")
            if tx not in self.created:
                continue
            if m.topic == decisions_topic:
                if tx not in self.decided_at:
                    self.decided_at[tx] = int(data["at_ms"])
                    self.decision_seen[tx] = now
            elif (
                data.get("state") in ("committed", "rolled_back", "failed") and tx not in self.done
            ):
                if authentic is not None and not authentic(m):
                    self.forged += 1
                    continue
                self.done[tx] = (int(data["updated_ms"]), str(data["state"]))
                finished += 1
        return finished


class SagaPhase:
    """One saga phase on fresh topics, data and processes (see :func:`run_saga_phase`)."""

    def __init__(
        self,
        cfg: BenchConfig,
        console: Console,
        result: SagaPhaseResult,
        services: Mapping[str, int | None],
        seed: int,
        *,
        layout: Layout = DEFAULT_LAYOUT,
        tag: str | None = None,
        signed: bool = False,
    ) -> None:
        self.cfg = cfg
        self.layout = layout
        tag = tag or result.name
        self.signed = signed
        self.keys: Keyring | None = None
        self.console = console
        self.result = result
        self.services = services
        self.settings = KafkaSettings(
            cfg.kafka.bootstrap, f"{cfg.kafka.prefix}.{tag}", cfg.kafka.extra
        )
        self.topics = self.settings.topics
        self.logs = cfg.logs / tag
        self.profile_dir = None if cfg.profile is None else cfg.profile / tag
        self.workload = Workload(
            accounts=cfg.accounts,
            fail_share=result.fail_share,
            seed=seed,
            tx_prefix=self.settings.prefix,
            timeout_s=cfg.saga_timeout,
            isolation=result.isolation,
            hot=result.hot_records,
        )
        self.tracker = _Tracker()
        self.completed = 0
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._producer: LogProducer | None = None
        self._consumer: Consumer | None = None
        self.meter = CpuMeter({})
        self.t0_ms = self.t1_ms = 0
        self.completed_at_t0 = 0

    # -- the pieces the loop uses

    @property
    def producer(self) -> LogProducer:
        assert self._producer is not None
        return self._producer

    @property
    def consumer(self) -> Consumer:
        assert self._consumer is not None
        return self._consumer

    def send_one(self) -> None:
        request, amount, doomed = self.workload.next()
        tx = request.tx_id
        self.tracker.created[tx] = request.created_ms
        self.tracker.amount[tx] = amount
        if doomed:
            self.tracker.doomed.add(tx)
        value = encode(request)
        topic = self.topics.requests
        # as SagaClient writes them (signed in batches by a signing producer)
        self.producer.produce(topic, tx, value, headers=request_headers(request))

    def _authentic(self, m: Any) -> bool:
        assert self.keys is not None
        return self.keys.check(m.topic, m.key, m.value, m.headers, frozenset({COORDINATOR})) is None

    def receive(self, timeout: float) -> None:
        batch = self.consumer.poll_batch(5000, timeout)
        if batch:
            self.completed += self.tracker.on_records(
                batch, self.topics.decisions, self._authentic if self.keys is not None else None
            )

    @property
    def in_flight(self) -> int:
        return len(self.tracker.created) - self.completed

    def check_alive(self) -> None:
        check_alive(self.procs, self.logs)

    # -- the phase

    def run(self) -> list[tuple[bytes | None, bytes | None]]:
        """Runs the phase, fills :attr:`result`; returns a sample of the phase's records."""
        cfg, result = self.cfg, self.result
        with self.console.status(
            f"{result.name}: preparing {cfg.accounts} accounts per store and the topics"
        ):
            prepare_data(cfg, self.layout)
            create_topics(self.settings, cfg.partitions)
        with self.console.status(
            f"{result.name}: waiting (up to {cfg.settle_timeout:g} s) for the services "
            "to finish the work left by the phase before"
        ):
            result.settled_s, result.settled_cores = settle(
                self.services, idle_cores=cfg.settle_cores, timeout_s=cfg.settle_timeout
            )
        keys_dir: tempfile.TemporaryDirectory[str] | None = None
        if self.signed:
            keys_dir = tempfile.TemporaryDirectory(prefix="saga-bench-keys-")
            self.keys = _create_keys(Path(keys_dir.name))
        try:
            folder = Path(keys_dir.name) if keys_dir is not None else None
            with saga_processes(cfg, self.layout, self.settings, self.logs, folder) as procs:
                self.procs = procs
                self._producer = signing(KafkaLog(self.settings), self.keys).producer(
                    client_id="saga.bench"
                )
                self._consumer = Consumer(
                    self.settings, group_id=None, client_id="saga.bench.status"
                )
                try:
                    self.consumer.assign(
                        [
                            (t, p, 0)
                            for t in (self.topics.decisions, self.topics.status)
                            for p in range(cfg.partitions)
                        ]
                    )
                    self._await_ready()
                    self._drive()
                finally:
                    self.consumer.close()
                    self.producer.close()
            self._summarise()
            result.records_by_topic = _end_offsets(self.settings, cfg.partitions)
            if self.tracker.created:
                total = sum(result.records_by_topic.values())
                result.records_per_saga = round(total / len(self.tracker.created), 3)
            sample, record_share = _sample_records(
                self.settings, cfg.partitions, result.records_by_topic
            )
            if self.tracker.created:
                records = sum(
                    n * record_share.get(t, 1.0) for t, n in result.records_by_topic.items()
                )
                result.records_per_saga_without_markers = round(
                    records / len(self.tracker.created), 3
                )
            with self.console.status(f"{result.name}: checking the three stores"):
                self._check_stores()
            result.signed = self.signed
            result.forged_status = self.tracker.forged
        finally:
            if keys_dir is not None:
                keys_dir.cleanup()
            if not cfg.keep_topics:
                with suppress(Exception):
                    delete_topics(self.settings, self.topics.all)
        return sample

    def _await_ready(self) -> None:
        """One saga through every process: they have joined their groups once it finishes."""
        workers = len(self.procs) - 1
        with self.console.status(
            f"{self.result.name}: starting the coordinator and {workers} participant workers"
        ):
            self.send_one()
            self.producer.flush(30)
            deadline = time.monotonic() + _PROBE_TIMEOUT_S
            while self.completed == 0:
                self.receive(0.1)
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TransientError(
                        f"the first saga did not finish within {_PROBE_TIMEOUT_S:.0f} s; "
                        f"see the logs in {self.logs}"
                    )

    def _drive(self) -> None:
        """Warm-up, then the measured window, then drain every saga sent."""
        cfg, result = self.cfg, self.result
        pids: dict[str, int | None] = {n: p.pid for n, p in self.procs.items()}
        pids[CLIENT] = os.getpid()
        pids.update(self.services)
        self.meter = CpuMeter(pids, self_only=frozenset({CLIENT}))
        profiler: Profiler | None = None
        if self.profile_dir is not None and result.name == "main":
            product = {n: p for n, p in pids.items() if n not in self.services and p is not None}
            profiler = Profiler(self.profile_dir, product, result.duration_s)
        closed = result.mode == "closed"
        how = f"closed loop, window {cfg.window}" if closed else f"open loop at {cfg.rate:g}/s"
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        with progress:
            task = progress.add_task(
                f"{result.name} ({how})", total=cfg.warmup + result.duration_s, info=""
            )
            sent_before = len(self.tracker.created)
            start = time.monotonic()
            t0, t1 = start + cfg.warmup, start + cfg.warmup + result.duration_s
            self.t0_ms = 0
            measuring = False
            next_ui = next_check = start
            sent_at_t0 = shed = 0
            # Open loop: while `window` sagas are in flight the system is not keeping up;
            # the sagas due are shed (counted, not sent), so backlog and drain stay bounded.
            backlog_cap = cfg.window
            while (now := time.monotonic()) < t1:
                if not measuring and now >= t0:
                    self.meter.start()
                    if profiler is not None:
                        profiler.start()
                    self.t0_ms = wall_clock_ms()
                    sent_at_t0 = len(self.tracker.created)
                    self.completed_at_t0 = self.completed
                    measuring = True
                if closed:
                    due = cfg.window - self.in_flight
                    timeout = 0.01 if due <= 0 else 0.0
                else:
                    offered = int((now - start) * cfg.rate)
                    due = offered - (len(self.tracker.created) - sent_before) - shed
                    timeout = min(0.005, 0.5 / cfg.rate)
                    if due > 0 and self.in_flight >= backlog_cap:
                        shed += due
                        result.shed += due if measuring else 0
                        due = 0
                for _ in range(min(due, 2000)):
                    self.send_one()
                self.receive(timeout)
                if now >= next_check:
                    self.check_alive()
                    next_check = now + 1.0
                if now >= next_ui:
                    info = self._progress_info(measuring)
                    progress.update(task, completed=now - start, info=info)
                    next_ui = now + 0.25
            self.meter.stop()
            self.t1_ms = wall_clock_ms()
            if profiler is not None:
                with self.console.status(f"{result.name}: writing the profiles"):
                    result.profile = profiler.finish()
            result.sent_in_window = len(self.tracker.created) - sent_at_t0
            progress.update(task, completed=cfg.warmup + result.duration_s)
            self.producer.flush(30)
            # Drain: every saga sent finishes before the processes stop, so nothing
            # of this phase is left to load the next one.
            total = len(self.tracker.created)
            drain = progress.add_task("  draining", total=total, info="")
            deadline = time.monotonic() + cfg.drain_timeout
            while self.completed < total and time.monotonic() < deadline:
                self.receive(0.1)
                self.check_alive()
                progress.update(drain, completed=self.completed, info=f"{self.in_flight} in flight")
            progress.update(drain, completed=self.completed)

    def _progress_info(self, measuring: bool) -> str:
        if not measuring:
            return f"warm-up  done {self.completed:,}  in flight {self.in_flight:,}"
        done = self.completed - self.completed_at_t0
        rate = done / max(0.001, (wall_clock_ms() - self.t0_ms) / 1000)
        shed = f"  shed {self.result.shed:,}" if self.result.shed else ""
        return f"measuring  ~{rate:,.0f} sagas/s  in flight {self.in_flight:,}{shed}"

    def _summarise(self) -> None:
        result, tracker = self.result, self.tracker
        t0_ms, t1_ms = self.t0_ms, self.t1_ms
        window_s = (t1_ms - t0_ms) / 1000
        result.duration_s = round(window_s, 3)
        result.sent = len(tracker.created)
        result.unfinished = result.sent - len(tracker.done)
        finals = [state for at, state in tracker.done.values() if t0_ms <= at < t1_ms]
        result.committed_in_window = finals.count("committed")
        result.rolled_back_in_window = finals.count("rolled_back")
        result.completed_in_window = result.committed_in_window + result.rolled_back_in_window
        result.failed = sum(1 for _, s in tracker.done.values() if s == "failed")
        result.unexpected_rollbacks = sum(
            1
            for tx, (_, s) in tracker.done.items()
            if s == "rolled_back" and tx not in tracker.doomed
        )
        result.sagas_per_s = round(result.completed_in_window / window_s, 1)
        result.send_rate = round(result.sent_in_window / window_s, 1)
        # Latencies of the sagas submitted inside the window (all drained by now).
        created = tracker.created
        in_window = [tx for tx, c in created.items() if t0_ms <= c < t1_ms]

        def summary(ends: Mapping[str, int]) -> dict[str, float | None]:
            return latency_summary([ends[tx] - created[tx] for tx in in_window if tx in ends])

        result.decision_latency_ms = summary(tracker.decided_at)
        result.decision_seen_latency_ms = summary(tracker.decision_seen)
        result.completion_latency_ms = summary({tx: at for tx, (at, _) in tracker.done.items()})
        used = self.meter.used
        n = result.completed_in_window
        result.cpu_s = used
        result.cpu_s_per_saga = {
            k: None if v is None or n == 0 else round(v / n, 6) for k, v in used.items()
        }
        result.cpu_cores_used = {
            k: None if v is None else round(v / window_s, 3) for k, v in used.items()
        }

    def _check_stores(self) -> None:
        """Each store moved exactly the money of the committed sagas (no lost or extra step)."""
        if self.result.unfinished:
            return  # steps still in flight: the totals cannot match yet (stores_agree: null)
        totals = store_totals(self.cfg, self.layout)
        tracker = self.tracker
        expected = sum(
            tracker.amount[tx] for tx, (_, state) in tracker.done.items() if state == "committed"
        )
        self.result.store_totals = totals
        self.result.expected_total = expected
        self.result.stores_agree = all(v == expected for v in totals.values())


def run_saga_phase(
    cfg: BenchConfig,
    console: Console,
    name: str,
    *,
    mode: str,
    fail_share: float,
    duration: float,
    services: Mapping[str, int | None],
    seed: int,
    layout: Layout = DEFAULT_LAYOUT,
    tag: str | None = None,
    signed: bool = False,
    isolation: str = "read_committed",
    hot: int | None = None,
) -> tuple[SagaPhaseResult, list[tuple[bytes | None, bytes | None]]]:
    """One saga phase on ``layout`` (``signed``: with a key folder; ``isolation``: the
    sagas' level; ``hot``: every step on one of that many records); returns its figures
    and a sample of the records it wrote. ``tag`` (default: ``name``) names its topics
    (``<prefix>.<tag>.*``), log folder and profile folder."""
    result = SagaPhaseResult(
        name=name,
        mode=mode,
        fail_share=fail_share,
        warmup_s=cfg.warmup,
        duration_s=duration,
        offered_rate=cfg.rate if mode == "open" else None,
        window=cfg.window if mode == "closed" else None,
        layout=layout.name,
        stores=dict(layout.stores),
        isolation=isolation,
        hot_records=hot,
    )
    phase = SagaPhase(cfg, console, result, services, seed, layout=layout, tag=tag, signed=signed)
    sample = phase.run()
    return result, sample


def _create_keys(folder: Path) -> Keyring:
    """Every principal's keys in ``folder`` (as ``saga keys create`` makes them); the
    bench's client keyring."""
    for principal in (
        COORDINATOR,
        CLIENT_PRINCIPAL,
        OPERATOR,
        *(participant_principal(p) for p in PARTICIPANTS),
    ):
        create_key(folder, principal)
    return Keyring.load(folder, CLIENT_PRINCIPAL)


def _end_offsets(settings: KafkaSettings, partitions: int) -> dict[str, int]:
    """Records per topic: end minus start offsets (transaction markers take offsets too)."""
    consumer = Consumer(settings, group_id=None, client_id="saga.bench.offsets")
    try:
        counts: dict[str, int] = {}
        # The registry holds heartbeats, which follow the run's length, not its sagas.
        for topic in (t for t in settings.topics.all if t != settings.topics.participants):
            total = 0
            for p in range(partitions):
                low, high = consumer.watermarks(topic, p)
                total += high - low
            counts[topic.rsplit(".", 1)[1]] = total
        return counts
    finally:
        consumer.close()


def _sample_records(
    settings: KafkaSettings, partitions: int, counts: Mapping[str, int], per_topic: int = 2000
) -> tuple[list[tuple[bytes | None, bytes | None]], dict[str, float]]:
    """Records like the phase's, and the share of each topic's offsets that are records.

    Reads up to ``per_topic`` records from the start of each saga topic and mixes
    them in the proportions the phase wrote. Transaction markers take offsets but
    are no records; the share of offsets that hold records, per topic, is measured
    over the offsets the sample spans.
    """
    shorts = [s for s in ("requests", "events", "decisions", "status") if counts.get(s)]
    topic_of = {f"{settings.prefix}.{s}": s for s in shorts}
    got: dict[str, list[tuple[bytes | None, bytes | None]]] = {s: [] for s in shorts}
    spans: dict[tuple[str, int], list[int]] = {}  # [first offset, last offset, records]
    consumer = Consumer(settings, group_id=None, client_id="saga.bench.sample")
    try:
        ends = {(t, p): consumer.watermarks(t, p)[1] for t in topic_of for p in range(partitions)}
        consumer.assign([(t, p, 0) for t, p in ends])  # one assignment: one metadata wait
        todo = set(ends)
        deadline = time.monotonic() + 30
        while todo and time.monotonic() < deadline:
            for m in consumer.poll_batch(5000, 0.2):
                short = topic_of[m.topic]
                if len(got[short]) < per_topic:
                    got[short].append((m.key, m.value))
                span = spans.setdefault(m.partition_key, [m.offset, m.offset, 0])
                span[1], span[2] = m.offset, span[2] + 1
            for tp, pos in consumer.position(list(todo)).items():
                if (pos or 0) >= ends[tp] or len(got[topic_of[tp[0]]]) >= per_topic:
                    todo.discard(tp)
            consumer.pause([tp for tp in ends if tp not in todo])
    finally:
        consumer.close()
    record_share: dict[str, float] = {}
    mixed: list[tuple[bytes | None, bytes | None]] = []
    total = sum(counts.values()) or 1
    for topic, short in topic_of.items():
        mine = [s for (t, _), s in spans.items() if t == topic]
        covered = sum(last - first + 1 for first, last, _ in mine)
        record_share[short] = sum(n for *_, n in mine) / covered if covered else 1.0
        sample = got[short]
        if sample:
            share = max(1, round(10_000 * counts[short] / total))
            mixed.extend(sample[i % len(sample)] for i in range(share))
    random.Random(1).shuffle(mixed)
    return mixed, record_share
