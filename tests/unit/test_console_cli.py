"""``saga console``'s own mistakes: one sentence, exit 2, before Kafka is waited for.

A database that cannot be opened (its password never shown), a port already taken
and an unusable operator name are reported at once; no Kafka is needed to see them
(the bootstrap address names a port where nothing listens).
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests._infra import ROOT

pytestmark = pytest.mark.unit

NO_KAFKA = ("--bootstrap", "127.0.0.1:1", "--connect-timeout", "1")


def saga(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def one_sentence(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_the_command_is_listed_and_has_help() -> None:
    assert "console" in saga("--help").stdout
    done = saga("console", "--help")
    assert done.returncode == 0
    assert "--db" in done.stdout and "--operator" in done.stdout


def test_a_database_that_cannot_be_opened(tmp_path: object) -> None:
    done = saga("console", *NO_KAFKA, "--db", "sqlite:////no/such/folder/console.db")
    assert done.returncode == 2
    assert "cannot open the console database" in one_sentence(done)


def test_a_postgresql_database_that_cannot_be_opened_hides_its_password() -> None:
    done = saga("console", *NO_KAFKA, "--db", "postgresql://u:Sup3r-secret@127.0.0.1:1/db")
    assert done.returncode == 2
    line = one_sentence(done)
    assert "cannot open the console database" in line
    assert "Sup3r-secret" not in done.stderr + done.stdout


def test_a_port_already_taken() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = saga("console", *NO_KAFKA, "--db", ":memory:", "--port", port)
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in one_sentence(done)


def test_an_unusable_operator_name() -> None:
    done = saga("console", *NO_KAFKA, "--db", ":memory:", "--operator", "not a name")
    assert done.returncode == 2
    assert "--operator" in one_sentence(done)


def test_no_kafka_is_one_sentence_too() -> None:
    done = saga("console", *NO_KAFKA, "--db", ":memory:", "--port", "0")
    assert done.returncode == 1
    assert "127.0.0.1:1" in one_sentence(done)
