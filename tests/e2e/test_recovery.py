"""Recovery in seconds: static group membership on the real Kafka.

Two coordinators (``--instance-id a`` and ``b``) and two workers of the ``bank``
participant (``--worker-id w1`` and ``w2``) are static members of their groups
(Kafka's ``group.instance.id``), with the processes' default 6 s session timeout:

* a worker or coordinator killed with SIGKILL and restarted with the same id takes
  back exactly its partitions, without a rebalance: the other member's partitions never
  move, and the restarted one owns its own again within seconds of its start (it does
  not wait for the session of its killed predecessor to expire); sagas go on;
* a worker killed for good loses its partitions to the survivor within the session
  timeout and a margin (the bound is the point of the test: librdkafka's own default
  would keep them idle for 45 s).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from saga.streams.kafka._settings import GROUP_SESSION_TIMEOUT_MS
from tests._infra import Services, eventually
from tests._system import Proc, SagaSystem
from tests._workload import (
    check_invariants,
    make_transfers,
    seed,
    submit_all,
    wait_all_final,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PARTITIONS = 4
SESSION_S = GROUP_SESSION_TIMEOUT_MS / 1000
# A restarted process: Python's start on a busy CI machine, the broker check, the storage
# set-up, then one JoinGroup/SyncGroup round. A rebalance would add the killed member's
# whole session timeout on top, and would show in the other member's assignment.
RESTART_S = 20.0
# Gone for good: the session timeout, then the rebalance (members learn of it at their next
# heartbeat, a sixth of the session) and its JoinGroup/SyncGroup rounds.
TAKEOVER_MARGIN_S = 6.0

Owned = dict[str, frozenset[tuple[str, int]]]
Members = dict[str, str]  # group.instance.id -> the member id the broker gave it


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    # No SAGA_KAFKA_SESSION_TIMEOUT_MS: the processes' own default is under test.
    s = SagaSystem(services, tmp_path, pg_schema[1], partitions=PARTITIONS)
    seed(s)
    with s.opened():
        yield s


def worker(system: SagaSystem, name: str, worker_id: str) -> Proc:
    return system.start(
        f"participant-{name}-{worker_id}",
        [
            "participant", "run", "--name", name, "--storage", "sql",
            "--url", system.services.postgres_url, "--schema", system.schema,
            "--targets", "accounts" if name == "bank" else "orders",
            "--worker-id", worker_id,
        ],
    )  # fmt: skip


def members(system: SagaSystem, group: str) -> tuple[Owned, Members]:
    """Per ``group.instance.id`` of ``group``: the partitions it owns, and its member id.

    A killed static member stays in the group (with its partitions) until its session
    expires; the process that takes its place gets a new member id.
    """
    admin = AdminClient({"bootstrap.servers": system.services.kafka_bootstrap})
    description = admin.describe_consumer_groups([group])[group].result(timeout=10)
    found = {
        str(m.group_instance_id): (
            frozenset((tp.topic, tp.partition) for tp in m.assignment.topic_partitions),
            str(m.member_id),
        )
        for m in description.members
    }
    return {k: v[0] for k, v in found.items()}, {k: v[1] for k, v in found.items()}


def owned(system: SagaSystem, group: str) -> Owned:
    """``group.instance.id`` -> the partitions it owns, for every member of ``group``."""
    return members(system, group)[0]


def spread(system: SagaSystem, group: str, members: int) -> Owned | None:
    """The group's ownership once ``members`` members share every partition, else None."""
    try:
        found = owned(system, group)
    except Exception:  # the group may not exist yet
        return None
    parts = [p for p in found.values() if p]
    if len(parts) == members and sum(len(p) for p in parts) == 3 * PARTITIONS:
        return found
    return None


def started(system: SagaSystem, group: str, members: int) -> Owned:
    found: list[Owned] = []

    def ready() -> bool:
        now = spread(system, group, members)
        if now is not None:
            found.append(now)
        return now is not None

    eventually(ready, timeout=90, message=f"{group} did not spread over {members} members")
    return found[-1]


