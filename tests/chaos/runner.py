"""The chaos runner: a profile of faults over the transfer workload, judged and reported.

Why this module is over 600 lines: the run's phases, its judgement and its report
read as one sequence (baseline, faults, quiesce, verdict); the pieces it drives
(workload, faults, checker, log) are modules of their own.

A run has four parts:

1. **baseline** — a coordinator pair and the participants (two PostgreSQL and two
   Redis workers, one Mongo worker) take a paced load without faults: the
   throughput without faults;
2. **rounds** — the same load while faults are injected one after another (every
   process and service fault of :mod:`tests.chaos.faults`), with the record
   faults (the barrier trio per storage, duplicated requests, decisions and
   compensations, poison records on every input topic) and, in some rounds,
   ``saga reconcile --replay`` twice at once, one of them killed with SIGKILL
   half-way through its replay; after each fault the clock runs until every saga
   submitted before it is final (time to quiesce), and the next fault waits for
   that (at most :data:`SETTLE_S`), so each figure is one fault's;
3. **judgement** — once every saga is final and every consumer group has read its
   inputs (or the recovery window has passed), the processes stop and the
   checker (:mod:`tests.chaos.checker`) reads the log, the stores and the
   ledgers; ``saga reconcile`` audits the same log and ledgers, and must agree;
4. **negative controls** — two small systems whose participants run with an
   unsafe test switch (``barrier-off``; ``auto-commit`` with kills right after
   the local commit): the checker must find violations in each.

Signed records are on by default (``CHAOS_SIGNING=off`` turns them off): each
system gets a key folder of its own, its processes ``SAGA_KEYS_DIR``, the run's
sender and readers the ``client`` key, ``saga reconcile`` the folder too; the
hostile profile adds forged records (:func:`tests.chaos.poison.forged`) to its
poison, which the checker expects in the DLQ, without effect.

The report (a table on the terminal and JSON) has the counts, their sum as
``violations``, ``negative_controls_detected``, faults by type, kills by
component, quiesce times, throughput with and without faults, and the seed.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tests._infra import ROOT, Services
from tests.chaos import faults as F
from tests.chaos.checker import COUNTS, Verdict
from tests.chaos.cluster import Slot
from tests.chaos.services import ServiceControl
from tests.chaos.system import System
from tests.chaos.workload import PARTICIPANTS, STORES, Transfer, plan

DEFAULT_REPORT = ROOT / "reports" / "chaos.json"
REPLAY_KILL_AFTER = 3  # replayed records before the SIGKILL
SETTLE_S = 60.0
"""The longest the next fault waits for the previous fault's sagas to be final."""


@dataclass(frozen=True)
class Profile:
    name: str
    baseline_sagas: int
    rounds: int
    round_sagas: int  # at least this many per round (the load goes on while faults run)
    round_max: int  # at most this many per round
    rate: float  # sagas submitted per second
    replay_every: int  # two replays at once in rounds 0, n, 2n, ... (one killed in every round)
    recovery_window_s: float
    nc_sagas: int
    min_sagas: int = 0
    min_kills: int = 1
    partitions: int = 4
    duplicate_share: float = 0.03
    faults: bool = True  # False: no faults, replays nor negative controls (hostile input only)
    poison_batches: int = 3  # per round, one record of every poison kind each
    poison_gap_s: tuple[float, float] = (3.0, 15.0)
    min_poison: int = 0
    forged: bool = False  # forged records join the poison (signed runs only)
    replication_factor: int = 1  # of the systems' topics (3 on the three-broker cluster)
    replays: bool = True  # False: no ``saga reconcile --replay`` during the rounds


