"""The saga processes of a chaos run, supervised: coordinators and participant workers.

Each process runs in a *slot* (``c0``, ``c1``, ``sql-0``, ``sql-1``, ``mongo-0``,
``redis-0``, ``redis-1``) as ``python -m coordinator ...`` in its own session, with
its log in the run's folder. A supervisor thread restarts the process of a slot
that exited, unless a fault injector *holds* the slot (it is killing, stopping or
replacing that process and restarts it itself). Exits nobody caused (any exit
other than SIGKILL) are recorded with the last line of the process's log: the
report lists them.

On FerretDB one participant process per Mongo database is the supported layout
(the Mongo adapter serialises writes per document within a process), so the
Mongo participant has one slot; PostgreSQL and Redis get two workers each, so
that kills and pauses move partitions between live workers.

Every slot keeps its instance id across restarts (``--instance-id`` of a coordinator,
``--worker-id`` of a participant worker), as a supervisor such as systemd or a
Kubernetes StatefulSet would: the restarted process is the same static member of its
consumer group and takes back its partitions at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests._infra import ROOT, Services
from tests.chaos.workload import PARTICIPANTS, TARGET

MAX_POLL_INTERVAL_MS = 15_000  # participants: a pause longer than this moves their partitions
COORDINATOR_TXN_TIMEOUT_S = 10  # CoordinatorService's transaction_timeout_ms


@dataclass
class Proc:
    """One saga process and its log file."""

    slot: str
    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    armed: str | None = None  # SAGA_FAULTS it was started with
    popen: subprocess.Popen[bytes] | None = None
    started: float = 0.0

    def start(self) -> Proc:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "tests.launch", *self.args],  # reads SAGA_FAULTS
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started = time.monotonic()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)  # a stopped process dies on SIGKILL anyway
            self.popen.kill()
            self.popen.wait(30)

    def terminate(self, timeout: float = 20) -> None:
        """SIGTERM (the process stops cleanly), then SIGKILL if it lingers."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGCONT)
        self.popen.terminate()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def wait_exit(self, timeout: float) -> int | None:
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def last_lines(self, n: int = 3) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 8192))
                tail = f.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [line for line in tail.splitlines() if line.strip()]
        return " | ".join(lines[-n:])


@dataclass
class Exit:
    """A process exit the supervisor saw: who, how, and whether a fault caused it."""

    slot: str
    name: str
    code: int
    caused: bool
    last: str
    at_s: float


@dataclass
class Slot:
    name: str
    kind: str  # "coordinator" or a store name
    instance_id: str = ""
    proc: Proc | None = None
    held: bool = False
    generation: int = 0
    restart_at: float = 0.0  # after an exit nobody caused: when to start it again
    lock: threading.Lock = field(default_factory=threading.Lock)


