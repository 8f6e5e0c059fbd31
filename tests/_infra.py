"""Which services the tests talk to, and small helpers shared by the test modules.

``SAGA_INFRA`` picks the infrastructure:

* ``local``: the processes started by ``infra/services.sh`` (the default when no
  Docker engine answers). Each address comes from its ``SAGA_*`` variable when set,
  else from ``infra/services.sh env``.
* ``external``: every ``SAGA_*`` address must be set in the environment.
* ``containers``: Kafka, PostgreSQL, MongoDB and Redis from testcontainers, started once
  per session (the default when ``docker info`` answers within 5 s).

Importable as ``tests._infra``: ``tests/conftest.py`` puts the repository root on
``sys.path`` before importing it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVICES_SH = ROOT / "infra" / "services.sh"

MODES = ("local", "external", "containers")

# Services field -> environment variable holding its address.
ENV_VARS = {
    "kafka_bootstrap": "SAGA_KAFKA_BOOTSTRAP",
    "postgres_url": "SAGA_POSTGRES_URL",
    "mongo_url": "SAGA_MONGO_URL",
    "redis_url": "SAGA_REDIS_URL",
    "spark_jars_dir": "SAGA_SPARK_JARS",
    "mariadb_url": "SAGA_MARIADB_URL",
}

# KafkaSasl field -> environment variable: the SASL_SSL listener of the local services
# (KAFKA_SASL=on in infra/config.env). Optional: all three or none. Not SAGA_KAFKA_*,
# which saga reads as librdkafka settings.
SASL_ENV_VARS = {
    "bootstrap": "SAGA_SASL_BOOTSTRAP",
    "ca": "SAGA_SASL_CA",
    "users_dir": "SAGA_SASL_USERS",
}

# Images for SAGA_INFRA=containers. KafkaContainer drives Confluent's start-up scripts,
# so its image is cp-kafka (Apache Kafka 3.7) rather than apache/kafka.
KAFKA_IMAGE = "confluentinc/cp-kafka:7.7.1"
POSTGRES_IMAGE = "postgres:16"
MONGO_IMAGE = "mongo:7.0"
REDIS_IMAGE = "redis:7"

CONTAINER_REDIS_PASSWORD = "saga-redis"  # a throw-away container's; local services generate theirs
PROBE_TIMEOUT = 5.0  # seconds each service gets to answer the session's first probe

T = TypeVar("T")


@dataclass(frozen=True)
class KafkaSasl:
    """Kafka's SASL_SSL listener (SCRAM-SHA-512, ACLs) and its users' secrets."""

    bootstrap: str  # host:port of the SASL_SSL listener
    ca: Path  # the CA certificate (PEM) the broker's certificate is signed with
    users_dir: Path  # <user>.password and <user>.properties per SCRAM user (0600)

    def password(self, user: str) -> str:
        """The SCRAM password of ``user`` (e.g. ``client``, ``participant-bank``)."""
        return (self.users_dir / f"{user}.password").read_text(encoding="utf-8").strip()

    def client_config(self, user: str) -> dict[str, str]:
        """librdkafka settings that log in as ``user`` (without bootstrap.servers)."""
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": user,
            "sasl.password": self.password(user),
            "ssl.ca.location": str(self.ca),
        }

    def config_file(self, user: str) -> Path:
        """The ``--kafka-config`` file of ``user`` that ``infra/services.sh`` writes."""
        return self.users_dir / f"{user}.properties"


def _sasl_from(values: Mapping[str, str]) -> KafkaSasl | None:
    if not all(values.get(var) for var in SASL_ENV_VARS.values()):
        return None
    return KafkaSasl(
        bootstrap=values["SAGA_SASL_BOOTSTRAP"],
        ca=Path(values["SAGA_SASL_CA"]).resolve(),
        users_dir=Path(values["SAGA_SASL_USERS"]).resolve(),
    )


@dataclass(frozen=True)
class Services:
    """Addresses of the services one test session runs against."""

    kafka_bootstrap: str  # host:port
    postgres_url: str  # postgresql://user:password@host:port/db
    mongo_url: str  # mongodb://[user:password@]host:port/
    redis_url: str  # redis://[:password@]host:port/db
    spark_jars_dir: Path  # folder with spark-sql-kafka and its dependencies
    kafka_sasl: KafkaSasl | None = None  # None: no SASL listener configured
    mariadb_url: str = ""  # mariadb://user:password@host:port/db; "" in containers mode

    @property
    def spark_jars(self) -> list[Path]:
        """Every jar in ``spark_jars_dir``, sorted, as absolute paths."""
        return sorted(p.resolve() for p in self.spark_jars_dir.glob("*.jar"))


# ----------------------------------------------------------------- selection


def docker_answers(timeout: float = 5.0) -> bool:
    """True when ``docker info`` succeeds within ``timeout`` seconds."""
    try:
        done = subprocess.run(
            ["docker", "info"],
            capture_output=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def select_mode(environ: Mapping[str, str] = os.environ) -> str:
    """SAGA_INFRA when set, else ``containers`` if a Docker engine answers, else ``local``."""
    mode = environ.get("SAGA_INFRA", "").strip().lower()
    if mode:
        if mode not in MODES:
            raise pytest.UsageError(f"SAGA_INFRA={mode!r} is not one of {', '.join(MODES)}")
        return mode
    return "containers" if docker_answers() else "local"


def run_services_sh(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run ``infra/services.sh`` with ``args``, output captured as text; exit codes never raise."""
    return subprocess.run(
        [str(SERVICES_SH), *args],
        cwd=ROOT,
        env=dict(os.environ if env is None else env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def parse_exports(text: str) -> dict[str, str]:
    """The ``export K=V`` lines of ``text`` as a dict (other lines are ignored)."""
    found: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith("export "):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if sep:
            words = shlex.split(value)
            found[key.strip()] = words[0] if words else ""
    return found


def services_sh_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The addresses ``infra/services.sh env`` prints, as a dict."""
    done = run_services_sh("env", env=environ, timeout=60)
    if done.returncode != 0:
        raise pytest.UsageError(
            f"`infra/services.sh env` failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return parse_exports(done.stdout)


def _from_values(values: Mapping[str, str]) -> Services:
    return Services(
        kafka_bootstrap=values["SAGA_KAFKA_BOOTSTRAP"],
        postgres_url=values["SAGA_POSTGRES_URL"],
        mongo_url=values["SAGA_MONGO_URL"],
        redis_url=values["SAGA_REDIS_URL"],
        spark_jars_dir=Path(values["SAGA_SPARK_JARS"]).resolve(),
        kafka_sasl=_sasl_from(values),
        mariadb_url=values["SAGA_MARIADB_URL"],
    )


def local_services(environ: Mapping[str, str] = os.environ) -> Services:
    """Addresses from the SAGA_* variables that are set, the rest from ``services.sh env``
    (the SASL listener's all from the one or all from the other, when configured)."""
    values = {var: environ[var] for var in ENV_VARS.values() if environ.get(var)}
    sasl = {var: environ[var] for var in SASL_ENV_VARS.values() if environ.get(var)}
    if len(values) < len(ENV_VARS):
        printed = services_sh_env(environ)
        for var in ENV_VARS.values():
            if var not in values:
                if var not in printed:
                    raise pytest.UsageError(f"`infra/services.sh env` printed no {var}")
                values[var] = printed[var]
        if not sasl:
            sasl = {var: printed[var] for var in SASL_ENV_VARS.values() if var in printed}
    return _from_values({**values, **sasl})


def external_services(environ: Mapping[str, str] = os.environ) -> Services:
    """Addresses from the SAGA_* variables, all of which must be set."""
    missing = [var for var in ENV_VARS.values() if not environ.get(var)]
    if missing:
        raise pytest.UsageError(
            f"SAGA_INFRA=external needs {', '.join(missing)} set to the services' addresses"
        )
    return _from_values(environ)


def _container_class(module: str, name: str) -> type:
    """A testcontainers class, from the 4.14+ ``community`` layout or the older flat one."""
    import importlib

    try:
        mod = importlib.import_module(f"testcontainers.community.{module}")
    except ImportError:
        mod = importlib.import_module(f"testcontainers.{module}")
    cls: type = getattr(mod, name)
    return cls


def container_services(stack: contextlib.ExitStack) -> Services:
    """Start Kafka (KRaft), PostgreSQL, MongoDB and Redis containers; ``stack`` stops them."""
    kafka_cls = _container_class("kafka", "KafkaContainer")
    postgres_cls = _container_class("postgres", "PostgresContainer")
    mongo_cls = _container_class("mongodb", "MongoDbContainer")
    redis_cls = _container_class("redis", "RedisContainer")

    kafka = (
        kafka_cls(KAFKA_IMAGE)
        .with_kraft()
        .with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
    )
    postgres = postgres_cls(
        POSTGRES_IMAGE, username="saga", password="saga", dbname="saga", driver=None
    )
    mongo = mongo_cls(MONGO_IMAGE)
    # A password, as the local services and production have (its readiness probe uses it).
    redis_container = redis_cls(REDIS_IMAGE, password=CONTAINER_REDIS_PASSWORD).with_command(
        f"redis-server --appendonly yes --requirepass {CONTAINER_REDIS_PASSWORD}"
    )

    kafka.start(timeout=180)
    stack.callback(kafka.stop)
    for container in (postgres, mongo, redis_container):
        container.start()
        stack.callback(container.stop)

    redis_host = redis_container.get_container_host_ip()
    redis_port = redis_container.get_exposed_port(redis_container.port)
    return Services(
        kafka_bootstrap=kafka.get_bootstrap_server(),
        postgres_url=postgres.get_connection_url(driver=None),
        mongo_url=mongo.get_connection_url(),
        redis_url=f"redis://:{CONTAINER_REDIS_PASSWORD}@{redis_host}:{redis_port}/0",
        spark_jars_dir=spark_jars_for_containers(),
    )


def spark_jars_for_containers(environ: Mapping[str, str] = os.environ) -> Path:
    """SAGA_SPARK_JARS, else the folder ``infra/services.sh provision`` fills."""
    if environ.get("SAGA_SPARK_JARS"):
        return Path(environ["SAGA_SPARK_JARS"]).resolve()
    done = run_services_sh("provision", env=environ, timeout=1800)
    if done.returncode != 0:
        raise pytest.UsageError(f"`infra/services.sh provision` failed: {done.stderr.strip()}")
    return Path(services_sh_env(environ)["SAGA_SPARK_JARS"]).resolve()


def resolve_services(
    mode: str, stack: contextlib.ExitStack, environ: Mapping[str, str] = os.environ
) -> Services:
    """The services for ``mode``; containers started here are stopped when ``stack`` closes."""
    if mode == "local":
        return local_services(environ)
    if mode == "external":
        return external_services(environ)
    if mode == "containers":
        return container_services(stack)
    raise pytest.UsageError(f"SAGA_INFRA={mode!r} is not one of {', '.join(MODES)}")


# ----------------------------------------------------------------- reachability


def host_port(url: str) -> str:
    """``host:port`` of a URL (credentials left out), or the string itself if it has none."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


def _probe_kafka(bootstrap: str) -> None:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(
        {
            "bootstrap.servers": bootstrap,
            "socket.connection.setup.timeout.ms": int(PROBE_TIMEOUT * 1000),
            "log_level": 0,  # no connection-refused chatter on stderr; the message says it all
        }
    )
    try:
        metadata = admin.list_topics(timeout=PROBE_TIMEOUT)
    except KafkaException as exc:
        raise ConnectionError(str(exc)) from exc
    if not metadata.brokers:
        raise ConnectionError("no brokers in the metadata")


def _probe_postgres(url: str) -> None:
    import psycopg

    with psycopg.connect(url, connect_timeout=int(PROBE_TIMEOUT)) as conn:
        conn.execute("SELECT 1")


def _probe_mariadb(url: str) -> None:
    import pymysql

    parts = urlsplit(url)
    pymysql.connect(
        host=parts.hostname,
        port=parts.port or 3306,
        user=unquote(parts.username or ""),
        password=unquote(parts.password or ""),
        database=parts.path.lstrip("/") or None,
        connect_timeout=PROBE_TIMEOUT,
    ).close()


def _probe_mongo(url: str) -> None:
    import pymongo

    timeout_ms = int(PROBE_TIMEOUT * 1000)
    client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(
        url, serverSelectionTimeoutMS=timeout_ms, connectTimeoutMS=timeout_ms
    )
    try:
        client.admin.command("ping")
    finally:
        client.close()


def _probe_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(
        url, socket_connect_timeout=PROBE_TIMEOUT, socket_timeout=PROBE_TIMEOUT
    )
    try:
        client.ping()
    finally:
        client.close()


def unreachable(services: Services) -> list[str]:
    """One phrase per service that does not answer within the probe deadline, e.g.
    ``"Kafka at 127.0.0.1:19092"``; a missing Spark jars folder is reported too."""
    probes: list[tuple[str, Callable[[str], None], str]] = [
        ("Kafka", _probe_kafka, services.kafka_bootstrap),
        ("PostgreSQL", _probe_postgres, services.postgres_url),
        ("MongoDB", _probe_mongo, services.mongo_url),
        ("Redis", _probe_redis, services.redis_url),
    ]
    if services.mariadb_url:
        probes.append(("MariaDB", _probe_mariadb, services.mariadb_url))

    def answers(probe: Callable[[str], None], address: str) -> bool:
        try:
            probe(address)
        except Exception:  # any failure to answer counts as down
            return False
        return True

    with ThreadPoolExecutor(max_workers=len(probes)) as pool:
        results = [pool.submit(answers, probe, address) for _, probe, address in probes]
        down = [
            f"{name} at {host_port(address)}"
            for (name, _, address), ok in zip(probes, results, strict=True)
            if not ok.result()
        ]
    if not services.spark_jars:
        down.append(f"the Spark jars folder {services.spark_jars_dir}")
    return down


HINTS = {
    "local": "start the local services with `make infra-up` "
    "(or set SAGA_INFRA=external and the SAGA_* addresses)",
    "external": "check the SAGA_* addresses (SAGA_INFRA=external)",
    "containers": "check the Docker engine and the containers' logs (SAGA_INFRA=containers)",
}


def unreachable_message(down: list[str], mode: str) -> str:
    """One sentence naming what is down and what to do about it."""
    if len(down) == 1:
        what = f"{down[0]} does not answer"
    else:
        what = f"{', '.join(down[:-1])} and {down[-1]} do not answer"
    return f"{what}: {HINTS[mode]}"


# ----------------------------------------------------------------- helpers


def unique_name(prefix: str = "t") -> str:
    """``prefix`` plus 8 random hex digits: a valid Kafka topic, SQL, Mongo and Redis name."""
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def sqlalchemy_url(url: str) -> str:
    """A ``postgresql://`` URL as a SQLAlchemy URL with the psycopg (v3) driver."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url.removeprefix(scheme)
    return url


def eventually(
    predicate: Callable[[], T],
    timeout: float = 30,
    interval: float = 0.1,
    message: str = "condition not met",
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` until it returns something truthy and return that value.

    Exceptions listed in ``retry_on`` count as "not yet"; others propagate at once.
    When ``timeout`` seconds pass, raise AssertionError with ``message`` and the last
    value (or exception) seen.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = predicate()
        except retry_on as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (after {timeout:g}s; last value: {last!r})")
        time.sleep(interval)