def signing_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Signed records, unless ``CHAOS_SIGNING`` is ``off`` (or ``0``, ``no``, ``false``)."""
    return environ.get("CHAOS_SIGNING", "on").strip().lower() not in ("off", "0", "no", "false")


PROFILES = {
    "short": Profile(
        "short",
        baseline_sagas=120,
        rounds=1,
        round_sagas=300,
        round_max=3000,
        rate=8,
        replay_every=1,
        recovery_window_s=240,
        nc_sagas=80,
    ),
    "long": Profile(
        "long",
        baseline_sagas=1000,
        rounds=20,
        round_sagas=950,
        round_max=3000,
        rate=10,
        replay_every=4,
        recovery_window_s=300,
        nc_sagas=80,
        min_sagas=20_000,
        min_kills=20,
    ),
    # Hostile input, no faults: every kind of poison, many times, mixed into valid sagas.
    "hostile": Profile(
        "hostile",
        baseline_sagas=50,
        rounds=1,
        round_sagas=1000,
        round_max=1100,
        rate=25,
        replay_every=1,
        recovery_window_s=240,
        nc_sagas=0,
        min_sagas=1000,
        faults=False,
        poison_batches=36,
        poison_gap_s=(0.3, 1.2),
        min_poison=1000,
        forged=True,
    ),
}

COMPONENTS = (
    "coordinator",
    "participant.sql",
    "participant.mongo",
    "participant.redis",
    "kafka",
    "postgres",
    "redis",
    "mongo",
    "reconcile",
)
"""The components the long profile must kill at least ``min_kills`` times each."""

FAULT_TYPES = (
    "participant.after_local_commit",
    "participant.after_events",
    "coordinator.after_read",
    "coordinator.before_commit",
    "coordinator.sigstop",
    "participant.sigstop",
    "coordinator.gone",
    "participant.gone",
    *(f"barrier.{what}.{store}" for what in ("null_compensation", "hanging") for store in STORES),
    *(
        f"barrier.{what}.{store}"
        for what in ("duplicate_request", "duplicate_decision", "duplicate_compensation")
        for store in STORES
    ),
    "kill.kafka",
    "kill.postgres",
    "kill.redis",
    "kill.mongo",
    "reconcile.replay.killed",
    "reconcile.replay.concurrent",
    "poison.requests",
    "poison.events",
    "poison.decisions",
)
"""Every fault type; each profile injects each at least once."""


def _follow(proc: subprocess.Popen[str], sink: list[str]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        sink.append(line.rstrip())


def _timed(label: str, seconds: float | None) -> dict[str, Any]:
    return {"fault": label, "s": None if seconds is None else round(seconds, 2)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


class Runner:
    def __init__(
        self,
        services: Services,
        profile: Profile,
        *,
        seed: int,
        workdir: Path,
        say: Callable[[str], None],
        keep: bool = False,
    ) -> None:
        self.services = services
        self.profile = profile
        self.seed = seed
        self.workdir = workdir
        self.say = say
        self.keep = keep
        self.rnd = random.Random(seed)
        self.book = F.FaultBook(time.monotonic())
        self.control = ServiceControl(services)
        self.replays: list[dict[str, Any]] = []
        self.nc_systems: list[System] = []
        self.signing = signing_on()

    def log(self, text: str) -> None:
        self.say(f"[{self.book.now():7.1f}s] {text}")

    # ------------------------------------------------------------ the main system

    def run(self) -> dict[str, Any]:
        p = self.profile
        self.control.check_all()
        self.workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        main = System(
            self.services,
            label="main",
            workdir=self.workdir,
            seed=self.seed,
            stores=STORES,
            partitions=p.partitions,
            book=self.book,
            signing=self.signing,
            forged=p.forged,
            replication_factor=p.replication_factor,
        )
        self.log(
            "signed records: "
            + (f"on (keys in {main.keys_dir})" if main.keys_dir else "off (CHAOS_SIGNING)")
        )
        warm = plan(10, seed=self.seed, tag="warm", start=0, reject_share=0)
        baseline = plan(p.baseline_sagas, seed=self.seed, tag="base", start=0)
        rounds = [
            plan(p.round_max, seed=self.seed, tag=f"r{r:02d}", start=0) for r in range(p.rounds)
        ]
        trios = [self._trio_transfers(r) for r in range(p.rounds)]
        everything = (
            warm + baseline + [t for rt in rounds for t in rt] + [t for tt in trios for t in tt]
        )
        self.log(f"main system {main.prefix}: seeding {len(everything)} transfers' accounts")
        main.create(everything)
        verdicts: dict[str, Verdict] = {}
        reports: dict[str, Any] = {}
        negative: dict[str, Any] = {}
        try:
            main.start()
            self.log("processes started; warming up")
            for t in warm:
                main.submit(t)
            main.wait_quiet([t.tx_id for t in warm], 180)

            self.log(f"baseline: {len(baseline)} sagas at {p.rate}/s, no faults")
            t0 = time.monotonic()
            self._pace(main, baseline, p.rate, stop=None, minimum=len(baseline))
            main.wait_quiet([t.tx_id for t in baseline], p.recovery_window_s)
            finals = main.status.finals()
            base_end = max((finals.get(t.tx_id, time.monotonic()) for t in baseline), default=t0)
            baseline_tp = len(baseline) / max(0.001, base_end - t0)

            main.dup_decision_share = p.duplicate_share
            f0 = time.monotonic()
            fault_sagas = 0
            for r in range(p.rounds):
                fault_sagas += self._round(main, r, rounds[r], trios[r])
            self.log("last round done; waiting for every saga to finish")
            for watcher in self.book.watchers:
                watcher.join(120)
            waited = main.wait_quiet(main.submitted_ids(), p.recovery_window_s)
            # Repeated decisions leave no trace in the offsets (the participants' decisions
            # offsets trail by a minute): give the last ones a moment to be read.
            time.sleep(5)
            finals = main.status.finals()
            fault_ids = [tx for tx in main.submitted_ids() if not tx.startswith(("warm", "base"))]
            f_end = max((finals[tx] for tx in fault_ids if tx in finals), default=time.monotonic())
            fault_tp = fault_sagas / max(0.001, f_end - f0)
            self.log(
                "quiescent" if waited is not None else "NOT quiescent after the recovery window"
            )
            main.stop()
            self.log("checking the main system")
            verdicts["main"] = main.check()

            # Spark starts while the negative controls run (it takes a while on 2 cores).
            spark = concurrent.futures.ThreadPoolExecutor(1).submit(self._spark, main)
            negative = self._negative_controls(verdicts) if p.faults else {}
            audits = self._audits(main, verdicts, negative, spark)
            reports = self._report(
                main,
                verdicts,
                audits,
                negative,
                baseline_tp=baseline_tp,
                fault_tp=fault_tp,
                wall_s=time.monotonic() - started,
                quiesced=waited is not None,
            )
        finally:
            main.stop()
            for system in [main, *self.nc_systems]:
                system.stop()
                if self.keep:
                    continue
                try:
                    system.destroy()
                except Exception as exc:  # cleanup must not hide the result
                    self.log(f"cleanup of {system.prefix} failed: {exc}")
        return reports

    def _trio_transfers(self, r: int) -> list[Transfer]:
        """Three transfers whose rollback comes before their request: every store is the
        source of one and the destination of another."""
        out = []
        for i, (src, dst) in enumerate((("sql", "mongo"), ("mongo", "redis"), ("redis", "sql"))):
            base = plan(1, seed=self.seed, tag=f"t{r:02d}{i}", start=0, reject_share=0)[0]
            out.append(
                Transfer(
                    tx_id=f"trio-{r:02d}-{i}",
                    index=base.index,
                    src=src,
                    dst=dst,
                    src_key=f"ts{r}x{i}",
                    dst_key=f"td{r}x{i}",
                    amount=base.amount,
                    kind="ok",
                    mode="sequential" if i == 1 else "parallel",
                )
            )
        return out

    def _pace(
        self,
        system: System,
        transfers: list[Transfer],
        rate: float,
        *,
        stop: threading.Event | None,
        minimum: int,
        duplicate_share: float = 0.0,
    ) -> int:
        """Submit at ``rate`` until ``stop`` is set and ``minimum`` were sent (or all were)."""
        interval = 1.0 / rate
        next_at = time.monotonic()
        sent = 0
        for t in transfers:
            if sent >= minimum and (stop is None or stop.is_set()):
                break
            pause = next_at - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            next_at = max(next_at + interval, time.monotonic() - 1)
            system.submit(t, duplicate_share=duplicate_share)
            sent += 1
        return sent

    # ------------------------------------------------------------ one round of faults

    def _round(self, main: System, r: int, transfers: list[Transfer], trio: list[Transfer]) -> int:
        p = self.profile
        self.log(f"round {r + 1}/{p.rounds}")
        faults_done = threading.Event()
        counted: list[int] = []
        threads = []

        def load() -> None:
            counted.append(
                self._pace(
                    main,
                    transfers,
                    p.rate,
                    stop=faults_done,
                    minimum=p.round_sagas,
                    duplicate_share=p.duplicate_share,
                )
            )

        def trios() -> None:
            time.sleep(self.rnd.uniform(2, 6))
            for t in trio:
                note = main.trio(t)
                self.log(f"barrier trio {t.tx_id} ({t.src} -> {t.dst}): {note}")

        def poisons() -> None:
            for k in range(p.poison_batches):
                time.sleep(self.rnd.uniform(*p.poison_gap_s))
                n = main.inject_poison(f"r{r}p{k}")
                self.log(f"{n} poison records on requests, events and decisions")

        threads = [threading.Thread(target=f, daemon=True) for f in (load, trios, poisons)]
        replay = threading.Thread(
            target=self._replays, args=(main, r), kwargs={"pair": r % p.replay_every == 0},
            daemon=True,
        )  # fmt: skip
        if p.faults and p.replays:
            threads.append(replay)
        for t in threads:
            t.start()

        for spec in self._round_faults(r) if p.faults else []:
            if spec[0] == "kill" and spec[1] == "kafka":
                replay.join(600)  # the replays need the broker; they are done first
            # Each fault strikes once the sagas of the one before are final, so that its
            # time to quiesce is its own, not the sum of two; a fault still recovering
            # after SETTLE_S is struck over (and marked so in the cluster report).
            if main.settle(SETTLE_S) is None:
                self.log(f"the last fault's sagas are not final after {SETTLE_S:.0f}s: next")
            time.sleep(self.rnd.uniform(0.5, 2.0))
            rec = self._inject(main, spec)
            took = rec.recovered_s - rec.started_s
            note = f" ({rec.note})" if rec.note else ""
            self.log(f"{rec.kind} on {rec.target}: recovered after {took:.1f}s{note}")
            main.after_fault(f"{rec.kind} on {rec.target}")
        faults_done.set()
        for t in threads:
            t.join(900)
        ids = [t.tx_id for t in transfers[: counted[0] if counted else 0]]
        if main.wait_quiet([*ids, *(t.tx_id for t in trio)], p.recovery_window_s) is None:
            self.log(f"round {r + 1}: not quiescent within {p.recovery_window_s:.0f}s")
        main.duplicates_after(ids, 0.01)
        return len(ids) + len(trio)

    def _round_faults(self, r: int) -> list[tuple[Any, ...]]:
        points = ("participant.after_local_commit", "participant.after_events")
        specs: list[tuple[Any, ...]] = [
            ("point", store, points[(r + i) % 2]) for i, store in enumerate(STORES)
        ]
        if self.profile.rounds == 1:
            specs += [("point", "coordinator", "coordinator.after_read")]
            specs += [("point", "coordinator", "coordinator.before_commit")]
        else:
            c = ("coordinator.after_read", "coordinator.before_commit")[r % 2]
            specs += [("point", "coordinator", c)]
        specs += [("coordinator.sigstop", r % 2 == 0), ("participant.sigstop",)]
        # A process gone for good: each kind once in the short profile, by turns in the long.
        if self.profile.rounds == 1:
            specs += [("gone", "coordinator"), ("gone", "participant")]
        else:
            specs += [("gone", ("coordinator", "participant")[r % 2])]
        specs += [("kill", "postgres"), ("kill", "redis"), ("kill", "mongo")]
        self.rnd.shuffle(specs)
        # Kafka goes down in the second half: the replay job (which needs it) is done by then.
        at = self.rnd.randint(len(specs) // 2 + 1, len(specs))
        return [*specs[:at], ("kill", "kafka"), *specs[at:]]

    def _pick(self, main: System, kind: str) -> Slot:
        return self.rnd.choice(main.cluster.of_kind(kind))

    def _inject(self, main: System, spec: tuple[Any, ...]) -> F.FaultRecord:
        cluster, book, rnd = main.cluster, self.book, self.rnd
        if spec[0] == "point":
            return F.fault_point(cluster, book, rnd, self._pick(main, spec[1]), spec[2])
        if spec[0] == "coordinator.sigstop":
            return F.coordinator_sigstop(
                cluster, book, rnd, self._pick(main, "coordinator"), same_id=spec[1]
            )
        if spec[0] == "gone":
            if spec[1] == "coordinator":
                slot = self._pick(main, "coordinator")
            else:  # a store with two workers: the other one takes over
                slot = rnd.choice([s for s in cluster.slots.values() if s.kind in ("sql", "redis")])
            kind = f"{spec[1]}.gone"

            def measure(killed_at: float) -> None:
                main.after_fault(f"{kind} on {slot.name}", since=killed_at, gone=True)

            return F.gone_for_good(cluster, book, slot, kind, measure)
        if spec[0] == "participant.sigstop":
            slots = [s for s in cluster.slots.values() if s.kind in ("sql", "redis")]
            return F.participant_sigstop(cluster, book, rnd, rnd.choice(slots))
        return F.kill_service(self.control, book, rnd, spec[1])

    # ------------------------------------------------------------ saga reconcile --replay

    def _replays(self, main: System, r: int, *, pair: bool) -> None:
        """``saga reconcile --replay`` over the running system, killed with SIGKILL once it
        has replayed a few records; with ``pair``, a second one runs at the same time and
        is let finish."""
        time.sleep(self.rnd.uniform(3, 6))
        far = int(time.time() * 1000) + 10 * 86_400_000  # every saga in flight looks stuck
        env = {k: v for k, v in os.environ.items() if k != "SAGA_KEYS_DIR"}
        env.update(
            SAGA_KAFKA_BOOTSTRAP=self.services.kafka_bootstrap,
            SAGA_TOPIC_PREFIX=main.prefix,
            SAGA_SPARK_JARS=str(self.services.spark_jars_dir),
        )
        if main.keys_dir is not None:
            env["SAGA_KEYS_DIR"] = str(main.keys_dir)

        def launch(i: int, attempt: int) -> tuple[subprocess.Popen[str], list[str]]:
            out = main.workdir / f"replay-r{r}-{i}-{attempt}"
            args = [
                sys.executable, "-m", "saga.streams.reconcile", "--replay",
                "--grace", "0s", "--now-ms", str(far), "--out", str(out),
                "--driver-memory", "1g", "--shuffle-partitions", "2", "--master", "local[1]",
            ]  # fmt: skip
            if i == 0:
                args += ["--replay-rate", "5"]  # slow enough to be killed half-way
            proc = subprocess.Popen(
                args,
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            sink: list[str] = []
            threading.Thread(target=_follow, args=(proc, sink), daemon=True).start()
            return proc, sink

        victim, progress = launch(0, 0)
        other = launch(1, 0) if pair else None
        if pair:
            self.book.fault("reconcile.replay.concurrent")
        outcome: dict[str, Any] = {"round": r, "killed": None}
        for attempt in range(3):
            if attempt:
                victim, progress = launch(0, attempt)
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and victim.poll() is None:
                counts = [
                    tuple(int(n) for n in x.rsplit("replayed ", 1)[1].split("/")[:2])
                    for x in list(progress)
                    if "replayed " in x
                ]
                if counts and counts[-1][0] >= min(REPLAY_KILL_AFTER, counts[-1][1]):
                    os.killpg(victim.pid, signal.SIGKILL)
                    victim.wait(30)
                    outcome["killed"] = (
                        f"after replaying {counts[-1][0]} of {counts[-1][1]} record(s)"
                    )
                    self.book.kill("reconcile")
                    self.book.fault("reconcile.replay.killed")
                    break
                time.sleep(0.05)
            if outcome["killed"] is not None:
                break
            if victim.poll() is None:
                os.killpg(victim.pid, signal.SIGKILL)
                victim.wait(30)
            last = progress[-1] if progress else ""
            outcome["killed"] = None
            outcome.setdefault("attempts", []).append(
                f"exited with {victim.returncode} before replaying enough ({last})"
            )
            # Exit 0 without a replayed record: the audit found nothing stuck to replay
            # (a healthy system at 8 sagas/s may have no saga in flight when it reads).
            idle = victim.returncode == 0 and not any("replayed " in x for x in progress)
            outcome["nothing_stuck"] = outcome.get("nothing_stuck", True) and idle
        if outcome["killed"] is None:
            outcome["killed"] = "not killed mid-replay in 3 attempts"
            if outcome.get("nothing_stuck"):
                outcome["killed"] += ": each found nothing stuck to replay"
        if other is not None:
            try:
                other[0].wait(600)
            except subprocess.TimeoutExpired:
                os.killpg(other[0].pid, signal.SIGKILL)
                other[0].wait(30)
            # Exit 1: it found stuck sagas (every saga in flight looks stuck to it); 2: failed.
            outcome["concurrent_exit"] = other[0].returncode
            outcome["concurrent_last"] = other[1][-1] if other[1] else ""
        self.replays.append(outcome)
        self.log(
            f"saga reconcile --replay: {outcome['killed']}"
            + (f"; the concurrent one exited {outcome['concurrent_exit']}" if pair else "")
        )

    # ------------------------------------------------------------ negative controls

    def _negative_controls(self, verdicts: dict[str, Verdict]) -> dict[str, Any]:
        """Two small systems with an unsafe switch each; the checker must catch both."""
        results: dict[str, Any] = {}
        threads = []
        for switch in ("barrier-off", "auto-commit"):
            t = threading.Thread(
                target=self._negative, args=(switch, verdicts, results), daemon=True
            )
            threads.append(t)
            t.start()
        for t in threads:
            t.join(900)
        return results

    def _negative(self, switch: str, verdicts: dict[str, Verdict], results: dict[str, Any]) -> None:
        p = self.profile
        stores = ("sql", "redis")
        book = F.FaultBook(self.book.t0)
        system = System(
            self.services,
            label=f"nc-{switch}",
            workdir=self.workdir,
            seed=self.seed,
            stores=stores,
            partitions=2,
            book=book,
            coordinators=1,
            workers={"sql": 1, "redis": 1},
            unsafe=switch,
            signing=self.signing,
            replication_factor=p.replication_factor,
        )
        transfers = plan(p.nc_sagas, seed=self.seed, tag=f"nc{switch[:2]}", stores=stores)
        trio = [
            Transfer(f"nctrio-{i}", 10_000 + i, src, dst, f"ts{i}", f"td{i}", 10 + i, "ok",
                     "parallel")
            for i, (src, dst) in enumerate((("sql", "redis"), ("redis", "sql")))
        ]  # fmt: skip
        self.nc_systems.append(system)
        system.create(transfers + trio)
        results[switch] = {"prefix": system.prefix}
        try:
            system.start()
            rnd = random.Random(f"{self.seed}:{switch}")
            first = transfers[:10]
            for t in first:
                system.submit(t)
            system.wait_quiet([t.tx_id for t in first], 120)
            if switch == "barrier-off":
                # Idempotency and hanging prevention, with the barrier off.
                for t in first:
                    system.duplicate_request(t.tx_id, "duplicate.request.after_final")
                for t in trio:
                    system.trio(t, timeout=60)
                points = {"sql-0": ["participant.after_events"]}
            else:
                # Kills right after the local commit, twice per participant: each batch
                # lost with its offsets already committed leaves sagas without events.
                point = "participant.after_local_commit"
                points = {"sql-0": [point, point], "redis-0": [point, point]}

            def crash(slot: str, kinds: list[str]) -> None:
                for kind in kinds:
                    F.fault_point(system.cluster, book, rnd, system.cluster.slots[slot], kind)

            crashes = [
                threading.Thread(target=crash, args=(slot, kinds), daemon=True)
                for slot, kinds in points.items()
            ]
            for c in crashes:
                c.start()
            self._pace(system, transfers[10:], 4, stop=None, minimum=len(transfers))
            for c in crashes:
                c.join(300)
            ids = system.submitted_ids()
            system.wait_quiet(ids, 45)
            system.stop()
            verdict = system.check()
            verdicts[switch] = verdict
            results[switch].update(
                detected=verdict.violations > 0,
                violations=verdict.violations,
                counts=verdict.counts,
                examples=verdict.examples,
                faults=dict(book.faults),
                sagas=len(ids),
            )
            self.log(f"negative control {switch}: {verdict.violations} violation(s) found")
        except Exception as exc:
            results[switch].update(detected=False, error=f"{type(exc).__name__}: {exc}")
            self.log(f"negative control {switch} could not run: {exc}")
        finally:
            system.stop()
            results[switch]["_system"] = system

    # ------------------------------------------------------------ the reconciliation job

    def _spark(self, main: System) -> Any:
        from saga.streams.reconcile import ReconcileConfig
        from saga.streams.reconcile._spark import check_jars, start_spark

        config = ReconcileConfig(
            settings=main.settings,
            out=self.workdir / "reconcile-unused",
            master="local[2]",
            driver_memory="1g",
            shuffle_partitions=4,
        )
        return start_spark(config, check_jars(self.services.spark_jars_dir))

    def _audits(
        self,
        main: System,
        verdicts: dict[str, Verdict],
        negative: dict[str, Any],
        starting: concurrent.futures.Future[Any],
    ) -> dict[str, Any]:
        """``saga reconcile`` (no replay) over each system's log and ledgers, in one Spark."""
        from saga.streams.reconcile import (
            ReconcileConfig,
            parse_check,
            parse_ledger,
            parse_table,
            run,
        )

        self.log("saga reconcile over the main system and the negative controls")
        systems = [("main", main)] + [
            (name, res["_system"])
            for name, res in negative.items()
            if isinstance(res.get("_system"), System)
        ]
        audits: dict[str, Any] = {}
        spark = None
        try:
            spark = starting.result(600)
            for name, system in systems:
                s = self.services
                tok = system.token
                ledgers = [
                    f"sql:{s.postgres_url}#schema={tok}&participants={PARTICIPANTS['sql']}",
                    f"redis:{s.redis_url}#prefix={tok}&participants={PARTICIPANTS['redis']}",
                ]
                tables = [
                    f"pg=sql:{s.postgres_url}#schema={tok}&table=accounts",
                    f"rd=redis:{s.redis_url}#prefix={tok}&target=accounts",
                ]
                if "mongo" in system.stores_used:
                    ledgers.append(
                        f"mongo:{s.mongo_url}#database={tok}&participants={PARTICIPANTS['mongo']}"
                    )
                    tables.append(f"mg=mongo:{s.mongo_url}#database={tok}&collection=accounts")
                views = [t.split("=", 1)[0] for t in tables]
                total = sum(sum(a.values()) for a in system.openings.values())
                sums = " + ".join(
                    f"(SELECT coalesce(sum(CAST(balance AS BIGINT)), 0) FROM {v})" for v in views
                )
                union = " UNION ALL ".join(
                    f"SELECT CAST(balance AS BIGINT) AS b FROM {v}" for v in views
                )
                checks = [
                    f"money=SELECT {sums} = {total} AS ok, {sums} AS total",
                    f"non_negative=SELECT count(*) = 0 AS ok FROM ({union}) WHERE b < 0",
                ]
                config = ReconcileConfig(
                    settings=system.settings,
                    out=self.workdir / f"reconcile-{name}",
                    now_ms=int(time.time() * 1000) + 10 * 86_400_000,
                    grace_ms=0,
                    ledgers=tuple(parse_ledger(x) for x in ledgers),
                    tables=tuple(parse_table(x) for x in tables),
                    checks=tuple(parse_check(x) for x in checks),
                    shuffle_partitions=4,
                    keys_dir=system.keys_dir,
                )
                summary: dict[str, Any] = run(config, spark=spark, say=lambda _: None).summary
                checker_clean = verdicts[name].violations == 0 if name in verdicts else None
                clean = summary["exit_code"] == 0
                audits[name] = {
                    "exit_code": summary["exit_code"],
                    "verdict": summary["verdict"],
                    "classes": summary["classes"],
                    "invariants": summary["invariants"],
                    "checks": {c["name"]: c["holds"] for c in summary["checks"]},
                    "dlq": summary["dlq"],
                    "signatures": summary.get("signatures"),
                    "agrees": checker_clean == clean,
                }
                self.log(f"reconcile {name}: {summary['verdict']} (exit {summary['exit_code']})")
        except Exception as exc:
            self.log(f"saga reconcile could not run: {type(exc).__name__}: {exc}")
            for name, _ in systems:
                audits.setdefault(name, {"error": f"{type(exc).__name__}: {exc}", "agrees": False})
        finally:
            if spark is not None:
                spark.stop()
        return audits

    # ------------------------------------------------------------ the report

    def _report(
        self,
        main: System,
        verdicts: dict[str, Verdict],
        audits: dict[str, Any],
        negative: dict[str, Any],
        *,
        baseline_tp: float,
        fault_tp: float,
        wall_s: float,
        quiesced: bool,
    ) -> dict[str, Any]:
        p = self.profile
        v = verdicts["main"]
        counts = dict(v.counts)
        counts["reconcile_disagrees"] = 0 if audits.get("main", {}).get("agrees") else 1
        faults = Counter(self.book.faults)
        faults.update(main.records.counts)
        restarts = [q for q in main.quiesce if not q.gone]
        gone = [q for q in main.quiesce if q.gone]
        quiesce = [q.seconds for q in restarts if q.seconds is not None]
        never = sum(1 for q in restarts if q.seconds is None)
        quiesce_gone = [q.seconds for q in gone if q.seconds is not None]
        for name, res in negative.items():
            res.pop("_system", None)
            audit = audits.get(name, {})
            res["reconcile"] = audit
            res["detected"] = bool(res.get("detected"))
        # A replay that found nothing stuck to replay could not be killed mid-way: it counts
        # as the audit's kill (the report says so under "replays").
        idle_replays = sum(1 for r in self.replays if r.get("nothing_stuck"))
        missing_types = [
            f
            for f in FAULT_TYPES
            if p.faults
            and not faults.get(f)
            and not (f == "reconcile.replay.killed" and idle_replays)
        ]
        kills = {c: self.book.kills.get(c, 0) for c in COMPONENTS}
        kills["reconcile"] += idle_replays

        sagas = len(main.submitted_ids())
        report: dict[str, Any] = {
            "profile": p.name,
            "seed": self.seed,
            "signing": main.keys_dir is not None,
            "prefix": main.prefix,
            "wall_s": round(wall_s, 1),
            "sagas": {
                "submitted": sagas,
                "outcomes_in_log": v.outcomes,
                "as_the_client_saw_them": v.history,
                "designed_to_fail": sum(
                    1 for s in main.submissions.values() if s.transfer.kind != "ok"
                ),
                "barrier_trio": len(main.trio_ids),
            },
            "faults": dict(sorted(faults.items())),
            "kills": kills,
            "counts": counts,
            "violations": sum(counts.values()),
            "negative_controls": negative,
            "negative_controls_detected": bool(negative)
            and all(r.get("detected") for r in negative.values()),
            "quiesce_after_fault_s": {
                "p50": percentile(quiesce, 0.50),
                "p99": percentile(quiesce, 0.99),
                "max": max(quiesce, default=None),
                "faults": len(quiesce),
                "never": never,
                "per_fault": [_timed(q.label, q.seconds) for q in restarts],
            },
            # Timed from the kill of a process that stays away (not from a recovery).
            "quiesce_gone_for_good_s": {
                "p50": percentile(quiesce_gone, 0.50),
                "max": max(quiesce_gone, default=None),
                "faults": len(quiesce_gone),
                "never": sum(1 for q in gone if q.seconds is None),
                "per_fault": [_timed(q.label, q.seconds) for q in gone],
            },
            "throughput_sagas_per_s": {
                "without_faults": round(baseline_tp, 2),
                "with_faults": round(fault_tp, 2),
                "offered": p.rate,
            },
            "quiescent_at_end": quiesced,
            "reconcile": audits.get("main", {}),
            "replays": self.replays,
            "zombies": self.book.zombies,
            "unexpected_exits": main.cluster.unexpected_exits(),
            "money": v.money,
            "poison": {**v.poison, "kinds": len({d.label for d in main.poison})},
            "examples": v.examples,
            "missing_fault_types": missing_types,
            "fault_log": [
                {
                    "kind": r.kind,
                    "target": r.target,
                    "at_s": r.started_s,
                    "recovered_s": r.recovered_s,
                    "note": r.note,
                }
                for r in self.book.records
            ],
            "requirements": {
                "every_fault_type": not missing_types,
                "min_sagas": sagas >= p.min_sagas,
                "min_kills": not p.faults or all(kills[c] >= p.min_kills for c in COMPONENTS),
                "min_poison": v.poison.get("sent", 0) >= p.min_poison
                and (not p.min_poison or len({d.label for d in main.poison}) >= 20),
                "no_unexpected_exits": p.faults or not main.cluster.unexpected_exits(),
            },
        }
        report["passed"] = (
            report["violations"] == 0
            and (report["negative_controls_detected"] or not p.faults)
            and all(report["requirements"].values())
        )
        return report


