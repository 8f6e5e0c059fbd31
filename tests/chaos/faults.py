"""The fault injectors of the chaos runner.

Process faults work on a :class:`~tests.chaos.cluster.Cluster` slot, holding it
so the supervisor stays off while they kill, pause or replace its process:

* ``participant.after_local_commit`` / ``participant.after_events`` and
  ``coordinator.after_read`` / ``coordinator.before_commit``: the slot's process is
  killed with SIGKILL at a random moment, a process armed with that fault point
  (``SAGA_FAULTS``, :mod:`streams._faults`) takes its place and kills itself there
  after 1-3 passes, then a plain process is started again;
* ``coordinator.sigstop``: a coordinator is stopped (SIGSTOP) past the Kafka
  transaction timeout while a replacement takes over (alternately with the same
  instance id, which fences it at once, or with a new one, so the broker's
  transaction timeout aborts its open transaction), then continued (SIGCONT):
  the zombie must be fenced, and the log must show nothing it decided twice;
* ``participant.sigstop``: a PostgreSQL or Redis worker is stopped past
  ``max.poll.interval.ms`` (its partitions move to the other worker), then continued;
* ``coordinator.gone`` / ``participant.gone``: a coordinator, or a PostgreSQL or Redis
  worker, is killed with SIGKILL and stays away for :data:`GONE_FOR_S` (a process gone
  for good: its partitions must move to the live ones after the session timeout), then
  is started again.

Service faults SIGKILL Kafka, PostgreSQL, Redis or the MongoDB-wire server and
restart it (:mod:`tests.chaos.services`). Record faults (poison, duplicates,
the barrier trio) and the replay faults live in the runner, which owns the load.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.chaos.cluster import COORDINATOR_TXN_TIMEOUT_S, MAX_POLL_INTERVAL_MS, Cluster, Slot
from tests.chaos.services import ServiceControl

FAULT_POINT_TIMEOUT_S = 90.0
ZOMBIE_WAIT_S = 45.0
GONE_FOR_S = 25.0
"""How long a process "gone for good" stays away: longer than its partitions' takeover
(session timeout, the dead coordinator's transaction timeout, restore), so the figure
measures the takeover, not the return."""
GONE_LOAD_S = 3.0
"""The sagas submitted up to this long after the kill are the ones timed (their partitions
may be the dead process's)."""


@dataclass
class FaultRecord:
    kind: str
    target: str
    started_s: float
    recovered_s: float
    note: str = ""


@dataclass
class FaultBook:
    """What was injected: faults by type, kills by component, notes; thread-safe."""

    t0: float
    faults: Counter[str] = field(default_factory=Counter)
    kills: Counter[str] = field(default_factory=Counter)
    records: list[FaultRecord] = field(default_factory=list)
    zombies: list[dict[str, Any]] = field(default_factory=list)
    watchers: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def fault(self, kind: str, n: int = 1) -> None:
        with self.lock:
            self.faults[kind] += n

    def kill(self, component: str, n: int = 1) -> None:
        with self.lock:
            self.kills[component] += n

    def record(self, rec: FaultRecord) -> None:
        with self.lock:
            self.records.append(rec)


def component_of(slot: Slot) -> str:
    return "coordinator" if slot.kind == "coordinator" else f"participant.{slot.kind}"


def kill_slot(cluster: Cluster, book: FaultBook, slot: Slot) -> None:
    """SIGKILL the slot's process at whatever it is doing (the caller holds the slot)."""
    proc = slot.proc
    if proc is not None and proc.alive:
        proc.kill()
        cluster.note_exit(proc, caused=True)
        book.kill(component_of(slot))


def fault_point(
    cluster: Cluster, book: FaultBook, rnd: random.Random, slot: Slot, point: str
) -> FaultRecord:
    """Kill the slot's process, run one armed with ``point``, let it die there, restart plain."""
    started = book.now()
    note = ""
    with cluster.holding(slot):
        kill_slot(cluster, book, slot)
        hits = rnd.randint(1, 3)
        armed = cluster.spawn(slot, faults=f"{point}:{hits}")
        code = armed.wait_exit(FAULT_POINT_TIMEOUT_S)
        if code is None:
            armed.kill()
            note = f"fault point not reached within {FAULT_POINT_TIMEOUT_S:.0f}s; killed instead"
            book.kill(component_of(slot))
        elif code == -signal.SIGKILL:
            book.kill(component_of(slot))
            note = f"killed itself at {point} (pass {hits})"
        else:
            note = f"exited with {code} before reaching {point}: {armed.last_lines(1)}"
        cluster.note_exit(armed, caused=code in (None, -signal.SIGKILL))
        cluster.spawn(slot)
    book.fault(point)
    rec = FaultRecord(point, slot.name, started, book.now(), note)
    book.record(rec)
    return rec


def coordinator_sigstop(
    cluster: Cluster, book: FaultBook, rnd: random.Random, slot: Slot, *, same_id: bool
) -> FaultRecord:
    """SIGSTOP a coordinator past the transaction timeout while a replacement takes over."""
    started = book.now()
    with cluster.holding(slot):
        zombie = slot.proc
        assert zombie is not None
        zombie.signal(signal.SIGSTOP)
        if not same_id:
            slot.instance_id = f"{slot.name}x{slot.generation + 1}"
        cluster.spawn(slot)
        time.sleep(COORDINATOR_TXN_TIMEOUT_S + 4 + rnd.uniform(0, 2))
        zombie.signal(signal.SIGCONT)
        recovered = book.now()
    replacement = "same instance id" if same_id else "new instance id"

    def fate() -> None:
        code = zombie.wait_exit(ZOMBIE_WAIT_S)
        log = zombie.last_lines(2)
        if code is None:
            what = "still running (rejoined its group)" if not same_id else "still running"
            zombie.terminate()
        elif "fenced" in log:
            what = f"fenced: exited with {code}"
        else:
            what = f"exited with {code}: {log[-200:]}"
        cluster.note_exit(zombie, caused=True)
        with book.lock:
            book.zombies.append({"slot": slot.name, "replacement": replacement, "fate": what})

    # The zombie's fate is watched on the side: the next fault need not wait for it.
    cluster.orphans.append(zombie)  # stopped with the others, should it still run then
    watcher = threading.Thread(target=fate, name="zombie", daemon=True)
    watcher.start()
    book.watchers.append(watcher)
    book.fault("coordinator.sigstop")
    rec = FaultRecord("coordinator.sigstop", slot.name, started, recovered, replacement)
    book.record(rec)
    return rec


def participant_sigstop(
    cluster: Cluster, book: FaultBook, rnd: random.Random, slot: Slot
) -> FaultRecord:
    """SIGSTOP a participant worker past max.poll.interval.ms, then SIGCONT it."""
    started = book.now()
    with cluster.holding(slot):
        proc = slot.proc
        assert proc is not None
        proc.signal(signal.SIGSTOP)
        time.sleep(MAX_POLL_INTERVAL_MS / 1000 + 3 + rnd.uniform(0, 2))
        proc.signal(signal.SIGCONT)
    recovered = book.now()
    time.sleep(3)
    note = "running after SIGCONT" if proc.alive else f"exited after SIGCONT: {proc.last_lines(1)}"
    book.fault("participant.sigstop")
    rec = FaultRecord("participant.sigstop", slot.name, started, recovered, note)
    book.record(rec)
    return rec


def gone_for_good(
    cluster: Cluster,
    book: FaultBook,
    slot: Slot,
    kind: str,
    measure: Callable[[float], None],
) -> FaultRecord:
    """SIGKILL the slot's process and keep it away for :data:`GONE_FOR_S`, then restart it.

    ``measure(killed_at)`` is called :data:`GONE_LOAD_S` after the kill, with the kill's
    ``time.monotonic()``: the caller times the sagas submitted until then from the kill.
    """
    started = book.now()
    with cluster.holding(slot):
        killed_at = time.monotonic()
        kill_slot(cluster, book, slot)
        time.sleep(GONE_LOAD_S)
        measure(killed_at)
        time.sleep(GONE_FOR_S - GONE_LOAD_S)
        cluster.spawn(slot)
    book.fault(kind)
    rec = FaultRecord(kind, slot.name, started, book.now(), f"away for {GONE_FOR_S:.0f}s")
    book.record(rec)
    return rec


def kill_service(
    control: ServiceControl, book: FaultBook, rnd: random.Random, name: str
) -> FaultRecord:
    """SIGKILL a service, wait a moment, restart it and wait until it answers."""
    started = book.now()
    control.kill(name)
    book.kill(name)
    time.sleep(rnd.uniform(0.5, 3.0))
    control.restart()
    book.fault(f"kill.{name}")
    rec = FaultRecord(f"kill.{name}", name, started, book.now())
    book.record(rec)
    return rec
