"""The isolation tier of the crash suite: contention, a concurrent reader, kills, a verdict.

One run has two systems, each with its own topics, stores and processes
(:class:`~tests.chaos.system.System`):

1. **main** (``read_committed``, the default level): two coordinators and five
   participant workers take the workload of :mod:`tests.chaos.iso_workload` at
   ``rate`` sagas/s while :class:`~tests.chaos.iso_sampler.Sampler` reads every hot
   record of the three stores, and the fault machinery of :mod:`tests.chaos.faults`
   kills a coordinator and each store's participant (SIGKILL, a process armed to die
   at a fault point, a restart) one after the other. The load goes on until every
   fault is done and at least ``sagas`` were sent; then every saga must finish,
   the processes stop, and :mod:`tests.chaos.iso_checker` judges the log, the
   samples, the final values and the ledgers: every count must be 0.
2. **negative control** (``none``): the same workload (``nc_sagas``, no faults) with
   every saga at level ``none``. Its participants write at apply, so the reader sees
   uncommitted values: the checker must report dirty reads, or it proves nothing.

The report (``reports/chaos-isolation.json`` and a table) has each system's counts,
outcomes, rollback causes, samples and kills, and the requirements of issue 28's
must-hold 2 (at least ``min_sagas`` sagas, at most 20 hot records per store, at
least 30 % rolled back, kills of a coordinator and of participants, the negative
control caught).
"""

from __future__ import annotations

import heapq
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from saga.streams import Isolation, Mode, SagaAbort, SagaRequest, encode
from tests._infra import ROOT, Services
from tests.chaos import faults as F
from tests.chaos import iso_sampler
from tests.chaos.iso_checker import COUNTS, IsoInput, IsoVerdict, check, summary
from tests.chaos.iso_sampler import Sampler
from tests.chaos.iso_workload import (
    HOT_RECORDS_PER_STORE,
    TARGETS,
    IsoSaga,
    Planner,
    opening_accounts,
    opening_slots,
)
from tests.chaos.log import read_log
from tests.chaos.runner import signing_on
from tests.chaos.system import SAGA_TIMEOUT_S, System
from tests.chaos.workload import STORES

DEFAULT_REPORT = ROOT / "reports" / "chaos-isolation.json"


@dataclass(frozen=True)
class IsoProfile:
    name: str
    sagas: int  # at least this many in the main system (more while faults still run)
    rate: float  # sagas submitted per second, at most
    max_in_flight: int  # sagas submitted and not final, at most
    nc_sagas: int
    faults: tuple[tuple[str, str], ...]  # (slot kind, fault point), in this order
    min_sagas: int = 2000
    min_rollback_share: float = 0.30
    recovery_window_s: float = 240.0
    nc_recovery_window_s: float = 30.0
    """The negative control may leave sagas stuck (a refused compensation in a sequential
    saga): it waits less for them."""
    partitions: int = 4
    fault_gap_s: tuple[float, float] = (2.0, 5.0)


_FAULTS = (
    ("sql", "participant.after_local_commit"),
    ("coordinator", "coordinator.before_commit"),
    ("mongo", "participant.after_events"),
    ("redis", "participant.after_local_commit"),
    ("coordinator", "coordinator.after_read"),
)
ISO_PROFILES = {
    "short": IsoProfile(
        "short", sagas=2100, rate=30, max_in_flight=40, nc_sagas=600, faults=_FAULTS
    ),
    "long": IsoProfile(
        "long",
        sagas=12_000,
        rate=30,
        max_in_flight=40,
        nc_sagas=1500,
        faults=_FAULTS * 4,
        min_sagas=10_000,
    ),
}