def render(console: Console, report: dict[str, Any], path: Path) -> None:
    """The report as tables on the terminal."""
    table = Table(title=f"chaos — profile {report['profile']}, seed {report['seed']}",
                  title_justify="left")  # fmt: skip
    table.add_column("what")
    table.add_column("value", justify="right")
    sagas = report["sagas"]
    table.add_row("signed records", "on" if report.get("signing") else "off")
    table.add_row("sagas submitted", str(sagas["submitted"]))
    table.add_row(
        "  outcomes (log)", ", ".join(f"{k} {v}" for k, v in sagas["outcomes_in_log"].items())
    )
    table.add_row(
        "  as the client saw them",
        ", ".join(f"{k} {v}" for k, v in sagas["as_the_client_saw_them"].items()),
    )
    for name in (*COUNTS, "reconcile_disagrees"):
        n = report["counts"].get(name, 0)
        table.add_row(name, str(n), style="bold red" if n else "")
    table.add_row(
        "violations",
        str(report["violations"]),
        style="bold red" if report["violations"] else "bold green",
    )
    for name, res in report["negative_controls"].items():
        table.add_row(
            f"negative control {name}",
            f"{'detected' if res.get('detected') else 'NOT detected'} "
            f"({res.get('violations', 0)} violation(s))",
            style="" if res.get("detected") else "bold red",
        )
    table.add_row("negative_controls_detected", str(report["negative_controls_detected"]))
    q = report["quiesce_after_fault_s"]
    table.add_row("quiesce after a fault p50 / p99", f"{q['p50']} s / {q['p99']} s")
    g = report.get("quiesce_gone_for_good_s") or {}
    if g.get("faults"):
        table.add_row("quiesce after a process gone for good, max", f"{g['max']:.2f} s")
    tp = report["throughput_sagas_per_s"]
    table.add_row(
        "throughput without / with faults",
        f"{tp['without_faults']} / {tp['with_faults']} sagas/s (offered {tp['offered']}/s)",
    )
    table.add_row("kills", ", ".join(f"{k} {v}" for k, v in report["kills"].items()))
    table.add_row("reconcile (main)", str(report["reconcile"].get("verdict", "not run")))
    table.add_row("wall time", f"{report['wall_s']} s")
    table.add_row(
        "passed", str(report["passed"]), style="bold green" if report["passed"] else "bold red"
    )
    console.print(table)
    faults = Table(title="faults injected", title_justify="left")
    faults.add_column("fault")
    faults.add_column("count", justify="right")
    for kind, n in report["faults"].items():
        faults.add_row(kind, str(n))
    console.print(faults)
    if report["unexpected_exits"]:
        console.print(f"{len(report['unexpected_exits'])} unexpected process exit(s); see the JSON")
    console.print(f"report: {path}")


def run_profile(
    services: Services,
    profile: Profile,
    *,
    seed: int | None = None,
    report_path: Path = DEFAULT_REPORT,
    workdir: Path | None = None,
    keep: bool = False,
    console: Console | None = None,
    runner_class: type[Runner] = Runner,
) -> dict[str, Any]:
    """Run ``profile`` end to end (with ``runner_class``, e.g. the cluster profile's
    :class:`tests.chaos.cluster_profile.ClusterRunner`); write the JSON report and print
    the tables."""
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=120)
    # The run's own Kafka clients see every broker kill; their complaints are expected.
    logging.getLogger("saga.kafka").setLevel(logging.CRITICAL)
    seed = seed if seed is not None else random.SystemRandom().randrange(1, 2**31)
    workdir = workdir or (ROOT / "reports" / "chaos-runs" / f"{profile.name}-{seed}")

    def say(line: str) -> None:
        console.print(line, soft_wrap=True, highlight=False)

    runner = runner_class(services, profile, seed=seed, workdir=workdir, say=say, keep=keep)
    report = runner.run()
    report["workdir"] = str(workdir)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    render(console, report, report_path)
    return report
