"""infra/services.sh reports the running services truthfully and fails clearly."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests._infra import (
    ENV_VARS,
    ROOT,
    SASL_ENV_VARS,
    Services,
    host_port,
    parse_exports,
    run_services_sh,
    unreachable,
)

pytestmark = pytest.mark.integration

SERVICE_NAMES = ("kafka", "postgres", "redis", "mongo", "mariadb")
STACK_TRACE = re.compile(
    r"Traceback \(most recent call last\)|^\s+at [\w$.]+\(|^Caused by: |Exception in thread", re.M
)


def only_local(infra_mode: str) -> None:
    if infra_mode != "local":
        pytest.skip(
            f"infra/services.sh runs the services only with SAGA_INFRA=local, not {infra_mode}"
        )


def test_status_lists_every_service_up_and_the_exports(infra_mode: str) -> None:
    """`status` exits 0, says "up" for each of the five services, and prints the export line
    of each address (and of the Spark jars folder), plus all or none of Kafka's SASL
    listener's."""
    only_local(infra_mode)
    done = run_services_sh("status", timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in SERVICE_NAMES:
        assert re.search(rf"^# {name}: up \(pid \d+\)", done.stdout, re.M), (
            f"{name} is not reported up:\n{done.stdout}"
        )
    exported = re.findall(r"^export (SAGA_\w+)=\S+$", done.stdout, re.M)
    sasl = [var for var in SASL_ENV_VARS.values() if var in exported]
    assert sasl in ([], list(SASL_ENV_VARS.values())), done.stdout
    assert sorted(exported) == sorted([*ENV_VARS.values(), *sasl])


def test_env_prints_the_addresses_the_tests_use(infra_mode: str, services: Services) -> None:
    """`env` prints exactly the addresses the `services` fixture resolved, so `make test`
    (which evals it) and a bare `pytest` talk to the same services."""
    only_local(infra_mode)
    done = run_services_sh("env", timeout=60)
    assert done.returncode == 0, done.stderr
    printed = parse_exports(done.stdout)
    resolved = {var: str(getattr(services, field)) for field, var in ENV_VARS.items()}
    if services.kafka_sasl is not None:
        for field, var in SASL_ENV_VARS.items():
            resolved[var] = str(getattr(services.kafka_sasl, field))
    for var in ("SAGA_SPARK_JARS", "SAGA_SASL_CA", "SAGA_SASL_USERS"):
        if var in printed:
            printed[var] = str(Path(printed[var]).resolve())
    assert printed == resolved


def without_password(url: str) -> str:
    parts = urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    return urlunsplit((parts.scheme, user + host_port(url), parts.path, "", ""))


def test_postgres_and_redis_ask_for_the_password(infra_mode: str, services: Services) -> None:
    """The local PostgreSQL refuses a wrong password over TCP and Redis a client without
    one, as production servers do: the tests run with credentials."""
    only_local(infra_mode)
    import psycopg
    import redis

    assert urlsplit(services.redis_url).password, services.redis_url.split("@")[-1]
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(without_password(services.redis_url), socket_timeout=5).ping()
    parts = urlsplit(services.postgres_url)
    wrong = urlunsplit(
        (parts.scheme, f"{parts.username}:wrong-password@{host_port(services.postgres_url)}",
         parts.path, parts.query, ""),
    )  # fmt: skip
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(wrong, connect_timeout=5).close()


def test_secrets_are_readable_by_their_owner_only(infra_mode: str, services: Services) -> None:
    """Every file under the infra folder's secrets/ (generated passwords, the users'
    Kafka settings, the broker's keys) but the certificates is mode 0600, its folders 0700."""
    only_local(infra_mode)
    if services.kafka_sasl is None:
        pytest.skip("Kafka's SASL listener is off (KAFKA_SASL=off): fewer secrets to check")
    secrets = services.kafka_sasl.users_dir.parent
    assert secrets.name == "secrets", secrets
    checked = 0
    for path in [secrets, *secrets.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.is_dir():
            assert mode == 0o700, f"{path} is {oct(mode)}"
        elif path.suffix in (".password", ".properties", ".key", ".p12"):
            assert mode == 0o600, f"{path} is {oct(mode)}"
            checked += 1
    assert checked >= 3


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


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs. A zombie does not: it has exited and holds nothing, only
    its parent has not reaped it yet (here an orphan's parent is PID 1, which takes its time);
    infra/services.sh counts it out the same way."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


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

    with taken_ports(6) as ports:
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
            KAFKA_SASL_PORT=str(ports[5]),
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
        assert not alive(kafka_pid), f"kafka (pid {kafka_pid}) still runs after down"
    assert unreachable(services) == []
