"""The real ``saga`` CLI against the real services: failures a user can hit at start-up.

Each test runs ``python -m coordinator ...`` (what the ``saga`` script runs) as a
subprocess and asserts on its exit code and its whole output:

* Kafka not answering: the participant and the coordinator exit after
  ``--connect-timeout`` seconds with one sentence and without flooding the log;
* a storage refusing the login (PostgreSQL, Redis, MongoDB wire): one sentence
  saying it is an authentication failure and what to fix, exit code 2, no retries;
* no password given to the participant ever shows in its output, whatever the
  driver's error says, and a participant whose URL and password come from files
  runs without showing the password in its (debug) log.

The local PostgreSQL asks TCP clients for a password (``infra/services.sh`` writes
a ``scram-sha-256`` pg_hba.conf) and the local Redis for its password
(``requirepass``), as production servers do: both a user that does not exist
(SQLSTATE 28000) and a wrong password (28P01) are refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

from tests._infra import Services, eventually, host_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

UNREACHABLE_KAFKA = "127.0.0.1:1"  # nothing listens on port 1: connection refused at once


@dataclass
class Ran:
    code: int
    output: str
    seconds: float

    @property
    def lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.strip()]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
    env.update(extra or {})
    return env


def saga(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Ran:
    """Run ``saga ARGS`` to its end; stdout and stderr together, as a terminal shows them."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "coordinator", *args],
            env=_env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        shown = (exc.output or b"").decode(errors="replace")[-2000:]
        pytest.fail(f"`saga {' '.join(args)}` did not exit within {timeout}s; output:\n{shown}")
    return Ran(done.returncode, done.stdout.decode(errors="replace"), time.monotonic() - started)


def one_sentence(ran: Ran, code: int, *fragments: str) -> str:
    assert "Traceback" not in ran.output, ran.output
    assert ran.code == code, ran.output
    assert len(ran.lines) == 1, ran.output
    line = ran.lines[0]
    assert line.startswith("saga: "), line
    for fragment in fragments:
        assert fragment in line, line
    return line


def with_credentials(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host_port(url)}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def secret() -> str:
    return f"Secret-{uuid.uuid4().hex[:12]}"


def participant(kind: str, *extra: str, bootstrap: str, prefix: str) -> list[str]:
    return [
        "participant", "run", "--bootstrap", bootstrap, "--prefix", prefix,
        "--name", "clierr", "--storage", kind, "--targets", "accounts", *extra,
    ]  # fmt: skip


# ---------------------------------------------------------------- Kafka does not answer


def test_a_participant_without_kafka_exits_with_one_sentence(services: Services) -> None:
    ran = saga(
        *participant("redis", "--connect-timeout", "3", bootstrap=UNREACHABLE_KAFKA, prefix="x"),
        env={"SAGA_STORAGE_URL": services.redis_url},
        timeout=30,
    )
    one_sentence(ran, 1, f"Kafka at {UNREACHABLE_KAFKA} does not answer after 3s", "is it running?")
    assert 3 <= ran.seconds < 15, ran.seconds


def test_a_participant_without_kafka_does_not_flood_a_verbose_log(services: Services) -> None:
    ran = saga(
        "-v",
        *participant("redis", bootstrap=UNREACHABLE_KAFKA, prefix="x"),
        env={"SAGA_STORAGE_URL": services.redis_url, "SAGA_CONNECT_TIMEOUT": "3"},
        timeout=30,
    )
    assert "Traceback" not in ran.output
    assert ran.code == 1
    assert len(ran.lines) <= 3, ran.output
    assert ran.lines[-1].startswith(f"saga: Kafka at {UNREACHABLE_KAFKA} does not answer after 3s")


def test_the_coordinator_without_kafka_exits_with_one_sentence() -> None:
    ran = saga(
        "coordinator", "run", "--bootstrap", UNREACHABLE_KAFKA, "--connect-timeout", "3",
        timeout=30,
    )  # fmt: skip
    one_sentence(ran, 1, f"Kafka at {UNREACHABLE_KAFKA} does not answer after 3s")
    assert ran.seconds < 15


# ---------------------------------------------------------------- storages refuse the login


def test_postgresql_refusing_the_user_is_an_authentication_failure(
    services: Services, topic_prefix: str
) -> None:
    password = secret()
    url = with_credentials(services.postgres_url, f"nobody_{topic_prefix}", password)
    ran = saga(
        *participant("sql", bootstrap=services.kafka_bootstrap, prefix=topic_prefix),
        env={"SAGA_STORAGE_URL": url},
    )
    one_sentence(
        ran,
        2,
        "authentication failure: PostgreSQL at",
        f"refused the user 'nobody_{topic_prefix}'",
        "fix the user name or password in the storage URL",
    )
    assert "retrying is safe" not in ran.output
    assert password not in ran.output


