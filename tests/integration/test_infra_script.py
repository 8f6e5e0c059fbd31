"""infra/services.sh reports the running services truthfully and fails clearly."""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._infra import ENV_VARS, ROOT, Services, parse_exports, run_services_sh, unreachable

pytestmark = pytest.mark.integration

SERVICE_NAMES = ("kafka", "postgres", "redis", "mongo")
STACK_TRACE = re.compile(
    r"Traceback \(most recent call last\)|^\s+at [\w$.]+\(|^Caused by: |Exception in thread", re.M
)


def only_local(infra_mode: str) -> None:
    if infra_mode != "local":
        pytest.skip(
            f"infra/services.sh runs the services only with SAGA_INFRA=local, not {infra_mode}"
        )


def test_status_lists_every_service_up_and_the_exports(infra_mode: str) -> None:
    """`status` exits 0, says "up" for each of the four services, and prints the export line
    of each address (and of the Spark jars folder)."""
    only_local(infra_mode)
    done = run_services_sh("status", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in SERVICE_NAMES:
        assert re.search(rf"^# {name}: up \(pid \d+\)", done.stdout, re.M), (
            f"{name} is not reported up:\n{done.stdout}"
        )
    exported = re.findall(r"^export (SAGA_\w+)=\S+$", done.stdout, re.M)
    assert sorted(exported) == sorted(ENV_VARS.values())


def test_env_prints_the_addresses_the_tests_use(infra_mode: str, services: Services) -> None:
    """`env` prints exactly the addresses the `services` fixture resolved, so `make test`
    (which evals it) and a bare `pytest` talk to the same services."""
    only_local(infra_mode)
    done = run_services_sh("env", timeout=60)
    assert done.returncode == 0, done.stderr
    printed = parse_exports(done.stdout)
    resolved = {var: str(getattr(services, field)) for field, var in ENV_VARS.items()}
    printed["SAGA_SPARK_JARS"] = str(Path(printed["SAGA_SPARK_JARS"]).resolve())
    assert printed == resolved


@contextlib.contextmanager
def taken_ports(count: int) -> Iterator[list[int]]:
    """Ports bound on loopback by this process (not listening, so probes are refused at
    once, yet a server cannot bind them); released on exit."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        yield ports


def test_failed_start_names_the_service_and_its_log(tmp_path: Path, services: Services) -> None:
    """`up` for a second instance whose Kafka cannot bind its ports exits non-zero with one
    line naming kafka and its log, and no stack trace on stderr; the running services are
    not disturbed and `down` leaves nothing of the second instance running."""
    real = (ROOT / os.environ.get("SAGA_INFRA_DIR", ".infra")).resolve()
    stamps = [real / "kafka-libs/.stamp", real / "spark-jars/.stamp", real / "bin/.ferretdb-stamp"]
    missing = [str(s) for s in stamps if not s.is_file()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run `make infra-up` once first", pytrace=False)
    instance = tmp_path / "infra"
    instance.mkdir()
    for name in ("kafka-libs", "spark-jars", "bin"):  # provisioned already: no downloads
        (instance / name).symlink_to(real / name, target_is_directory=True)

    with taken_ports(5) as ports:
        env = dict(
            os.environ,
            SAGA_INFRA_DIR=str(instance),
            SAGA_HOST="127.0.0.1",
            KAFKA_PORT=str(ports[0]),
            KAFKA_CONTROLLER_PORT=str(ports[1]),
            # Should Kafka start after all, the next services fail on taken ports too.
            POSTGRES_PORT=str(ports[2]),
            REDIS_PORT=str(ports[3]),
            MONGO_PORT=str(ports[4]),
            SAGA_READY_TIMEOUT="20",
        )
        try:
            done = run_services_sh("up", env=env, timeout=180)
            pid_file = instance / "pids" / "kafka.pid"
            kafka_pid = int(pid_file.read_text()) if pid_file.is_file() else None
        finally:
            cleanup = run_services_sh("down", env=env, timeout=120)

    assert done.returncode != 0, done.stderr
    kafka_lines = [
        line for line in done.stderr.splitlines() if line.startswith("saga infra: kafka")
    ]
    assert len(kafka_lines) == 1, done.stderr
    assert f"{instance}/logs/kafka.log" in kafka_lines[0]
    assert not STACK_TRACE.search(done.stderr), done.stderr
    assert (instance / "logs" / "kafka.log").is_file()

    assert cleanup.returncode == 0, cleanup.stderr
    if kafka_pid is not None:
        with pytest.raises(ProcessLookupError):
            os.kill(kafka_pid, 0)
    assert unreachable(services) == []