class Cluster:
    """The processes of one run; ``layout`` maps slot kinds to how many slots each gets."""

    def __init__(
        self,
        services: Services,
        *,
        prefix: str,
        token: str,
        logs: Path,
        stores: tuple[str, ...],
        coordinators: int = 2,
        workers: Mapping[str, int] | None = None,
        unsafe: str | None = None,
        clock_start: float | None = None,
        keys_dir: Path | None = None,
        targets: tuple[str, ...] = (TARGET,),
    ) -> None:
        self.services = services
        self.targets = targets  # every participant's allow-list (--targets)
        self.keys_dir = keys_dir  # signed records: SAGA_KEYS_DIR of every process
        self.prefix = prefix
        self.token = token
        self.logs = logs
        self.unsafe = unsafe
        self.t0 = clock_start if clock_start is not None else time.monotonic()
        logs.mkdir(parents=True, exist_ok=True)
        wanted = {"sql": 2, "mongo": 1, "redis": 2, **(workers or {})}
        self.slots: dict[str, Slot] = {}
        for i in range(coordinators):
            self.slots[f"c{i}"] = Slot(f"c{i}", "coordinator", instance_id=f"c{i}")
        for store in stores:
            for i in range(wanted[store]):
                self.slots[f"{store}-{i}"] = Slot(f"{store}-{i}", store, instance_id=f"{store}-{i}")
        self.stores = stores
        self.exits: list[Exit] = []
        self.orphans: list[Proc] = []  # zombies and the like, stopped at the end
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exits_lock = threading.Lock()

    # ------------------------------------------------------------ processes

    def env(
        self, faults: str | None, *, participant: bool, store: str | None = None
    ) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
        env.update(
            SAGA_KAFKA_BOOTSTRAP=self.services.kafka_bootstrap,
            SAGA_TOPIC_PREFIX=self.prefix,
        )
        if self.keys_dir is not None:
            env["SAGA_KEYS_DIR"] = str(self.keys_dir)
        if store is not None:  # not on the command line, where ps shows a password
            env["SAGA_STORAGE_URL"] = self._store_url(store)
        if participant:
            env["SAGA_KAFKA_MAX_POLL_INTERVAL_MS"] = str(MAX_POLL_INTERVAL_MS)
            if self.unsafe:
                env["SAGA_UNSAFE_TEST_SWITCHES"] = self.unsafe
        if faults:
            env["SAGA_FAULTS"] = faults
        return env

    def _args(self, slot: Slot) -> list[str]:
        if slot.kind == "coordinator":
            names = ",".join(PARTICIPANTS[s] for s in self.stores)
            return [
                "coordinator",
                "run",
                "--instance-id",
                slot.instance_id,
                "--participants",
                names,
                # The auto-commit control loses participants' inputs on purpose; the
                # coordinator's re-drive of stalled decisions would heal the lost
                # decisions and hide what the checker must find.
                *(["--redrive-after", "off"] if self.unsafe == "auto-commit" else []),
            ]
        return [
            "participant",
            "run",
            "--name",
            PARTICIPANTS[slot.kind],
            "--storage",
            slot.kind,
            "--schema",
            self.token,
            "--targets",
            ",".join(self.targets),
            # As a supervisor (systemd, a StatefulSet) would: the same id on every restart,
            # so the restarted worker takes back its partitions at once.
            "--worker-id",
            slot.instance_id,
        ]

    def _store_url(self, store: str) -> str:
        return {
            "sql": self.services.postgres_url,
            "mongo": self.services.mongo_url,
            "redis": self.services.redis_url,
        }[store]

    def spawn(self, slot: Slot, faults: str | None = None) -> Proc:
        """Start the slot's process (the caller holds the slot or is starting the cluster)."""
        slot.generation += 1
        proc = Proc(
            slot.name,
            f"{slot.name}.{slot.generation}",
            self._args(slot),
            self.env(
                faults,
                participant=slot.kind != "coordinator",
                store=None if slot.kind == "coordinator" else slot.kind,
            ),
            self.logs / f"{slot.name}.log",
            armed=faults,
        ).start()
        slot.proc = proc
        return proc

    def start(self) -> None:
        for slot in self.slots.values():
            self.spawn(slot)
        self._thread = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        procs = [s.proc for s in self.slots.values() if s.proc is not None] + self.orphans
        for p in procs:
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in procs:
            p.wait_exit(max(0.1, deadline - time.monotonic()))
            p.kill()

    def of_kind(self, kind: str) -> list[Slot]:
        return [s for s in self.slots.values() if s.kind == kind]

    @contextmanager
    def holding(self, slot: Slot) -> Iterator[Slot]:
        """Keep the supervisor off ``slot`` while a fault works on its process."""
        with slot.lock:
            slot.held = True
        try:
            yield slot
        finally:
            with slot.lock:
                slot.held = False

    def note_exit(self, proc: Proc, *, caused: bool) -> None:
        code = proc.returncode
        with self._exits_lock:
            self.exits.append(
                Exit(
                    proc.slot,
                    proc.name,
                    code if code is not None else 0,
                    caused,
                    proc.last_lines(2)[-400:],
                    round(time.monotonic() - self.t0, 1),
                )
            )

    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            for slot in self.slots.values():
                with slot.lock:
                    if slot.held or slot.proc is None or slot.proc.alive:
                        continue
                    now = time.monotonic()
                    if not slot.restart_at:
                        self.note_exit(slot.proc, caused=False)
                        # A process that dies at once (a configuration error) is not
                        # restarted in a tight loop.
                        quick = now - slot.proc.started < 10
                        slot.restart_at = now + (5 if quick else 0.5)
                    if now >= slot.restart_at:
                        slot.restart_at = 0.0
                        self.spawn(slot)

    def unexpected_exits(self) -> list[dict[str, Any]]:
        with self._exits_lock:
            return [
                {"slot": e.slot, "process": e.name, "code": e.code, "at_s": e.at_s, "last": e.last}
                for e in self.exits
                if not e.caused
            ]
