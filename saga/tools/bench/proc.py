"""CPU accounting from ``/proc``: seconds per process (and its children), and service pids.

Linux only: elsewhere every figure reads n/a (``None``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from saga.tools.bench.config import SERVICES, BenchConfig

_PID_FILE: Final = {
    "kafka": "kafka",
    "postgres": "postgres",
    "redis": "redis",
    "ferretdb": "mongo",
    "mariadb": "mariadb",
}
_CLK_TCK: Final = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # fields from 3 (state) on


def _children(pid: int) -> list[int]:
    """The live children of ``pid`` (from /proc/<pid>/task/*/children, else a scan of /proc)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    listed = False
    for task in tasks:
        try:
            found.extend(int(c) for c in (task / "children").read_text().split())
            listed = True
        except (OSError, ValueError):
            continue
    if listed:
        return found
    for entry in Path("/proc").iterdir():  # kernels without CONFIG_PROC_CHILDREN
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[1] == str(pid):
                found.append(int(entry.name))
    return found


def process_cpu_s(pid: int, *, tree: bool = True) -> float | None:
    """utime + stime of ``pid`` in seconds; with ``tree``, also its live and reaped descendants."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    ticks = int(fields[11]) + int(fields[12])
    if tree:
        ticks += int(fields[13]) + int(fields[14])  # reaped children
        for child in _children(pid):
            ticks += round((process_cpu_s(child, tree=True) or 0.0) * _CLK_TCK)
    return ticks / _CLK_TCK


def _port_of(url: str, default: int) -> int:
    if "://" not in url:
        url = "kafka://" + url.split(",", maxsplit=1)[0]
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1].split(",")[0]
    if ":" in netloc:
        with suppress(ValueError):
            return int(netloc.rsplit(":", 1)[1])
    return default


def _listens_on(pid: int, port: int) -> bool | None:
    """Whether ``pid`` holds a listening TCP socket on ``port`` (``None``: cannot tell)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    for fd in fds:
        with suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
    return False


def infra_dir() -> Path:
    configured = Path(os.environ.get("SAGA_INFRA_DIR", ".infra"))
    if configured.is_absolute() or (Path.cwd() / configured).exists():
        return configured
    return Path(__file__).resolve().parents[2] / configured


def service_pids(cfg: BenchConfig) -> dict[str, int | None]:
    """The pids of the local services infra/services.sh started and that serve cfg's addresses."""
    ports = {
        "kafka": _port_of(cfg.kafka.bootstrap, 9092),
        "postgres": _port_of(cfg.postgres_url, 5432),
        "redis": _port_of(cfg.redis_url, 6379),
        "ferretdb": _port_of(cfg.mongo_url, 27017),
        "mariadb": _port_of(cfg.mariadb_url, 3306),
    }
    pids: dict[str, int | None] = {}
    for name in SERVICES:
        if name in cfg.service_pids:  # given by the user: trusted if it exists
            given = cfg.service_pids[name]
            pids[name] = given if _stat_fields(given) is not None else None
            continue
        pid: int | None = None
        with suppress(OSError, ValueError):
            text = (infra_dir() / "pids" / f"{_PID_FILE[name]}.pid").read_text().split()
            pid = int(text[0]) if text else None
        if pid is not None and (
            _stat_fields(pid) is None or _listens_on(pid, ports[name]) is False
        ):
            pid = None
        pids[name] = pid
    return pids


@dataclass
class CpuMeter:
    """CPU seconds of named processes between :meth:`start` and :meth:`stop`."""

    pids: dict[str, int | None]
    self_only: frozenset[str] = frozenset()
    _start: dict[str, float | None] = field(default_factory=dict)
    used: dict[str, float | None] = field(default_factory=dict)

    def _read(self) -> dict[str, float | None]:
        return {
            name: None if pid is None else process_cpu_s(pid, tree=name not in self.self_only)
            for name, pid in self.pids.items()
        }

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> None:
        end = self._read()
        self.used = {
            name: None
            if self._start.get(name) is None or end[name] is None
            else round(max(0.0, end[name] - self._start[name]), 3)  # type: ignore[operator]
            for name in self.pids
        }


def settle(
    pids: Mapping[str, int | None],
    *,
    idle_cores: float,
    timeout_s: float,
    interval_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    cpu_s: Callable[[int], float | None] = process_cpu_s,
) -> tuple[float, float | None]:
    """Wait until the CPU of ``pids`` (with their children) is at most ``idle_cores``
    over two ``interval_s`` in a row, or ``timeout_s`` has passed.

    A phase's servers go on working after it (autovacuum, checkpoints, log cleaning,
    deleting the phase's topics); the next phase measured meanwhile measures that work
    too. Returns the seconds waited and the cores used in the last interval (``None``:
    no pid to measure, nothing waited).
    """
    known = [pid for pid in pids.values() if pid is not None]
    if not known or timeout_s <= 0:
        return 0.0, None

    def total() -> float:
        return sum(cpu_s(pid) or 0.0 for pid in known)

    start = clock()
    quiet = 0
    cores = 0.0
    before, at = total(), start
    while quiet < 2 and clock() - start < timeout_s:
        sleep(interval_s)
        now, used = clock(), total()
        cores = (used - before) / max(1e-6, now - at)
        before, at = used, now
        quiet = quiet + 1 if cores <= idle_cores else 0
    return round(clock() - start, 1), round(cores, 3)
