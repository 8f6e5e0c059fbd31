"""`pip install saga-olep` without extras is small, and the client and the coordinator work
from it against the real Kafka.

A wheel of the project is built (from a copy of the sources, so the checkout gets no
build/ folder) and installed into a fresh virtual environment, with its dependencies
from PyPI and no extras. Then:

* pyspark, SQLAlchemy, psycopg, pymongo and redis are not installed, and the
  environment's site-packages is at most 100 MB (measured and printed);
* that environment's ``saga`` creates topics under a fresh prefix, submits
  examples/transfer.json, reads its status (none yet: exit 4), runs a coordinator
  (it needs no storage driver) whose status for the saga ``saga status`` then prints,
  and deletes the topics;
* its client library submits a saga and reads its status (``result`` times out, as
  no participant runs) without loading a driver;
* the commands that need an extra say which one: ``participant run --storage sql``
  and ``reconcile`` exit 2 naming ``postgres`` and ``spark``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import pytest

from tests._infra import ROOT, Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MAX_SITE_PACKAGES = 100 * 1024 * 1024
NOT_IN_CORE = ("pyspark", "sqlalchemy", "psycopg", "psycopg-binary", "pymongo", "redis")
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "coordinator", "participants", "streams")


def _run(
    argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, env=env, cwd=ROOT
    )


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, (
        f"{done.args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


def _site_packages_bytes(venv: Path) -> tuple[Path, int]:
    (site,) = venv.glob("lib/python3*/site-packages")
    total = sum(p.stat().st_size for p in site.rglob("*") if p.is_file() and not p.is_symlink())
    return site, total


@pytest.fixture(scope="module")
def small_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment with the project's wheel installed without extras."""
    work = tmp_path_factory.mktemp("client-install")
    src = work / "src"
    src.mkdir()
    for name in (*SOURCES, "saga"):
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(
                origin, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(origin, src / name)
    wheels = work / "wheels"
    _ok(
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)])
    )
    (wheel,) = wheels.glob("saga_olep-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    # One import name: `saga`, with coordinator/participants/streams beneath it.
    assert {t for t in tops if not t.endswith(".dist-info")} == {"saga"}, tops
    assert "saga/coordinator/_client.py" in archive.namelist()
    assert "saga/participants/sql/_adapter.py" in archive.namelist()
    assert "saga/py.typed" in archive.namelist()
    venv = work / "venv"
    _ok(_run([sys.executable, "-m", "venv", str(venv)]))
    started = time.monotonic()
    _ok(
        _run(
            [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                str(wheel),
            ],
            timeout=900,
        )
    )
    print(f"\ninstalled {wheel.name} without extras in {time.monotonic() - started:.0f} s")
    return venv


def _env(services: Services, prefix: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SAGA_", "PYTHON", "VIRTUAL_ENV"))
    }
    env["SAGA_KAFKA_BOOTSTRAP"] = services.kafka_bootstrap
    env["SAGA_TOPIC_PREFIX"] = prefix
    return env


def test_no_driver_or_spark_and_at_most_100_mb(small_venv: Path) -> None:
    listed = json.loads(
        _ok(_run([str(small_venv / "bin" / "python"), "-m", "pip", "list", "--format", "json"]))
    )
    names = {str(p["name"]).lower() for p in listed}
    assert "saga-olep" in names, names
    present = sorted(names & set(NOT_IN_CORE))
    assert not present, f"a plain install brought {present}: they belong in extras"
    site, total = _site_packages_bytes(small_venv)
    print(f"\n{site}: {total / 1e6:.1f} MB ({total:,} bytes) for {len(names)} packages")
    assert total <= MAX_SITE_PACKAGES, f"site-packages is {total / 1e6:.1f} MB, over 100 MB"


_CLIENT_SCRIPT = """
import json, os, sys
from saga.coordinator import SagaClient
from saga.streams import KafkaSettings, SagaTimeout, Step

settings = KafkaSettings.from_sources(None, None, None, os.environ)
with SagaClient(settings) as client:
    tx = client.submit(
        [Step("ledger", "increment",
              {"target": "accounts", "key": "alice", "field": "balance", "by": -1, "min": 0})],
        saga="client-install",
        timeout=30,
    )
    try:
        client.result(tx, timeout=2)
        outcome = "final"
    except SagaTimeout as exc:
        outcome = "timeout: " + str(exc)
    status = client.status(tx)
drivers = sorted(m for m in sys.modules if m.split(".")[0] in
                 ("pyspark", "sqlalchemy", "psycopg", "pymongo", "redis"))
print(json.dumps({"tx_id": tx, "outcome": outcome,
                  "state": None if status is None else status.state.value, "drivers": drivers}))
"""


def test_saga_and_the_client_work_from_the_small_install(
    small_venv: Path, services: Services
) -> None:
    prefix = f"ci-{uuid.uuid4().hex[:10]}"
    env = _env(services, prefix)
    saga = str(small_venv / "bin" / "saga")
    python = str(small_venv / "bin" / "python")
    _ok(_run([saga, "topics", "create", "--partitions", "2"], env=env, timeout=120))
    coordinator: subprocess.Popen[bytes] | None = None
    try:
        sent = _run(
            [saga, "submit", str(ROOT / "examples" / "transfer.json"), "--json"],
            env=env,
            timeout=120,
        )
        tx_id = json.loads(_ok(sent))["tx_id"]

        # No coordinator yet: no status, which is "not final" (exit 4), in one sentence.
        unseen = _run([saga, "status", tx_id], env=env, timeout=120)
        assert unseen.returncode == 4, unseen
        assert unseen.stderr.startswith(f"saga: no status for transaction {tx_id}"), unseen.stderr

        # The client library: submit, then a status read that times out (no participant).
        ran = json.loads(_ok(_run([python, "-c", _CLIENT_SCRIPT], env=env, timeout=120)))
        assert ran["drivers"] == [], ran
        assert ran["outcome"].startswith(f"timeout: transaction {ran['tx_id']} is still running"), (
            ran
        )

        # The coordinator runs from the same install (it needs no driver) and publishes
        # the saga's status, which `saga status` then prints.
        coordinator_log = small_venv.parent / "coordinator.log"
        log = coordinator_log.open("wb")
        coordinator = subprocess.Popen(
            [saga, "coordinator", "run", "--instance-id", f"{prefix}-c"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + 90
        shown: subprocess.CompletedProcess[str] | None = None
        while time.monotonic() < deadline:
            assert coordinator.poll() is None, coordinator_log.read_text()
            shown = _run([saga, "status", tx_id], env=env, timeout=120)
            if shown.stdout.strip():
                break
            time.sleep(1)
        assert shown is not None and shown.stdout.strip(), (
            f"no status within 90 s; coordinator log:\n{coordinator_log.read_text()}"
        )
        status = json.loads(shown.stdout)
        assert status["tx_id"] == tx_id
        assert shown.returncode in (0, 3, 4, 5), shown
    finally:
        if coordinator is not None:
            coordinator.terminate()
            try:
                coordinator.wait(30)
            except subprocess.TimeoutExpired:
                coordinator.kill()
        deleted = _run([saga, "topics", "delete", "--yes"], env=env, timeout=120)
    assert f"{prefix}.requests: deleted" in _ok(deleted), deleted.stdout


def test_commands_that_need_an_extra_name_it(small_venv: Path, services: Services) -> None:
    env = _env(services, f"ci-{uuid.uuid4().hex[:10]}")
    saga = str(small_venv / "bin" / "saga")
    sql = _run(
        [
            saga,
            "participant",
            "run",
            "--name",
            "ledger",
            "--storage",
            "sql",
            "--targets",
            "accounts",
            "--url-env",
            "PG_URL",
        ],
        env={**env, "PG_URL": "postgresql://saga@127.0.0.1:1/saga"},
        timeout=120,
    )
    assert sql.returncode == 2, sql
    assert sql.stderr.strip() == (
        "saga: the sql storage needs the postgres extra (sqlalchemy is not installed): "
        "pip install 'saga-olep[postgres]'"
    ), sql.stderr
    audit = _run([saga, "reconcile"], env=env, timeout=120)
    assert audit.returncode == 2, audit
    assert audit.stderr.strip() == (
        "saga reconcile: the audit needs the spark extra (pyspark is not installed): "
        "pip install 'saga-olep[spark]'"
    ), audit.stderr