class IsoSystem(System):
    """A :class:`System` whose load is the isolation workload at one level."""

    def __init__(self, services: Services, *, isolation: Isolation, **kw: Any) -> None:
        super().__init__(services, stores=STORES, targets=TARGETS, **kw)
        self.isolation = isolation
        self.sagas: dict[str, IsoSaga] = {}
        self.acked: dict[str, bool | None] = {}
        self.acked_at: dict[str, tuple[int, int]] = {}
        self.aborts = 0

    def create_iso(self) -> None:
        iso_sampler.create(self.services, self.token, self.stores_used)
        from saga.streams.kafka import create_topics

        create_topics(self.settings, self.partitions, self.replication_factor)

    def submit_saga(self, s: IsoSaga) -> None:
        now = int(time.time() * 1000)
        request = SagaRequest(
            tx_id=s.tx_id,
            saga=f"iso-{s.kind}",
            mode=Mode(s.mode),
            steps=s.steps,
            deadline_ms=now + SAGA_TIMEOUT_S * 1000,
            created_ms=now,
            meta={"chaos": self.label},
            isolation=self.isolation,
        )
        with self._lock:
            self.sagas[s.tx_id] = s
            self.acked[s.tx_id] = None
            self.order.append(s.tx_id)

        def done(d: Any) -> None:
            self.acked[s.tx_id] = bool(d.acked)
            if d.acked:
                self.acked_at[s.tx_id] = (d.partition, d.offset)

        self.sender.send(self.topics.requests, s.tx_id, encode(request), label="request",
                         on_done=done)  # fmt: skip

    def abort(self, tx_id: str) -> None:
        record = SagaAbort(tx_id, "chaos isolation: aborted", int(time.time() * 1000))
        self.sender.send(self.topics.requests, tx_id, encode(record), label="abort")
        self.aborts += 1

    def judge(self, samples: dict[Any, Any]) -> IsoVerdict:
        """Read the log, the final values and the ledgers (the processes are stopped)."""
        log = read_log(self.settings, self.keys)
        with self._lock:
            sagas = [self.sagas[tx] for tx in self.order]
            acked = dict(self.acked)
            late = set(self.late)
        return check(
            IsoInput(
                sagas=sagas,
                acked=acked,
                log=log,
                samples=samples,
                final=iso_sampler.read_all(self.services, self.token, self.stores_used),
                opening_accounts=opening_accounts(self.stores_used),
                opening_slots=opening_slots(self.stores_used),
                ledgers=self.stores.ledgers(),
                late=late,
                acked_at=dict(self.acked_at),
            )
        )


def pace(
    system: IsoSystem,
    planner: Planner,
    rate: float,
    *,
    minimum: int,
    max_in_flight: int,
    until: threading.Event | None = None,
) -> int:
    """Submit at ``rate`` until ``minimum`` were sent and ``until`` is set, never with more
    than ``max_in_flight`` sagas not final (a slow machine sets the pace, not a backlog
    whose holds and reservations would reject nearly everything); each planned abort goes
    out its delay after its request."""
    interval = 1.0 / rate
    next_at = time.monotonic()
    aborts: list[tuple[float, str]] = []
    sent = 0
    while sent < minimum or (until is not None and not until.is_set()):
        now = time.monotonic()
        while aborts and aborts[0][0] <= now:
            system.abort(heapq.heappop(aborts)[1])
        pause = min(next_at, aborts[0][0] if aborts else next_at) - now
        if pause > 0:
            time.sleep(pause)
            continue
        if len(system.order) - system.status.final_count() >= max_in_flight:
            time.sleep(0.02)
            continue
        next_at = max(next_at + interval, now - 1)
        saga = planner.next()
        system.submit_saga(saga)
        if saga.abort_after_s is not None:
            heapq.heappush(aborts, (now + saga.abort_after_s, saga.tx_id))
        sent += 1
    while aborts:
        when, tx = heapq.heappop(aborts)
        time.sleep(max(0.0, when - time.monotonic()))
        system.abort(tx)
    return sent


