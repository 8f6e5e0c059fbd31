"""Stuck sagas on a real system finish after ``saga reconcile --replay``.

Two ways a saga gets stuck, both made on purpose with real coordinator and
participant processes (``tests/_system.py``) and the transfer workload:

* **lost decision** (``stuck_unfinished``): the ``shop`` participant is stopped
  until the deadline passes, so the coordinator rolls back; then its consumer
  group is moved to the end of the log (an operator's mistaken offset reset), so
  it never hears of the request or the rollback. The bank compensated; the shop
  step never answers.
* **lost request** (``stuck_no_decision``): the coordinator is stopped, the saga
  is submitted and applied by both participants, and the coordinator's group is
  moved past the request: it sees the ``applied`` events but never the request,
  so it never decides.

The job finds them (and only them), a dry run changes nothing, ``--replay``
makes them finish, and a second replay sends nothing and changes nothing. With
many stuck sagas, the job killed with SIGKILL half-way through its replay and
run again leaves no transaction with two different decisions (and only the
coordinator's own decision per transaction, besides byte-identical replays) and
no step applied twice: balances, orders and ledgers are exactly those of the
committed transfers, and a final audit with the SQL ledger is clean.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from saga.streams import Decision, SagaState, StepStatus, decode
from saga.streams.kafka import Consumer
from saga.streams.reconcile import ReconcileConfig, parse_ledger, run
from saga.streams.reconcile._spark import check_jars, start_spark
from tests._infra import ROOT, Services, eventually
from tests._system import SagaSystem
from tests._workload import (
    ACCOUNTS,
    DUPLICATE_ORDER,
    START_BALANCE,
    Transfer,
    balances,
    ledger_rows,
    make_transfers,
    orders,
    seeded_system,
    submit_all,
    wait_all_final,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

GRACE_S = 2
TIMEOUT_S = 3.0  # the sagas' deadline


@pytest.fixture(scope="module")
def spark(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from saga.streams.kafka import KafkaSettings

    config = ReconcileConfig(
        settings=KafkaSettings(bootstrap=services.kafka_bootstrap),
        out=tmp_path_factory.mktemp("unused"),
        master="local[2]",
        driver_memory="1g",
        shuffle_partitions=4,
    )
    session = start_spark(config, check_jars(services.spark_jars_dir))
    yield session
    session.stop()


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with seeded_system(services, pg_schema[1], tmp_path) as s:
        yield s


# ---------------------------------------------------------------- making sagas stuck


def skip_to_end(system: SagaSystem, group: str, topics: list[str]) -> None:
    """Commit the end of ``topics`` for ``group`` (whose members are all stopped)."""
    consumer = Consumer(system.settings, group_id=group, client_id="test-skip")
    try:
        offsets = {}
        for topic in topics:
            for p in range(consumer.list_partitions(topic)):
                offsets[(topic, p)] = consumer.watermarks(topic, p)[1]

        def committed() -> bool:
            consumer.commit(offsets)
            return True

        # The group may still be settling after its last member left.
        eventually(committed, timeout=60, interval=1, retry_on=(Exception,))
    finally:
        consumer.close()


# The coordinator's own re-drive of stalled decisions would send the lost decisions again
# by itself (30 s after the saga stalls): it would un-stick the sagas the job must find
# and write to the log during the dry run. Off here: the job's replay is under test
# (tests/e2e/test_redrive.py tests the re-drive).
NO_REDRIVE = ("--redrive-after", "off")


def coordinator(system: SagaSystem) -> None:
    system.coordinator(extra=NO_REDRIVE)


def stop(system: SagaSystem, name: str) -> None:
    for proc in system.procs:
        if proc.name == name and proc.alive:
            proc.kill(signal.SIGTERM)


def lost_decisions(system: SagaSystem, client: Any, transfers: list[Transfer]) -> None:
    """The shop is down past the deadline (rollback), then its group skips the whole log."""
    stop(system, "participant-shop")
    submit_all(client, transfers, timeout=TIMEOUT_S)

    def rolled_back_at_the_bank() -> bool:
        snap = client.statuses()
        return all(
            (s := snap.get(t.tx_id)) is not None
            and s.state is SagaState.ROLLING_BACK
            and [p.status for p in s.steps[:2]] == [StepStatus.COMPENSATED] * 2
            for t in transfers
        )

    eventually(rolled_back_at_the_bank, timeout=90, message="the bank did not compensate")
    t = system.settings.topics
    skip_to_end(system, f"{system.prefix}.participant.shop", [t.requests, t.decisions, t.events])


def lost_requests(system: SagaSystem, client: Any, transfers: list[Transfer]) -> None:
    """The coordinator is down while the sagas are applied, then its group skips the requests."""
    stop(system, "coordinator-0")
    submit_all(client, transfers, timeout=TIMEOUT_S)
    wanted = {(t.tx_id, step) for t in transfers for step in range(3)}

    def all_applied() -> bool:
        applied = {
            (e.tx_id, e.step) for e in system.step_events() if e.status is StepStatus.APPLIED
        }
        return wanted <= applied

    eventually(all_applied, timeout=90, message="the participants did not apply every step")
    skip_to_end(system, f"{system.prefix}.coordinator", [system.settings.topics.requests])
    coordinator(system)
    time.sleep(TIMEOUT_S + GRACE_S + 1)  # past every deadline and the grace period


# ---------------------------------------------------------------- checks


def audit(
    spark: Any, system: SagaSystem, out: Path, *, replay: bool, ledgers: bool = False
) -> dict[str, Any]:
    specs = (f"sql:{system.services.postgres_url}#schema={system.schema}",) if ledgers else ()
    config = ReconcileConfig(
        settings=system.settings,
        out=out,
        grace_ms=GRACE_S * 1000,
        ledgers=tuple(parse_ledger(s) for s in specs),
        replay=replay,
        write_all=True,
    )
    summary: dict[str, Any] = run(config, spark=spark, say=lambda _: None).summary
    return summary


def classes(spark: Any, out: Path) -> dict[str, str]:
    return {
        r["tx_id"]: r["class"]
        for r in spark.read.parquet(str(out / "findings")).select("tx_id", "class").collect()
    }


def decisions(system: SagaSystem) -> dict[str, list[tuple[Decision, bool]]]:
    """Per transaction: its decision records, and whether each is a replay."""
    found: dict[str, list[tuple[Decision, bool]]] = defaultdict(list)
    for m in system.read_messages(system.settings.topics.decisions):
        record = decode(m.value)
        assert isinstance(record, Decision)
        found[record.tx_id].append((record, m.header("saga.replayed.by") is not None))
    return found


def record_count(system: SagaSystem) -> int:
    t = system.settings.topics
    return sum(len(system.read_messages(topic)) for topic in (t.requests, t.decisions))


def check_stores(
    system: SagaSystem, committed: list[Transfer], rolled_back: list[Transfer]
) -> None:
    """Each committed transfer took effect exactly once, each rolled-back one not at all."""
    expected = dict.fromkeys(ACCOUNTS, START_BALANCE)
    for t in committed:
        expected[t.src] -= t.amount
        expected[t.dst] += t.amount
    assert balances(system) == expected
    assert orders(system) == {DUPLICATE_ORDER} | {t.order for t in committed}
    rows = ledger_rows(system)
    per_step = Counter((tx, step) for _, tx, step, _, _ in rows)
    assert max(per_step.values()) == 1
    by_tx: dict[str, dict[int, tuple[str, bool]]] = defaultdict(dict)
    for _, tx, step, status, effect in rows:
        by_tx[tx][step] = (status, effect)
    for t in committed:
        # built-in steps at read_committed: the commit confirms them
        assert by_tx[t.tx_id] == dict.fromkeys(range(3), ("committed", True)), t
    for t in rolled_back:
        entries = by_tx[t.tx_id]
        assert entries[0][0] == entries[1][0] == "compensated", (t, entries)
        assert entries[2] == ("compensated", False), (t, entries)


# ---------------------------------------------------------------- tests


def test_stuck_sagas_finish_after_replay_and_a_second_replay_changes_nothing(
    system: SagaSystem, spark: Any, tmp_path: Path
) -> None:
    coordinator(system)
    system.participant("bank", ["accounts"])
    system.participant("shop", ["orders"])
    unfinished = make_transfers(2, tag="lostdec", fail_every=0)
    undecided = make_transfers(2, tag="lostreq", fail_every=0)
    with system.client() as client:
        fine = make_transfers(3, tag="fine", fail_every=0)
        submit_all(client, fine)
        wait_all_final(client, [t.tx_id for t in fine], timeout=90)

        lost_decisions(system, client, unfinished)
        system.participant("shop", ["orders"])
        lost_requests(system, client, undecided)

        # The dry run finds exactly the stuck sagas, and sends nothing.
        before = record_count(system)
        summary = audit(spark, system, tmp_path / "dry", replay=False)
        found = {tx: c for tx, c in classes(spark, tmp_path / "dry").items() if c != "ok"}
        assert found == {
            **{t.tx_id: "stuck_unfinished" for t in unfinished},
            **{t.tx_id: "stuck_no_decision" for t in undecided},
        }, summary
        assert summary["exit_code"] == 1
        assert summary["replay"]["planned"] == 2 * len(unfinished) + len(undecided)
        assert summary["replay"]["sent"] == 0
        time.sleep(2)
        assert record_count(system) == before
        assert all(client.status(t.tx_id).state is SagaState.ROLLING_BACK for t in unfinished)

        # --replay: every stuck saga finishes.
        summary = audit(spark, system, tmp_path / "replay", replay=True)
        assert summary["replay"]["sent"] == summary["replay"]["planned"] == 6
        finals = wait_all_final(client, [t.tx_id for t in unfinished + undecided], timeout=90)
        assert {finals[t.tx_id].state for t in unfinished} == {SagaState.ROLLED_BACK}
        assert {finals[t.tx_id].state for t in undecided} == {SagaState.COMMITTED}
        check_stores(system, fine + undecided, unfinished)

        # A second replay finds nothing to do, sends nothing and changes nothing.
        eventually(
            lambda: audit(spark, system, tmp_path / "again", replay=True)["exit_code"] == 0,
            timeout=60,
            interval=1,
            message="the log did not settle after the replay",
        )
        again = audit(spark, system, tmp_path / "again2", replay=True, ledgers=True)
        assert again["exit_code"] == 0, again
        assert again["replay"]["planned"] == again["replay"]["sent"] == 0
        assert again["invariants"] == dict.fromkeys(("I1", "I2", "I3", "I4", "I6", "I7"), 0)
        check_stores(system, fine + undecided, unfinished)


def test_kill_9_mid_replay_then_rerun(
    system: SagaSystem, spark: Any, services: Services, tmp_path: Path
) -> None:
    coordinator(system)
    system.participant("bank", ["accounts"])
    system.participant("shop", ["orders"])
    unfinished = make_transfers(15, tag="kdec", fail_every=0)
    undecided = make_transfers(15, tag="kreq", fail_every=0)
    everything = [t.tx_id for t in unfinished + undecided]
    with system.client() as client:
        lost_decisions(system, client, unfinished)
        system.participant("shop", ["orders"])
        lost_requests(system, client, undecided)

        # The job, replaying 10 records a second, killed (the driver and its JVM) once
        # a few of its 45 records are out.
        job = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "saga.streams.reconcile",
                "--replay",
                "--replay-rate",
                "10",
                "--grace",
                f"{GRACE_S}s",
                "--out",
                str(tmp_path / "killed"),
            ],
            cwd=ROOT,
            env={
                **system.env(),
                "SAGA_SPARK_JARS": str(services.spark_jars_dir),
            },
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        progress: list[int] = []

        def follow() -> None:
            assert job.stderr is not None
            for line in job.stderr:
                if "replayed " in line:
                    progress.append(int(line.rsplit("replayed ", 1)[1].split("/")[0]))

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        try:
            eventually(lambda: progress and progress[-1] >= 5, timeout=180, interval=0.05)
        finally:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
        reader.join(10)
        assert 5 <= progress[-1] < 45, progress
        assert job.returncode == -signal.SIGKILL

        # Run again: what is still stuck is replayed; the rest is left alone.
        summary = audit(spark, system, tmp_path / "rerun", replay=True)
        assert 0 < summary["replay"]["sent"] <= 45
        finals = wait_all_final(client, everything, timeout=120)

    assert {finals[t.tx_id].state for t in unfinished} == {SagaState.ROLLED_BACK}
    assert {finals[t.tx_id].state for t in undecided} == {SagaState.COMMITTED}
    # One outcome per transaction, decided once by the coordinator; the rest are replays.
    per_tx = decisions(system)
    for tx in everything:
        records = per_tx[tx]
        assert len({d.outcome for d, _ in records}) == 1, records
        assert sum(1 for _, replayed in records if not replayed) == 1, records
        assert len({d for d, _ in records}) == 1, records  # replays are byte-identical
    # No step applied twice: the stores hold exactly the committed transfers.
    check_stores(system, undecided, unfinished)
    final = eventually(
        lambda: (
            (s := audit(spark, system, tmp_path / "final", replay=False, ledgers=True))["exit_code"]
            == 0
            and s
        ),
        timeout=60,
        interval=1,
        message="the final audit is not clean",
    )
    assert final["classes"]["ok"] == len(everything)
