"""Crash tests: kill -9 participants and coordinators at the protocol's critical points.

The fault points of ``streams._faults`` (armed through ``SAGA_FAULTS``) SIGKILL a
process exactly between two steps of its protocol; ``Proc.kill()`` kills at
arbitrary moments under load. After each crash the process is restarted (a
coordinator with the same ``--instance-id``) and the transfer workload of
``tests/_workload.py`` must still finish with docs/architecture.md §6 intact: every saga
final, one decision per transaction, each step applied at most once.

The processes run with a 6 s Kafka session timeout (``SAGA_KAFKA_SESSION_TIMEOUT_MS``,
also the processes' default): a participant restarted without ``--worker-id`` (a
dynamic group member) can only take the partitions over once the group has given up on
the killed one; a coordinator restarted with the same ``--instance-id`` is the same
static member and takes back its own at once (tests/e2e/test_recovery.py).
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from saga.streams import SagaState, StepEvent, StepStatus
from saga.streams.kafka import Consumer
from tests._infra import Services, eventually
from tests._system import Proc, SagaSystem
from tests._workload import (
    SESSION_TIMEOUT_MS,
    check_invariants,
    final_count,
    ledger_rows,
    make_transfers,
    seeded_system,
    submit_all,
    wait_all_final,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

TAKEOVER_S = SESSION_TIMEOUT_MS / 1000 + 60  # session expiry + rebalance + restore + slack


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with seeded_system(services, pg_schema[1], tmp_path) as s:
        yield s


def wait_killed(proc: Proc, what: str) -> None:
    eventually(
        lambda: not proc.alive,
        timeout=60,
        message=f"{what} did not hit its fault point",
    )
    assert proc.popen is not None
    assert proc.popen.returncode == -signal.SIGKILL, (proc.popen.returncode, proc.log())


def events_of(system: SagaSystem, participant: str) -> list[StepEvent]:
    """``participant``'s step events (its ``saga.committed`` records as one per step)."""
    return [e for e in system.step_events() if e.participant == participant]


def committed_offsets(system: SagaSystem, group: str, topic: str) -> dict[int, int | None]:
    reader = Consumer(system.settings, group_id=group, client_id="test-offsets")
    try:
        n = reader.list_partitions(topic)
        got = reader.committed([(topic, p) for p in range(n)])
        return {p: off for (_, p), off in got.items()}
    finally:
        reader.close()


# ---------------------------------------------------------------- participant crashes


def test_participant_killed_between_local_commit_and_events(system: SagaSystem) -> None:
    """participant.after_local_commit: the storage committed the first batch, the events
    were never sent. The restarted participant re-reads the batch, its ledger turns the
    repeat into re-emitted events, and no step takes effect twice."""
    transfers = make_transfers(60, tag="lc")
    system.coordinator()
    system.participant("shop", ["orders"])
    with system.client() as client:
        submit_all(client, transfers)
        # The whole load is in the log before the bank starts: its first batch holds
        # requests, so the crash comes right after a local commit with real work in it.
        bank = system.participant(
            "bank", ["accounts"], faults="participant.after_local_commit:1", tag="-faulty"
        )
        wait_killed(bank, "the bank participant")
        recorded_locally = {
            (tx, step) for who, tx, step, _, _ in ledger_rows(system) if who == "bank"
        }
        assert recorded_locally, "the crashed batch committed nothing locally"
        reported = {(e.tx_id, e.step) for e in events_of(system, "bank")}
        assert not reported, f"events were sent before the crash: {sorted(reported)[:5]}"

        system.participant("bank", ["accounts"])
        finals = wait_all_final(client, [t.tx_id for t in transfers], timeout=TAKEOVER_S + 60)

    states = check_invariants(system, transfers, finals)
    assert states["committed"] > 0 and states["rolled_back"] > 0, states
    # The locally committed steps were reported once the participant came back.
    reported = {(e.tx_id, e.step) for e in events_of(system, "bank")}
    assert recorded_locally <= reported