class IsoRunner:
    def __init__(
        self,
        services: Services,
        profile: IsoProfile,
        *,
        seed: int,
        workdir: Path,
        say: Any,
        keep: bool = False,
    ) -> None:
        self.services = services
        self.profile = profile
        self.seed = seed
        self.workdir = workdir
        self.say = say
        self.keep = keep
        self.rnd = random.Random(f"{seed}:iso")
        self.book = F.FaultBook(time.monotonic())
        self.t0_ms = int(time.time() * 1000)  # the book's clock start, wall clock (samples')
        self.systems: list[IsoSystem] = []

    def log(self, text: str) -> None:
        self.say(f"[{self.book.now():7.1f}s] {text}")

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        results: dict[str, Any] = {}
        try:
            results["main"] = self._system("iso", Isolation.READ_COMMITTED, faults=True)
            results["negative_control"] = self._system("isonone", Isolation.NONE, faults=False)
        finally:
            for system in self.systems:
                system.stop()
                if not self.keep:
                    try:
                        system.destroy()
                    except Exception as exc:  # cleanup must not hide the result
                        self.log(f"cleanup of {system.prefix} failed: {exc}")
        return self._report(results, time.monotonic() - started)

    def _system(self, label: str, isolation: Isolation, *, faults: bool) -> dict[str, Any]:
        p = self.profile
        book = self.book if faults else F.FaultBook(self.book.t0)
        small = {} if faults else {"coordinators": 1, "workers": {"sql": 1, "redis": 1}}
        system = IsoSystem(
            self.services, isolation=isolation, label=label, workdir=self.workdir,
            seed=self.seed, partitions=p.partitions, book=book, signing=signing_on(), **small,
        )  # fmt: skip
        self.systems.append(system)
        system.create_iso()
        system.start()
        sampler = Sampler(self.services, system.token, system.stores_used).start()
        planner = Planner(self.seed, label)
        target = p.sagas if faults else p.nc_sagas
        self.log(f"{label} ({isolation}): {system.prefix}, {target}+ sagas at {p.rate:g}/s")
        t0 = time.monotonic()
        faults_done = threading.Event()
        counted: list[int] = []
        load = threading.Thread(
            target=lambda: counted.append(
                pace(
                    system,
                    planner,
                    p.rate,
                    minimum=target,
                    until=faults_done,
                    max_in_flight=p.max_in_flight,
                )
            ),
            daemon=True,
        )
        load.start()
        if faults:
            self._faults(system)
        faults_done.set()
        load.join()
        load_s = time.monotonic() - t0
        ids = system.submitted_ids()
        waited = system.wait_quiet(ids, p.recovery_window_s if faults else p.nc_recovery_window_s)
        self.log(
            f"{label}: {len(ids)} sagas sent in {load_s:.0f}s; "
            + ("quiescent" if waited is not None else "NOT quiescent after the recovery window")
        )
        time.sleep(1)  # a last sample of the quiet stores
        sampler.stop()
        system.stop()
        verdict = system.judge(sampler.samples)
        self.log(f"{label}: {verdict.violations} violation(s) {_nonzero(verdict.counts)}")
        outcomes = verdict.outcomes
        decided = outcomes.get("commit", 0) + outcomes.get("rollback", 0)
        return {
            "isolation": str(isolation),
            "prefix": system.prefix,
            "sagas": len(ids),
            "load_s": round(load_s, 1),
            "offered_rate": p.rate,
            "aborts_sent": system.aborts,
            "modes": dict(Counter(s.mode for s in system.sagas.values())),
            "kinds": dict(Counter(s.kind for s in system.sagas.values())),
            "rollback_share": round(outcomes.get("rollback", 0) / max(1, decided), 3),
            "quiescent": waited is not None,
            "reads": dict(sampler.reads),
            "read_errors": dict(sampler.errors),
            "samples": sampler.count(),
            "faults": dict(book.faults),
            "kills": dict(book.kills),
            "fault_log": [
                {
                    "kind": r.kind,
                    "target": r.target,
                    "at_s": r.started_s,
                    "note": r.note,
                    "at_ms": self.t0_ms + int(r.started_s * 1000),
                    "recovered_ms": self.t0_ms + int(r.recovered_s * 1000),
                }
                for r in book.records
            ],
            "unexpected_exits": system.cluster.unexpected_exits(),
            **summary(verdict),
        }

    def _faults(self, system: IsoSystem) -> None:
        """Each fault of the profile in turn, while the load runs."""
        time.sleep(self.rnd.uniform(*self.profile.fault_gap_s) + 5)
        for kind, point in self.profile.faults:
            slot = self.rnd.choice(system.cluster.of_kind(kind))
            rec = F.fault_point(system.cluster, self.book, self.rnd, slot, point)
            took = rec.recovered_s - rec.started_s
            self.log(f"{point} on {slot.name}: recovered after {took:.1f}s ({rec.note})")
            time.sleep(self.rnd.uniform(*self.profile.fault_gap_s))

    def _report(self, results: dict[str, Any], wall_s: float) -> dict[str, Any]:
        p = self.profile
        main, nc = results["main"], results["negative_control"]
        kills = main["kills"]
        requirements = {
            "min_sagas": main["sagas"] >= p.min_sagas,
            "hot_records_per_store_at_most_20": HOT_RECORDS_PER_STORE <= 20,
            "min_rollback_share": main["rollback_share"] >= p.min_rollback_share,
            "coordinator_killed": kills.get("coordinator", 0) > 0,
            "participants_killed": all(kills.get(f"participant.{s}", 0) > 0 for s in STORES),
            "every_store_sampled": all(main["reads"].get(s, 0) > 0 for s in STORES),
            "quiescent": main["quiescent"],
        }
        detected = nc["counts"]["dirty_reads"] > 0
        report = {
            "profile": p.name,
            "seed": self.seed,
            "wall_s": round(wall_s, 1),
            "hot_records_per_store": HOT_RECORDS_PER_STORE,
            "counts": main["counts"],
            "violations": main["violations"],
            "negative_control_detected": detected,
            "requirements": requirements,
            "main": main,
            "negative_control": nc,
        }
        report["passed"] = main["violations"] == 0 and detected and all(requirements.values())
        return report


