"""The operator commands against real processes on the real services (issue #15).

A coordinator and two participants (``bank`` and ``slowpoke``, custom actions of
``tests.e2e.operator_handlers``) run as processes; every check goes through the
real ``saga`` command line as a subprocess, as an operator would type it:
``list`` (by state, age, saga name, participant), ``history`` (request, step
events, decision and status in order, with partitions and offsets), ``abort``
(honoured, already, not honoured, unknown), ``dlq list/show/redrive`` on a poison
record (the redrive shows in ``history``), ``resolve`` of a saga whose
compensation failed (it ends ``rolled_back``), and one ``saga reconcile`` run
whose operator actions list the abort, the resolve and the redrive.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from saga.streams import SagaState, Step
from tests._infra import Services, eventually
from tests._system import Proc, SagaSystem
from tests._workload import seed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SAGA = str(Path(sys.executable).parent / "saga")
HANDLERS = "tests.e2e.operator_handlers"
ROOT = Path(__file__).resolve().parents[2]


def _participant(system: SagaSystem, name: str) -> Proc:
    return system.start(
        f"participant-{name}",
        [
            "participant", "run", "--name", name, "--storage", "sql",
            "--url", system.services.postgres_url, "--schema", system.schema,
            "--targets", "accounts", "--handlers", HANDLERS,
        ],
    )  # fmt: skip


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    _, schema = pg_schema
    made = SagaSystem(services, tmp_path, schema, partitions=2)
    seed(made)
    made.create_topics()
    made.coordinator()
    _participant(made, "bank")
    slowpoke = _participant(made, "slowpoke")
    try:
        yield made
    finally:
        # Asleep in its step, it would not stop in time and would hold its schema.
        slowpoke.kill(signal.SIGKILL)
        made.stop_all()
        made.delete_topics()


def saga(system: SagaSystem, *args: str, extra_env: dict[str, str] | None = None) -> Any:
    """Run ``saga <args>`` as an operator would; the completed process."""
    return subprocess.run(
        [SAGA, *args],
        check=False,
        env={**system.env(), **(extra_env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def saga_json(system: SagaSystem, *args: str, code: int = 0) -> Any:
    done = saga(system, *args, "--json")
    assert done.returncode == code, (args, done.returncode, done.stdout, done.stderr)
    return json.loads(done.stdout)


def test_operator_commands_on_a_real_system(
    system: SagaSystem, services: Services, tmp_path: Path
) -> None:
    with system.client() as client:
        done = client.submit([Step("bank", "stick", {})], saga="shop-order", timeout=60)
        failing = client.submit(
            [Step("bank", "stick", {}), Step("bank", "refuse", {})], saga="refund", timeout=60
        )
        # The slow step holds its saga pending (no decision) while the operator looks.
        pending = client.submit(
            [Step("slowpoke", "slow", {"seconds": 45})], saga="slow-order", timeout=300
        )
        assert client.result(done, timeout=60).state is SagaState.COMMITTED
        assert client.result(failing, timeout=60).state is SagaState.FAILED

    # ---- list: by state, age, saga name and participant
    def listed(*args: str) -> set[str]:
        return {row["tx_id"] for row in saga_json(system, "list", *args)}

    eventually(lambda: pending in listed("--state", "pending"), timeout=30)
    assert listed("--state", "pending,failed") == {pending, failing}
    assert listed("--saga", "shop-order") == {done}
    assert listed("--participant", "slowpoke") == {pending}
    assert listed("--older-than", "1d") == set()
    eventually(lambda: listed("--state", "pending", "--older-than", "2s") == {pending}, timeout=30)
    (row,) = saga_json(system, "list", "--saga", "refund")
    assert row["state"] == "failed"
    assert row["steps"][0] == {"step": 0, "participant": "bank", "status": "compensation_failed"}
    table = saga(system, "list", "--limit", "5")
    assert table.returncode == 0 and "slow-order" in table.stdout, table.stderr
    bad = saga(system, "list", "--state", "stuck")
    assert bad.returncode == 2 and "unknown saga state" in bad.stderr
    assert "Traceback" not in bad.stderr

    # ---- history: every record of the committed saga, in order, with where it is
    entries = saga_json(system, "history", done)
    kinds = [e["kind"] for e in entries]
    for kind in ("saga.request", "saga.step", "saga.decision", "saga.status"):
        assert kind in kinds, kinds
    assert kinds.index("saga.request") < kinds.index("saga.step") < kinds.index("saga.decision")
    assert {e["partition"] for e in entries} == {entries[0]["partition"]}
    assert all(isinstance(e["offset"], int) and e["offset"] >= 0 for e in entries)
    stamps = [e["timestamp_ms"] for e in entries]
    assert stamps == sorted(stamps)
    decision = entries[kinds.index("saga.decision")]
    assert decision["topic"].endswith(".decisions")
    assert decision["summary"] == "commit: all steps applied"
    shown = saga(system, "history", done)
    assert shown.returncode == 0 and "saga.decision" in shown.stdout

    # ---- abort: honoured, then already; not honoured for a committed saga; unknown
    first = saga_json(system, "abort", pending, "--reason", "customer left", "--by", "ann")
    assert first["verdict"] == "honoured" and first["state"] in ("rolling_back", "rolled_back")
    assert "aborted by operator ann: customer left" in first["reason"]
    again = saga(system, "abort", pending)
    assert again.returncode == 0 and "already rolled back" in again.stdout, again
    late = saga(system, "abort", done)
    assert late.returncode == 3 and "not honoured" in late.stdout, late
    unknown = saga(system, "abort", "no-such-saga-42")
    assert unknown.returncode == 2 and "unknown transaction" in unknown.stderr, unknown

    # ---- dlq: a poison record is listed, shown, redriven, and shows in history
    poison = f"poison-{system.prefix[-8:]}"
    with system.producer() as producer:
        producer.produce(system.settings.topics.requests, poison, b"this is not json")
        producer.flush(30)

    def dead_letter_of_poison() -> dict[str, Any] | None:
        letters = saga_json(system, "dlq", "list", "--topic", "requests")
        return next((d for d in letters if d["tx_id"] == poison), None)

    letter = eventually(dead_letter_of_poison, timeout=60)
    assert letter["component"] == "coordinator" and "JSON" in letter["reason"]
    detail = saga_json(system, "dlq", "show", letter["dlq"])
    assert detail["value"] == "this is not json" and detail["value_encoding"] == "utf-8"
    assert detail["source_topic"] == system.settings.topics.requests
    assert "saga.error" in detail["headers"]
    assert saga(system, "dlq", "show", "99:0").returncode == 2
    redriven = saga(system, "dlq", "redrive", letter["dlq"], "--yes", "--by", "ann")
    assert redriven.returncode == 0 and "redriven to" in redriven.stdout, redriven

    def poison_history() -> list[str] | None:
        found = [e["kind"] for e in saga_json(system, "history", poison)]
        return found if found.count("dlq") == 2 else None  # rejected again: still poison

    poisoned = eventually(poison_history, timeout=60)
    assert poisoned[:3] == ["invalid", "dlq", "redrive"], poisoned

    # ---- resolve: the failed compensation handled by hand ends the saga rolled back
    refused = saga(system, "resolve", failing, "--step", "1", "--note", "n/a")
    assert refused.returncode == 2 and "no failed compensation" in refused.stderr, refused
    resolved = saga_json(
        system, "resolve", failing, "--step", "0", "--note", "refunded by hand", "--by", "ann"
    )
    assert resolved["verdict"] == "honoured" and resolved["state"] == "rolled_back", resolved
    assert "resolved by hand by ann" in resolved["reason"]
    trail = saga_json(system, "history", failing)
    (record,) = [e for e in trail if e["kind"] == "saga.resolve"]
    assert record["record"]["note"] == "refunded by hand" and record["record"]["by"] == "ann"
    assert trail[-1]["kind"] == "saga.status" and trail[-1]["record"]["state"] == "rolled_back"

    # ---- reconcile's view: the abort, the resolve and the redrive, per transaction
    report = saga(
        system, "reconcile", "--json", "--grace", "1s", "--out", str(tmp_path / "reconcile"),
        extra_env={"SAGA_SPARK_JARS": str(services.spark_jars_dir)},
    )  # fmt: skip
    assert report.returncode in (0, 1), report.stderr[-3000:]
    summary = json.loads(report.stdout)
    actions = {(a["tx_id"], a["action"]) for a in summary["operator_actions"]["actions"]}
    assert {(pending, "abort"), (failing, "resolve"), (poison, "redrive")} <= actions, actions
    (resolve_action,) = [
        a for a in summary["operator_actions"]["actions"] if a["action"] == "resolve"
    ]
    assert resolve_action["by"] == "ann" and resolve_action["step"] == 0
    assert summary["classes"]["resolved_by_hand"] == 1
    assert summary["classes"]["compensation_failed"] == 0