def test_participant_killed_between_events_and_offset_commit(system: SagaSystem) -> None:
    """participant.after_events: the events of the first batch are in the log, its input
    offsets are not committed. The restarted participant reads the batch again (with
    the decisions that the events led to meanwhile): the ledger re-reports what was
    done, and nothing takes effect twice."""
    transfers = make_transfers(60, tag="ev")
    system.coordinator()
    system.participant("shop", ["orders"])
    with system.client() as client:
        submit_all(client, transfers)
        bank = system.participant(
            "bank", ["accounts"], faults="participant.after_events:1", tag="-faulty"
        )
        wait_killed(bank, "the bank participant")
        first = events_of(system, "bank")
        assert first, "the crashed batch emitted no events"
        offsets = committed_offsets(
            system, f"{system.prefix}.participant.bank", system.settings.topics.requests
        )
        assert all(off is None for off in offsets.values()), offsets

        system.participant("bank", ["accounts"])
        finals = wait_all_final(client, [t.tx_id for t in transfers], timeout=TAKEOVER_S + 60)

    states = check_invariants(system, transfers, finals)
    assert states["committed"] > 0 and states["rolled_back"] > 0, states
    # Every step reported before the crash was settled after it: compensated, or confirmed
    # by its saga's commit (a built-in step at read_committed writes then reports it).
    done = {tx for tx, status in finals.items() if status.state is SagaState.COMMITTED}
    settled = {
        (e.tx_id, e.step)
        for e in events_of(system, "bank")
        if e.status is StepStatus.COMPENSATED
        or (e.status is StepStatus.COMMITTED and e.tx_id in done)
    }
    assert {(e.tx_id, e.step) for e in first} <= settled


# ---------------------------------------------------------------- coordinator crashes


@pytest.mark.parametrize("point", ["coordinator.after_read", "coordinator.before_commit"])
def test_coordinator_killed_mid_batch(system: SagaSystem, point: str) -> None:
    """The coordinator dies with records read and nothing decided (after_read), or with
    decisions produced inside a Kafka transaction that never commits (before_commit).
    Restarted with the same instance id, it fences its predecessor, re-reads the batch and
    decides every saga exactly once."""
    transfers = make_transfers(60, tag="co")
    system.participant("bank", ["accounts"])
    system.participant("shop", ["orders"])
    with system.client() as client:
        submit_all(client, transfers)
        # Let the participants answer every request first, so the coordinator's first
        # batch holds requests and events: enough to decide most sagas at once.
        eventually(
            lambda: len(system.read_topic(system.settings.topics.events)) >= 3 * len(transfers),
            timeout=60,
            message="the participants did not answer the requests",
        )
        faulty = system.coordinator("c1", faults=f"{point}:1")
        wait_killed(faulty, "the coordinator")
        # Nothing it did is visible to read_committed readers.
        assert system.read_topic(system.settings.topics.decisions) == []
        if point == "coordinator.after_read":  # its very first batch
            assert system.read_topic(system.settings.topics.status) == []
        # (before_commit fires only in a batch with decisions. Whether they reached the
        # broker before the kill depends on librdkafka's send queue; those that did stay
        # in an aborted transaction, and check_invariants finds one decision per tx.)

        restarted = system.coordinator("c1")
        # More load after the restart: the new instance keeps working.
        more = make_transfers(20, tag="co2")
        submit_all(client, more)
        transfers += more
        finals = wait_all_final(client, [t.tx_id for t in transfers], timeout=TAKEOVER_S + 60)
        assert restarted.alive

    states = check_invariants(system, transfers, finals)
    assert states["committed"] > 0 and states["rolled_back"] > 0, states


# ---------------------------------------------------------------- kills at random moments


def test_random_kills_under_load(system: SagaSystem) -> None:
    """kill -9 of the bank participant and of the coordinator at random points of a running
    load (not at a fault point); each is restarted at once. Every saga still finishes with
    one decision and every step applied at most once."""
    rnd = random.Random()
    bank_at, coordinator_at = rnd.randint(1, 40), rnd.randint(55, 90)
    print(f"kill -9: the bank after {bank_at} final sagas, the coordinator after {coordinator_at}")
    transfers = make_transfers(150, tag="rk", sequential_every=5)
    waves = [transfers[:50], transfers[50:100], transfers[100:]]
    coordinator = system.coordinator("r")
    bank = system.participant("bank", ["accounts"])
    system.participant("shop", ["orders"])
    ids = [t.tx_id for t in transfers]
    with system.client() as client:
        submit_all(client, waves[0])
        # Kill the bank once a random share of the first wave is done, mid-flight.
        eventually(lambda: final_count(client, ids) >= bank_at, timeout=60, message="no progress")
        submit_all(client, waves[1])
        assert bank.alive
        bank.kill()
        system.participant("bank", ["accounts"], tag="-2")
        # Kill the coordinator somewhere in the second wave.
        eventually(
            lambda: final_count(client, ids) >= coordinator_at,
            timeout=TAKEOVER_S + 30,
            message="stalled",
        )
        submit_all(client, waves[2])
        assert coordinator.alive
        coordinator.kill()
        system.coordinator("r")
        finals = wait_all_final(client, ids, timeout=TAKEOVER_S + 60)

    states = check_invariants(system, transfers, finals)
    assert states["committed"] > 0 and states["rolled_back"] > 0, states