def test_postgresql_wrong_password_is_an_authentication_failure(
    services: Services, topic_prefix: str
) -> None:
    import psycopg

    user = urlsplit(services.postgres_url).username or "saga"
    password = secret()
    url = with_credentials(services.postgres_url, user, password)
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(url, connect_timeout=5).close()  # the server checks passwords
    ran = saga(
        *participant("sql", bootstrap=services.kafka_bootstrap, prefix=topic_prefix),
        env={"SAGA_STORAGE_URL": url},
    )
    one_sentence(ran, 2, "authentication failure", "fix the user name or password")
    assert password not in ran.output


def test_redis_refusing_the_credentials_is_an_authentication_failure(
    services: Services, topic_prefix: str
) -> None:
    password = secret()
    url = with_credentials(services.redis_url, f"nobody-{topic_prefix}", password)
    ran = saga(
        *participant("redis", bootstrap=services.kafka_bootstrap, prefix=topic_prefix),
        env={"SAGA_STORAGE_URL": url},
    )
    one_sentence(
        ran,
        2,
        "could not reach Redis: authentication failure: Redis at",
        "fix the user name or password in the storage URL",
    )
    assert password not in ran.output


def test_mongo_refusing_the_credentials_is_an_authentication_failure(
    services: Services, topic_prefix: str
) -> None:
    password = secret()
    url = with_credentials(services.mongo_url, f"nobody-{topic_prefix}", password)
    ran = saga(
        *participant("mongo", bootstrap=services.kafka_bootstrap, prefix=topic_prefix),
        env={"SAGA_STORAGE_URL": url},
    )
    one_sentence(
        ran,
        2,
        "authentication failure: MongoDB at",
        "fix the user name, password, authSource or authMechanism in the storage URL",
    )
    assert password not in ran.output


# ---------------------------------------------------------------- passwords never show


@pytest.mark.parametrize(
    ("kind", "template"),
    [
        ("sql", "postgresql://saga:{pw}@127.0.0.1:notaport/saga"),
        ("mongo", "mongodb://user:{pw}@127.0.0.1:notaport/"),
        ("redis", "redis://:{pw}@127.0.0.1:notaport/0"),
    ],
)
def test_a_url_the_driver_refuses_is_shown_without_its_password(
    services: Services, kind: str, template: str
) -> None:
    password = secret()
    url = template.format(pw=password)
    ran = saga(*participant(kind, "--url", url, bootstrap=services.kafka_bootstrap, prefix="x"))
    assert "Traceback" not in ran.output
    assert ran.code == 2, ran.output
    assert password not in ran.output
    # the warning about the command line, then the one sentence
    assert "the storage password is on the command line" in ran.output
    assert ran.lines[-1].startswith(f"saga: {template.format(pw='***')!r} is not a"), ran.output


def test_an_unreachable_database_is_named_without_the_password(
    services: Services, topic_prefix: str
) -> None:
    password = secret()
    # A port nothing listens on: psycopg's own error text, then ours.
    url = f"postgresql://saga:{password}@127.0.0.1:1/saga"
    ran = saga(
        *participant("sql", bootstrap=services.kafka_bootstrap, prefix=topic_prefix),
        env={"SAGA_STORAGE_URL": url},
    )
    line = one_sentence(ran, 1, "PostgreSQL at 127.0.0.1:1/saga is unavailable")
    assert "Connection refused" in line
    assert password not in ran.output


@pytest.fixture
def saga_topics(kafka_topics: object) -> Iterator[None]:
    make = kafka_topics
    assert callable(make)
    make(["requests", "events", "decisions", "dlq"])
    make(["status"], compacted=True)
    yield


def test_url_and_password_from_files_run_without_showing_the_password(
    services: Services, topic_prefix: str, saga_topics: None, tmp_path: Path
) -> None:
    import redis

    parts = urlsplit(services.redis_url)
    # The URL file holds the address only; the password file, Redis's password (or, for
    # a Redis without one, any password: it accepts every one then).
    url = urlunsplit((parts.scheme, host_port(services.redis_url), parts.path, "", ""))
    password = parts.password or secret()
    probe = redis.Redis.from_url(with_credentials(url, "default", password))
    try:
        probe.ping()
    finally:
        probe.close()
    url_file = tmp_path / "storage-url"
    url_file.write_text(url + "\n", encoding="utf-8")
    password_file = tmp_path / "storage-password"
    password_file.write_text(password + "\n", encoding="utf-8")
    log_path = tmp_path / "participant.log"
    args = participant(
        "redis", "--url-file", str(url_file), "--password-file", str(password_file),
        "--schema", topic_prefix, bootstrap=services.kafka_bootstrap, prefix=topic_prefix,
    )  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "-vv", *args],
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        eventually(
            lambda: "participant clierr running on" in log_path.read_text(errors="replace"),
            timeout=60,
            message="the participant did not start",
        )
    finally:
        proc.terminate()
        proc.wait(30)
    output = log_path.read_text(errors="replace")
    assert "Traceback" not in output, output
    assert password not in output
    assert "on the command line" not in output