def _nonzero(counts: dict[str, int]) -> str:
    bad = {k: v for k, v in counts.items() if v}
    return f"({', '.join(f'{k} {v}' for k, v in bad.items())})" if bad else ""


def render(console: Console, report: dict[str, Any], path: Path) -> None:
    """Both systems side by side: counts, outcomes, rollback causes, samples, kills."""
    main, nc = report["main"], report["negative_control"]
    table = Table(title=f"chaos isolation tier — profile {report['profile']}, seed "
                  f"{report['seed']}, {report['hot_records_per_store']} hot records per store",
                  title_justify="left")  # fmt: skip
    table.add_column("what")
    table.add_column(f"main ({main['isolation']})", justify="right")
    table.add_column(f"negative control ({nc['isolation']})", justify="right")

    def both(label: str, get: Any) -> None:
        table.add_row(label, str(get(main)), str(get(nc)))

    both("sagas", lambda r: r["sagas"])
    both(
        "  committed / rolled back / none",
        lambda r: " / ".join(str(r["outcomes"].get(k, 0)) for k in ("commit", "rollback", "none")),
    )
    both("  rolled back share", lambda r: f"{r['rollback_share']:.0%}")
    causes = sorted(set(main["rollback_reasons"]) | set(nc["rollback_reasons"]))
    for cause in causes:
        both(f"    {cause}", lambda r, c=cause: r["rollback_reasons"].get(c, 0))
    both("aborts sent", lambda r: r["aborts_sent"])
    both(
        "parallel / sequential",
        lambda r: f"{r['modes'].get('parallel', 0)} / {r['modes'].get('sequential', 0)}",
    )
    both(
        "samples (reads per store)",
        lambda r: f"{r['samples']:,} ({', '.join(f'{k} {v}' for k, v in r['reads'].items())})",
    )
    both("kills", lambda r: ", ".join(f"{k} {v}" for k, v in r["kills"].items()) or "none")
    table.add_section()
    for name in COUNTS:
        m, n = main["counts"][name], nc["counts"][name]
        table.add_row(name, str(m), str(n), style="bold red" if m else "")
    table.add_row("violations", str(main["violations"]), str(nc["violations"]),
                  style="bold red" if main["violations"] else "bold green")  # fmt: skip
    table.add_row(
        "negative control caught (dirty reads)",
        "",
        "yes" if report["negative_control_detected"] else "NO",
        style="" if report["negative_control_detected"] else "bold red",
    )
    for name, ok in report["requirements"].items():
        table.add_row(f"requirement {name}", "ok" if ok else "NO", "",
                      style="" if ok else "bold red")  # fmt: skip
    table.add_row("wall time", f"{report['wall_s']} s", "")
    table.add_row("passed", str(report["passed"]), "",
                  style="bold green" if report["passed"] else "bold red")  # fmt: skip
    console.print(table)
    for label, res in (("main", main), ("negative control", nc)):
        for name, examples in res["examples"].items():
            for e in examples[:3]:
                console.print(f"  {label} {name}: {e}", soft_wrap=True, highlight=False)
    console.print(f"report: {path}")


def run_isolation(
    services: Services,
    profile: IsoProfile,
    *,
    seed: int | None = None,
    report_path: Path = DEFAULT_REPORT,
    keep: bool = False,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the tier; write the JSON report and print the table."""
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=140)
    seed = seed if seed is not None else random.SystemRandom().randrange(1, 2**31)
    workdir = ROOT / "reports" / "chaos-runs" / f"isolation-{profile.name}-{seed}"

    def say(line: str) -> None:
        console.print(line, soft_wrap=True, highlight=False)

    report = IsoRunner(services, profile, seed=seed, workdir=workdir, say=say, keep=keep).run()
    report["workdir"] = str(workdir)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    render(console, report, report_path)
    return report