def watch_restart(
    system: SagaSystem, group: str, before: Owned, member: str, killed_id: str, restart: Proc
) -> tuple[float, list[Owned]]:
    """Poll ``group`` until ``member``, as a new member id (the restarted process, not
    ``killed_id``), owns its partitions of ``before`` again.

    Returns the seconds from the restart to then, and every ownership seen meanwhile.
    """
    t0 = time.monotonic()
    seen: list[Owned] = []
    while time.monotonic() - t0 < RESTART_S + 30:
        assert restart.alive, restart.log()[-2000:]
        try:
            now, ids = members(system, group)
        except Exception:  # a describe can time out on a busy broker: poll again
            now, ids = {}, {}
        if now:
            seen.append(now)
        if now.get(member) == before[member] and ids.get(member) not in (None, killed_id):
            return time.monotonic() - t0, seen
        time.sleep(0.2)
    raise AssertionError(f"{member} did not get its partitions back: {seen[-3:]}")


def test_a_restarted_worker_and_coordinator_take_back_their_own_partitions(
    system: SagaSystem,
) -> None:
    prefix = system.prefix
    coordinators = {i: system.coordinator(i) for i in ("a", "b")}
    banks = {w: worker(system, "bank", w) for w in ("w1", "w2")}
    worker(system, "shop", "s1")
    bank_group, coordinator_group = f"{prefix}.participant.bank", f"{prefix}.coordinator"
    banks_before = started(system, bank_group, 2)
    coordinators_before = started(system, coordinator_group, 2)
    w1, w2 = f"{prefix}.participant.bank.w1", f"{prefix}.participant.bank.w2"
    ca, cb = f"{prefix}.coordinator.a", f"{prefix}.coordinator.b"
    assert banks_before[w1] and banks_before[w2], banks_before

    transfers = make_transfers(80, tag="rs", fail_every=5, sequential_every=8)
    ids = [t.tx_id for t in transfers]
    with system.client() as client:
        submit_all(client, transfers[:40])
        killed_id = members(system, bank_group)[1][w1]
        banks["w1"].kill()  # SIGKILL: no LeaveGroup, as in a crash
        restarted = worker(system, "bank", "w1")
        took, seen = watch_restart(system, bank_group, banks_before, w1, killed_id, restarted)
        # No rebalance: the survivor's partitions never moved, nobody else got w1's.
        assert all(o.get(w2, banks_before[w2]) == banks_before[w2] for o in seen), seen
        print(f"worker w1 restarted: its partitions back {took:.1f}s after the restart")
        assert took < RESTART_S, f"worker w1 owned its partitions again after {took:.1f}s"

        killed_id = members(system, coordinator_group)[1][ca]
        coordinators["a"].kill()
        restarted_a = system.coordinator("a")
        took_c, seen_c = watch_restart(
            system, coordinator_group, coordinators_before, ca, killed_id, restarted_a
        )
        assert all(o.get(cb, coordinators_before[cb]) == coordinators_before[cb] for o in seen_c)
        print(f"coordinator a restarted: its partitions back {took_c:.1f}s after the restart")
        assert took_c < RESTART_S, f"coordinator a owned its partitions again after {took_c:.1f}s"

        submit_all(client, transfers[40:])
        finals = wait_all_final(client, ids, timeout=120)
    check_invariants(system, transfers, finals)
    assert coordinators["b"].alive and banks["w2"].alive


def test_a_worker_gone_for_good_loses_its_partitions_within_the_session_timeout(
    system: SagaSystem,
) -> None:
    prefix = system.prefix
    system.coordinator("a")
    banks = {w: worker(system, "bank", w) for w in ("w1", "w2")}
    worker(system, "shop", "s1")
    group = f"{prefix}.participant.bank"
    started(system, group, 2)
    started(system, f"{prefix}.coordinator", 1)
    w2 = f"{prefix}.participant.bank.w2"

    banks["w1"].kill()
    killed = time.monotonic()
    took: list[float] = []

    def survivor_owns_all() -> bool:
        now = spread(system, group, 1)
        if now is None or not now.get(w2):
            return False
        took.append(time.monotonic() - killed)
        return True

    eventually(
        survivor_owns_all,
        timeout=SESSION_S + TAKEOVER_MARGIN_S,
        interval=0.2,
        message=f"w2 did not own every partition within {SESSION_S + TAKEOVER_MARGIN_S:.0f}s",
    )
    print(f"worker w1 gone for good: w2 owned its partitions {took[-1]:.1f}s after the kill")
    assert took[-1] >= SESSION_S - 1, f"taken over after {took[-1]:.1f}s: before the session?"

    transfers = make_transfers(20, tag="gone", fail_every=5, sequential_every=6)
    with system.client() as client:
        submit_all(client, transfers)
        finals = wait_all_final(client, [t.tx_id for t in transfers], timeout=90)
    check_invariants(system, transfers, finals)
    assert banks["w2"].alive
