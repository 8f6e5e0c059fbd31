"""Broker faults of the cluster profile: the victim is chosen by its role when it strikes.

Each injector asks the cluster (:class:`~tests.chaos.kafka_cluster.BrokerCluster`) which
node holds the role *now*, strikes it, brings it back and waits until the cluster is
healthy again (three nodes, every partition's replicas all in sync), so the next fault
starts from a full cluster and a partition never falls below ``min.insync.replicas``
because two faults overlapped:

* ``broker.kill.leader``: SIGKILL of the leader of the busiest partition (most records)
  of the requests, events and decisions topics, then a restart;
* ``broker.kill.txn_coordinator``: SIGKILL of the transaction coordinator of one saga
  coordinator's transactional producer (``<prefix>.coordinator.<instance id>``);
* ``broker.kill.group_coordinator``: SIGKILL of the group coordinator of the saga
  coordinators' or a participant's consumer group;
* ``broker.pause.leader``: SIGSTOP of the busiest partition's leader past the broker
  session timeout (the controller fences it and moves its leaderships), then SIGCONT;
* ``broker.down``: one node killed and kept down for minutes while the load goes on;
* ``broker.rolling_restart``: each node in turn stopped (SIGTERM, a controlled shutdown)
  and started, waiting for the cluster to heal between nodes.

Kills are counted by role (``broker.leader``, ``broker.txn_coordinator``,
``broker.group_coordinator``); the note of each fault says which node was struck and
which other roles it happened to hold.
"""

from __future__ import annotations

import contextlib
import random
import time

from tests.chaos.faults import FaultBook, FaultRecord
from tests.chaos.kafka_cluster import NODES, BrokerCluster
from tests.chaos.system import System
from tests.chaos.workload import PARTICIPANTS

BROKER_SESSION_TIMEOUT_S = 6.0  # broker.session.timeout.ms of infra/kafka-cluster.sh
DOWN_S = 120.0  # how long broker.down keeps its node down
ROLES = ("leader", "txn_coordinator", "group_coordinator")
BROKER_FAULT_TYPES = (
    *(f"broker.kill.{role}" for role in ROLES),
    "broker.pause.leader",
    "broker.down",
    "broker.rolling_restart",
)


def _groups(main: System) -> list[str]:
    return [f"{main.prefix}.coordinator"] + [
        f"{main.prefix}.participant.{PARTICIPANTS[s]}" for s in main.stores_used
    ]


def _busy_topics(main: System) -> list[str]:
    return [main.topics.requests, main.topics.events, main.topics.decisions]


def holder(brokers: BrokerCluster, main: System, rnd: random.Random, role: str) -> tuple[int, str]:
    """(node, what it holds) for ``role``, asked of the cluster now."""
    if role == "leader":
        topic, partition, node = brokers.busiest(_busy_topics(main))
        return node, f"leader of {topic}[{partition}]"
    if role == "txn_coordinator":
        slot = rnd.choice(main.cluster.of_kind("coordinator"))
        tid = f"{main.prefix}.coordinator.{slot.instance_id}"
        return brokers.txn_coordinator(tid), f"transaction coordinator of {tid}"
    group = rnd.choice(_groups(main))
    return brokers.group_partition_leader(group), f"group coordinator of {group}"


def _also(brokers: BrokerCluster, main: System, node: int, role: str) -> str:
    """The other roles ``node`` held (for the note; best effort)."""
    held = []
    with contextlib.suppress(Exception):
        if role != "leader":
            leaders = brokers.leaders(main.topics.requests)
            led = [p for p, n in leaders.items() if n == node]
            if led:
                held.append(f"led requests{led}")
        if role != "group_coordinator":
            mine = [g for g in _groups(main) if brokers.group_partition_leader(g) == node]
            if mine:
                held.append(f"coordinated {len(mine)} group(s)")
    return f"; also {', '.join(held)}" if held else ""


def _retries(failed: list[str]) -> str:
    return f"; start repeated after: {' | '.join(failed)}" if failed else ""


def kill_by_role(
    brokers: BrokerCluster, book: FaultBook, rnd: random.Random, main: System, role: str
) -> FaultRecord:
    """SIGKILL the node holding ``role``, restart it, wait until the cluster is healthy."""
    started = book.now()
    node, what = holder(brokers, main, rnd, role)
    also = _also(brokers, main, node, role)
    brokers.kill(node)
    book.kill(f"broker.{role}")
    time.sleep(rnd.uniform(0.5, 3.0))
    retried = _retries(brokers.start(node))
    healed = brokers.wait_healthy()
    kind = f"broker.kill.{role}"
    book.fault(kind)
    rec = FaultRecord(
        kind,
        f"node-{node}",
        started,
        book.now(),
        f"{what}{also}; ISR full {healed:.1f}s after start{retried}",
    )
    book.record(rec)
    return rec


def pause_leader(
    brokers: BrokerCluster, book: FaultBook, rnd: random.Random, main: System
) -> FaultRecord:
    """SIGSTOP the busiest partition's leader past the broker session timeout, then SIGCONT."""
    started = book.now()
    topic, partition, node = brokers.busiest(_busy_topics(main))
    brokers.pause(node)
    try:
        time.sleep(BROKER_SESSION_TIMEOUT_S + 4 + rnd.uniform(0, 2))
        try:
            now = brokers.leaders(topic).get(partition, -1)
            moved = f"leader during the pause: node {now}"
        except Exception as exc:  # the metadata request may have gone to the paused node
            moved = f"leader during the pause unknown ({type(exc).__name__})"
    finally:
        brokers.resume(node)
    healed = brokers.wait_healthy()
    book.kill("broker.paused")
    book.fault("broker.pause.leader")
    rec = FaultRecord(
        "broker.pause.leader",
        f"node-{node}",
        started,
        book.now(),
        f"leader of {topic}[{partition}]; {moved}; ISR full {healed:.1f}s after SIGCONT",
    )
    book.record(rec)
    return rec


def down_for_minutes(
    brokers: BrokerCluster, book: FaultBook, rnd: random.Random, main: System
) -> FaultRecord:
    """Kill the busiest partition's leader and keep it down ``DOWN_S`` while load goes on."""
    started = book.now()
    topic, partition, node = brokers.busiest(_busy_topics(main))
    brokers.kill(node)
    book.kill("broker.down")
    time.sleep(DOWN_S)
    retried = _retries(brokers.start(node))
    healed = brokers.wait_healthy()
    book.fault("broker.down")
    rec = FaultRecord(
        "broker.down",
        f"node-{node}",
        started,
        book.now(),
        f"leader of {topic}[{partition}], down {DOWN_S:.0f}s; ISR full {healed:.1f}s after start"
        + retried,
    )
    book.record(rec)
    return rec


def rolling_restart(brokers: BrokerCluster, book: FaultBook, rnd: random.Random) -> FaultRecord:
    """Stop (SIGTERM) and start each node in turn, healing between nodes."""
    started = book.now()
    order = list(NODES)
    rnd.shuffle(order)
    steps = []
    for node in order:
        t0 = time.monotonic()
        brokers.stop(node)
        brokers.start(node)
        brokers.wait_healthy()
        steps.append(f"node {node} {time.monotonic() - t0:.0f}s")
    book.kill("broker.rolling", len(order))
    book.fault("broker.rolling_restart")
    rec = FaultRecord("broker.rolling_restart", "all", started, book.now(), ", ".join(steps))
    book.record(rec)
    return rec
