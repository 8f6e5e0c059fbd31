"""kill -9 and restart of the local services (Kafka, PostgreSQL, Redis, FerretDB).

The services are the ones ``infra/services.sh`` started: their pids are in
``$SAGA_INFRA_DIR/pids/<name>.pid`` (``.infra`` by default), and a restart is
``infra/services.sh up``, which starts only what is not running. Before killing
anything, the process behind a pid file must be the service at the address the
run uses (its command line names the port), so a stale pid file or another
checkout's services are never touched. PostgreSQL is killed with all its
processes (the postmaster and its backends), as a crash of the machine's
database server would; the others are single processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from tests._infra import ROOT, SERVICES_SH, Services

SERVICE_NAMES = ("kafka", "postgres", "redis", "mongo")


class ServiceControlError(RuntimeError):
    """A service could not be killed or restarted; the message says which and why."""


def infra_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The folder ``infra/services.sh`` keeps its pid files in (as the script computes it)."""
    return (ROOT / environ.get("SAGA_INFRA_DIR", ".infra")).resolve()


def _port(address: str) -> int:
    port = urlsplit(address).port if "://" in address else int(address.rsplit(":", 1)[1])
    if port is None:
        raise ServiceControlError(f"the address {address} names no port")
    return port


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def run_until_ok(argv: list[str], env: Mapping[str, str], attempts: int, failure: str) -> list[str]:
    """Run ``argv`` in the repository's root until it exits 0, at most ``attempts`` times
    with a growing pause between. Returns the last stderr line of each failed attempt;
    when every attempt fails, raises ``ServiceControlError(failure + that line)``."""
    last = ""
    failed: list[str] = []
    for attempt in range(attempts):
        done = subprocess.run(
            argv,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode == 0:
            return failed
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        failed.append(last)
        time.sleep(1 + attempt)
    raise ServiceControlError(f"{failure}{last}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of another process still answers kill 0; its state says it is gone.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


class ServiceControl:
    """Kill -9 and restart the services of ``services`` (which must be the local ones)."""

    def __init__(self, services: Services, environ: Mapping[str, str] = os.environ) -> None:
        self.services = services
        self.environ = dict(environ)
        self.dir = infra_dir(environ)
        self.ports = {
            "kafka": _port(services.kafka_bootstrap),
            "postgres": _port(services.postgres_url),
            "redis": _port(services.redis_url),
            "mongo": _port(services.mongo_url),
        }

    def pid(self, name: str) -> int:
        """The pid of service ``name``, checked to be the service at the run's address."""
        path = self.dir / "pids" / f"{name}.pid"
        try:
            pid = int(path.read_text().strip())
        except (OSError, ValueError):
            raise ServiceControlError(
                f"no pid file for {name} at {path}: the chaos suite kills the services that "
                "`infra/services.sh up` started (set SAGA_INFRA_DIR to their folder)"
            ) from None
        cmdline = _cmdline(pid)
        if not cmdline:
            raise ServiceControlError(f"{name} (pid {pid} from {path}) is not running")
        port = str(self.ports[name])
        if name == "kafka":
            config = next((Path(a) for a in cmdline if a.endswith("server.properties")), None)
            text = config.read_text() if config is not None and config.exists() else ""
            ours = "kafka.Kafka" in cmdline and f":{port}," in text.replace("\n", ",")
        elif name == "postgres":
            ours = "-p" in cmdline and cmdline[cmdline.index("-p") + 1] == port
        else:
            ours = any(a.endswith(f":{port}") for a in cmdline)
        if not ours:
            raise ServiceControlError(
                f"pid {pid} in {path} is not the {name} serving port {port} "
                f"({' '.join(cmdline)[:120]}); refusing to kill it"
            )
        return pid

    def kill(self, name: str) -> None:
        """SIGKILL the service (PostgreSQL: with every process it started) and wait until gone."""
        pid = self.pid(name)
        victims = [pid, *(_children(pid) if name == "postgres" else [])]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_alive(v) for v in victims):
            if time.monotonic() > deadline:
                raise ServiceControlError(f"{name} (pid {pid}) did not die after SIGKILL")
            time.sleep(0.05)

    def restart(self, attempts: int = 6) -> None:
        """``infra/services.sh up``: starts whatever is not running and waits until it answers."""
        failure = f"`infra/services.sh up` failed {attempts} times; last: "
        run_until_ok([str(SERVICES_SH), "up"], dict(self.environ), attempts, failure)

    def check_all(self) -> None:
        """Raise unless every service's pid file names the service at the run's address."""
        for name in SERVICE_NAMES:
            self.pid(name)
