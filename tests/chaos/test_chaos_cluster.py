"""The cluster profile (``make chaos-cluster``) and quick checks of the broker roles.

The profile runs against the three nodes of ``infra/kafka-cluster.sh`` (their addresses
from ``eval "$(infra/kafka-cluster.sh env)"``) and the local databases; it kills, pauses
and restarts the nodes, never the databases nor the single-node broker. Its report goes
to ``CHAOS_REPORT`` (default ``reports/chaos-cluster.json``); ``CHAOS_SEED`` replays a run.
Nothing here asserts on timing.
"""

from __future__ import annotations

import os
import random
import uuid
from collections import Counter
from pathlib import Path

import pytest

from saga.streams.kafka import Consumer, KafkaSettings, create_topics, delete_topics
from tests._infra import Services
from tests.chaos.cluster_profile import CLUSTER_PROFILE, KILLS_PER_ROLE, PAUSES, ClusterRunner
from tests.chaos.kafka_cluster import BrokerCluster, coordinator_partition, java_hash
from tests.chaos.runner import DEFAULT_REPORT, run_profile


def _brokers(services: Services) -> BrokerCluster:
    if not os.environ.get("SAGA_BROKERS_DIR"):
        pytest.skip('the three-broker cluster is not loaded: eval "$(infra/kafka-cluster.sh env)"')
    return BrokerCluster(services.kafka_bootstrap)


@pytest.mark.unit
def test_java_hash_matches_java() -> None:
    """Values of Java's String.hashCode, and Kafka's Utils.abs before the modulo."""
    assert java_hash("") == 0
    assert java_hash("a") == 97
    assert java_hash("hello") == 99162322
    assert java_hash("polygenelubricants") == -2147483648
    assert java_hash("é€") == 233 * 31 + 0x20AC
    assert coordinator_partition("polygenelubricants", 8) == 0  # Utils.abs(MIN_VALUE) == 0
    assert (
        java_hash("kcl.g0") < 0 and coordinator_partition("kcl.g0", 7) == -java_hash("kcl.g0") % 7
    )
    assert all(0 <= coordinator_partition(f"g{i}", 50) < 50 for i in range(200))


@pytest.mark.unit
def test_cluster_fault_plan_has_every_count() -> None:
    """One round holds 10 kills per role, 5 pauses, one node down and one rolling restart,
    the two long faults away from the very start."""
    runner = ClusterRunner.__new__(ClusterRunner)  # the plan needs only the seeded random
    runner.rnd = random.Random(7)
    plan = runner._round_faults(0)
    kinds = Counter(spec[2] if spec[1] == "kill" else spec[1] for spec in plan)
    assert kinds == {
        "leader": KILLS_PER_ROLE,
        "txn_coordinator": KILLS_PER_ROLE,
        "group_coordinator": KILLS_PER_ROLE,
        "pause": PAUSES,
        "down": 1,
        "rolling": 1,
    }
    assert KILLS_PER_ROLE >= 10 and PAUSES >= 5
    assert plan.index(("broker", "down")) >= len(plan) // 4
    assert CLUSTER_PROFILE.min_sagas >= 5000 and CLUSTER_PROFILE.replication_factor == 3


@pytest.mark.chaos
@pytest.mark.timeout(300)
def test_roles_on_the_cluster(services: Services) -> None:
    """Three healthy nodes; a topic at replication factor 3 with min.insync.replicas 2; and
    the broker's own group coordinator equals the hash mapping the transaction lookup uses."""
    brokers = _brokers(services)
    brokers.check_all()
    brokers.wait_healthy(120)
    prefix = f"kcl{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(bootstrap=services.kafka_bootstrap, prefix=prefix)
    create_topics(settings, 4, 3)
    try:
        leaders = brokers.leaders(settings.topics.requests)
        assert sorted(leaders) == [0, 1, 2, 3] and all(n in (1, 2, 3) for n in leaders.values())
        meta = brokers.admin.list_topics(settings.topics.requests, timeout=15)
        for p in meta.topics[settings.topics.requests].partitions.values():
            assert len(p.replicas) == 3
        groups = []
        for i in range(6):
            group = f"{prefix}.g{i}"
            consumer = Consumer(settings, group_id=group)
            consumer.subscribe([settings.topics.requests])
            for _ in range(20):
                consumer.poll_batch(10, 0.5)
                if brokers.group_coordinator(group) >= 1:
                    break
            groups.append(group)
            consumer.close()
        for group in groups:
            assert brokers.group_coordinator(group) == brokers.group_partition_leader(group)
    finally:
        delete_topics(settings, list(settings.topics.all))


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_cluster_profile(services: Services, infra_mode: str) -> None:
    """At least 5,000 sagas; 10 kills of each role, 5 paused leaders, a node down for
    minutes and a rolling restart; every count 0; both negative controls caught."""
    _brokers(services).check_all()
    if infra_mode != "local":
        pytest.fail(
            "the cluster profile needs the local databases (SAGA_INFRA=local)", pytrace=False
        )
    seed = int(os.environ["CHAOS_SEED"]) if os.environ.get("CHAOS_SEED") else None
    path = Path(os.environ.get("CHAOS_REPORT") or DEFAULT_REPORT.with_name("chaos-cluster.json"))
    report = run_profile(
        services, CLUSTER_PROFILE, seed=seed, report_path=path, runner_class=ClusterRunner
    )
    bad = {name: n for name, n in report["counts"].items() if n}
    assert report["violations"] == 0, (bad, report["examples"])
    for name, control in report["negative_controls"].items():
        assert control["detected"], f"negative control {name} was not detected: {control}"
    assert report["negative_controls_detected"]
    assert not report["missing_fault_types"], report["missing_fault_types"]
    assert report["sagas"]["submitted"] >= 5000, report["sagas"]
    assert report["requirements"]["min_kills"], report["kills"]
    assert report["passed"]
