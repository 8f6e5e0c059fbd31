"""Scale-out: two coordinators and two workers per participant share the partitions.

Two ``saga coordinator run`` processes (``--instance-id a`` and ``b``) form one
consumer group; two ``saga participant run --name bank`` and two ``--name shop``
processes form one group per participant. Mid-load one coordinator and one bank
worker are killed with SIGKILL and not restarted: the survivors must take their
partitions over (once the group's session timeout has expired; the library
default is librdkafka's 45 s, shortened here to the broker's 6 s minimum with
``SAGA_KAFKA_SESSION_TIMEOUT_MS``), rebuild the state from the status topic and
finish every saga: one decision per transaction, money conserved, every step
applied at most once.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from tests._infra import Services, eventually
from tests._system import SagaSystem
from tests._workload import (
    SESSION_TIMEOUT_MS,
    check_invariants,
    final_count,
    make_transfers,
    seeded_system,
    submit_all,
    wait_all_final,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PARTITIONS = 6


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with seeded_system(services, pg_schema[1], tmp_path, partitions=PARTITIONS) as s:
        yield s


def assignments(system: SagaSystem, group: str) -> list[tuple[str, set[tuple[str, int]]]]:
    """``(client_id, partitions)`` of every member of a consumer group."""
    admin = AdminClient({"bootstrap.servers": system.services.kafka_bootstrap})
    description = admin.describe_consumer_groups([group])[group].result(timeout=10)
    return [
        (
            m.client_id,
            {(tp.topic, tp.partition) for tp in m.assignment.topic_partitions},
        )
        for m in description.members
    ]


def spread(system: SagaSystem, group: str, members: int) -> bool:
    """Whether ``members`` members of ``group`` share every partition of the three topics."""
    try:
        found = assignments(system, group)
    except Exception:  # the group may not exist yet
        return False
    owned = [parts for _, parts in found if parts]
    return len(owned) == members and sum(len(p) for p in owned) == 3 * PARTITIONS


def test_survivors_take_over_killed_coordinator_and_participant(system: SagaSystem) -> None:
    coordinators = {i: system.coordinator(i) for i in ("a", "b")}
    banks = [system.participant("bank", ["accounts"], tag=f"-{i}") for i in (1, 2)]
    for i in (1, 2):
        system.participant("shop", ["orders"], tag=f"-{i}")
    prefix = system.prefix
    for group in (f"{prefix}.coordinator", f"{prefix}.participant.bank"):
        eventually(
            partial(spread, system, group, 2),
            timeout=60,
            message=f"{group} did not spread over two members",
        )
    # The coordinator we kill owns partitions of its own.
    owned_by_a = [
        parts for cid, parts in assignments(system, f"{prefix}.coordinator") if cid.endswith(".a")
    ]
    assert owned_by_a and owned_by_a[0], owned_by_a

    transfers = make_transfers(300, tag="so", fail_every=6, sequential_every=10)
    ids = [t.tx_id for t in transfers]
    with system.client() as client:
        submit_all(client, transfers[:150])
        eventually(lambda: final_count(client, ids) >= 40, timeout=60, message="no progress")
        submit_all(client, transfers[150:])
        assert coordinators["a"].alive and banks[0].alive
        coordinators["a"].kill()
        banks[0].kill()
        finals = wait_all_final(client, ids, timeout=SESSION_TIMEOUT_MS / 1000 + 90)

    states = check_invariants(system, transfers, finals)
    assert states["committed"] > 0 and states["rolled_back"] > 0, states
    assert coordinators["b"].alive and banks[1].alive
    assert all(p.alive for p in system.procs if p not in (coordinators["a"], banks[0]))
    # The survivors own everything now.
    assert spread(system, f"{prefix}.coordinator", 1)
    assert spread(system, f"{prefix}.participant.bank", 1)
