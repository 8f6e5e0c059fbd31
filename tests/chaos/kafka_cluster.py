"""The three nodes of ``infra/kafka-cluster.sh``: who holds which role, and their control.

:class:`BrokerCluster` finds the nodes by their pid files (``$SAGA_BROKERS_DIR/pids/
kafka-cluster-N.pid``, which ``infra/kafka-cluster.sh env`` exports), checks that each
pid is the node serving a port of the run's bootstrap list before it signals it, and
answers, at the moment it is asked, which node holds a role:

* the **leader** of a partition (the admin client's metadata);
* the **transaction coordinator** of a transactional id: the leader of the partition of
  ``__transaction_state`` the broker maps the id to. confluent-kafka has no
  DescribeTransactions, so the mapping is the broker's own (the absolute value of
  Java's ``String.hashCode`` of the id, modulo the topic's partition count);
* the **group coordinator** of a consumer group: the leader of the group's partition of
  ``__consumer_offsets`` by the same mapping (:meth:`BrokerCluster.group_partition_leader`).
  The roles test compares it with what ``describe_consumer_groups`` reports, which
  vouches for the mapping, the transactional one included.

Restarting a node is ``infra/kafka-cluster.sh start N`` (it waits until the node
serves); :meth:`BrokerCluster.wait_healthy` waits until all three nodes are in the
metadata and every partition's in-sync replicas are all of its replicas, so the next
fault never takes a partition below ``min.insync.replicas`` by accident.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from tests._infra import ROOT
from tests.chaos.services import ServiceControlError, _alive, _cmdline, run_until_ok

CLUSTER_SH = ROOT / "infra" / "kafka-cluster.sh"
NODES = (1, 2, 3)
TXN_TOPIC = "__transaction_state"
OFFSETS_TOPIC = "__consumer_offsets"


def java_hash(text: str) -> int:
    """Java's ``String.hashCode`` of ``text`` (UTF-16 code units), as a signed 32-bit int."""
    h = 0
    data = text.encode("utf-16-be")
    for i in range(0, len(data), 2):
        h = (31 * h + int.from_bytes(data[i : i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def coordinator_partition(key: str, partitions: int) -> int:
    """The partition of ``__transaction_state`` / ``__consumer_offsets`` holding ``key``
    (Kafka's ``Utils.abs(key.hashCode()) % partitions``; ``Utils.abs`` is ``Math.abs``
    with ``Integer.MIN_VALUE`` mapped to 0)."""
    h = java_hash(key)
    return (0 if h == -(1 << 31) else abs(h)) % partitions


class BrokerCluster:
    """SIGKILL, SIGSTOP/SIGCONT, stop and start the nodes; find who holds a role now."""

    def __init__(self, bootstrap: str, environ: Mapping[str, str] = os.environ) -> None:
        folder = environ.get("SAGA_BROKERS_DIR")
        if not folder:
            raise ServiceControlError(
                "SAGA_BROKERS_DIR is not set: start the cluster with `make cluster-up` and "
                'load its addresses with eval "$(infra/kafka-cluster.sh env)"'
            )
        self.dir = Path(folder).resolve()
        self.bootstrap = bootstrap
        self.ports = {int(a.rsplit(":", 1)[1]) for a in bootstrap.split(",") if a.strip()}
        self.environ = dict(environ)
        # Their complaints about the nodes the run kills go to a logger the runner silences.
        # During a run only metadata and watermark requests are made: the admin client's
        # newer requests (ListOffsets, DescribeConsumerGroups) hit a librdkafka assertion
        # (rd_kafka_enq_once_del_source_return) while nodes were being killed, which
        # aborted the whole run; describe_consumer_groups serves the roles test only.
        quiet = logging.getLogger("saga.kafka.chaos")
        base = {"bootstrap.servers": bootstrap, "socket.timeout.ms": 10_000, "logger": quiet}
        self.admin = AdminClient(dict(base))
        self._offsets = Consumer({**base, "group.id": "saga-chaos-watermarks"})

    # ------------------------------------------------------------ processes

    def pid(self, node: int) -> int:
        """The pid of ``node``, checked to be that node of the run's cluster."""
        path = self.dir / "pids" / f"kafka-cluster-{node}.pid"
        try:
            pid = int(path.read_text().strip())
        except (OSError, ValueError):
            raise ServiceControlError(f"no pid file for Kafka node {node} at {path}") from None
        cmdline = _cmdline(pid)
        config = next((Path(a) for a in cmdline if a.endswith("server.properties")), None)
        text = config.read_text() if config is not None and config.exists() else ""
        ours = (
            "kafka.Kafka" in cmdline
            and f"node.id={node}\n" in text
            and any(f":{port}," in text.replace("\n", ",") for port in self.ports)
        )
        if not ours:
            raise ServiceControlError(
                f"pid {pid} in {path} is not Kafka node {node} of {self.bootstrap}; "
                "refusing to signal it"
            )
        return pid

    def check_all(self) -> None:
        """Raise unless all three nodes run (and are the run's)."""
        for node in NODES:
            self.pid(node)

    def _signal_and_wait(self, node: int, sig: int, timeout: float) -> None:
        pid = self.pid(node)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while _alive(pid):
            if time.monotonic() > deadline:
                if sig == signal.SIGKILL:
                    raise ServiceControlError(f"Kafka node {node} (pid {pid}) survived SIGKILL")
                os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                sig = signal.SIGKILL
            time.sleep(0.05)

    def kill(self, node: int) -> None:
        """SIGKILL the node and wait until it is gone."""
        self._signal_and_wait(node, signal.SIGKILL, 30)

    def stop(self, node: int) -> None:
        """SIGTERM (a controlled shutdown: leadership moves first), SIGKILL after 90 s."""
        self._signal_and_wait(node, signal.SIGTERM, 90)

    def pause(self, node: int) -> None:
        os.kill(self.pid(node), signal.SIGSTOP)

    def resume(self, node: int) -> None:
        os.kill(self.pid(node), signal.SIGCONT)

    def start(self, node: int, attempts: int = 4) -> list[str]:
        """``infra/kafka-cluster.sh start N``: start the node and wait until it serves.

        Returns what the failed attempts said (empty when the first one worked), so a
        slow recovery can be told apart from a start that had to be repeated."""
        env = dict(self.environ)
        env["SAGA_INFRA_DIR"] = str(self.dir)
        failure = f"Kafka node {node} would not start {attempts} times: "
        return run_until_ok([str(CLUSTER_SH), "start", str(node)], env, attempts, failure)

    # ------------------------------------------------------------ roles

    def leaders(self, topic: str) -> dict[int, int]:
        """Partition -> leader node of ``topic`` (-1: no leader right now)."""
        problem = ""
        for attempt in range(6):
            try:
                found = self.admin.list_topics(topic, timeout=15).topics.get(topic)
            except KafkaException as exc:  # no node answered in time: ask again
                problem = str(exc)
            else:
                if found is not None and found.error is None:
                    return {p.id: p.leader for p in found.partitions.values()}
                problem = str(found.error) if found is not None else "not in the metadata"
            time.sleep(0.5 + attempt)
        raise ServiceControlError(f"no metadata for topic {topic}: {problem}")

    def busiest(self, topics: list[str]) -> tuple[str, int, int]:
        """(topic, partition, leader) of the partition of ``topics`` with the most records."""
        best: tuple[int, str, int, int] | None = None
        for topic in topics:
            for partition, leader in self.leaders(topic).items():
                end = self._end_offset(topic, partition)
                if leader >= 0 and (best is None or end > best[0]):
                    best = (end, topic, partition, leader)
        if best is None:
            raise ServiceControlError(f"no partition of {topics} has a leader")
        return best[1], best[2], best[3]

    def close(self) -> None:
        self._offsets.close()

    def _end_offset(self, topic: str, partition: int, attempts: int = 8) -> int:
        """The partition's high watermark; -1 if it cannot be had (a leadership that just
        moved answers NOT_LEADER / UNKNOWN_PARTITION for a moment: asked again first)."""
        for attempt in range(attempts):
            try:
                _, end = self._offsets.get_watermark_offsets(
                    TopicPartition(topic, partition), timeout=10
                )
                return int(end)
            except KafkaException:
                time.sleep(0.5 + attempt * 0.5)
        return -1

    def txn_coordinator(self, transactional_id: str) -> int:
        """The node coordinating ``transactional_id``'s transactions (see the module doc)."""
        leaders = self.leaders(TXN_TOPIC)
        return leaders[coordinator_partition(transactional_id, len(leaders))]

    def group_coordinator(self, group: str) -> int:
        """The coordinator node of consumer group ``group``, as the broker reports it."""
        # Right after a coordinator moved (or before __consumer_offsets exists) the broker
        # answers NOT_COORDINATOR / COORDINATOR_NOT_AVAILABLE for a while: ask again.
        deadline = time.monotonic() + 60
        while True:
            futures = self.admin.describe_consumer_groups([group], request_timeout=15)
            try:
                return int(futures[group].result().coordinator.id)
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

    def group_partition_leader(self, group: str) -> int:
        """The leader of ``group``'s partition of ``__consumer_offsets`` (the mapping
        :meth:`txn_coordinator` relies on, applied to a group)."""
        leaders = self.leaders(OFFSETS_TOPIC)
        return leaders[coordinator_partition(group, len(leaders))]

    # ------------------------------------------------------------ health

    def health(self) -> str:
        """'' when three nodes serve and no partition is under-replicated, else what is not."""
        try:
            meta = self.admin.list_topics(timeout=10)
        except Exception as exc:  # a node being restarted: not healthy yet
            return f"no metadata: {exc}"
        if len(meta.brokers) < len(NODES):
            return f"{len(meta.brokers)} node(s) in the metadata"
        for name, topic in meta.topics.items():
            for p in topic.partitions.values():
                if p.leader < 0 or set(p.isrs) != set(p.replicas):
                    return f"{name}[{p.id}] leader {p.leader}, isr {p.isrs} of {p.replicas}"
        return ""

    def wait_healthy(self, timeout: float = 240) -> float:
        """Wait until :meth:`health` is clean; the seconds it took. Raises after ``timeout``."""
        start = time.monotonic()
        problem = self.health()
        while problem:
            if time.monotonic() - start > timeout:
                raise ServiceControlError(
                    f"the cluster is not healthy after {timeout:.0f}s: {problem}"
                )
            time.sleep(0.5)
            problem = self.health()
        return time.monotonic() - start
