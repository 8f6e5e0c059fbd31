"""The cluster profile of the chaos suite (``make chaos-cluster``): broker faults by role.

The short profile's workload, record faults (the barrier trio, duplicated requests and
decisions, poison on every input topic), checker, ``saga reconcile`` audit and negative
controls, run on the three nodes of ``infra/kafka-cluster.sh`` with every topic at
replication factor 3 (``min.insync.replicas`` 2), at least 5,000 sagas, while the faults
of :mod:`tests.chaos.broker_faults` strike one after another: at least 10 kills of the
leader of a busy partition, of a saga coordinator's transaction coordinator and of a
consumer group's coordinator each, 5 paused leaders, one node down for minutes and one
rolling restart. The saga processes and the databases are left alone: the faults are
the brokers' (the databases are shared with other work on the machine, and the single
node's faults are the short and long profiles').

It passes when every count is 0, both negative controls are detected and every fault
ran its number of times; the report adds the time to quiesce after each kind of fault.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

from tests._infra import Services
from tests.chaos import broker_faults as B
from tests.chaos.faults import FaultRecord
from tests.chaos.kafka_cluster import NODES, BrokerCluster
from tests.chaos.runner import Profile, Runner, percentile
from tests.chaos.services import ServiceControl
from tests.chaos.system import System
from tests.chaos.workload import STORES

KILLS_PER_ROLE = 10
PAUSES = 5

CLUSTER_PROFILE = Profile(
    "cluster",
    baseline_sagas=120,
    rounds=1,
    round_sagas=5000,
    round_max=9000,
    rate=6,  # 5,000 sagas take about as long as the faults (~14 min)
    replay_every=1,
    recovery_window_s=300,
    nc_sagas=80,
    min_sagas=5000,
    min_kills=KILLS_PER_ROLE,
    replication_factor=3,
    replays=False,
)

CLUSTER_FAULT_TYPES = (
    *B.BROKER_FAULT_TYPES,
    *(f"barrier.{what}.{store}" for what in ("null_compensation", "hanging") for store in STORES),
    *(
        f"barrier.{what}.{store}"
        for what in ("duplicate_request", "duplicate_decision", "duplicate_compensation")
        for store in STORES
    ),
    "poison.requests",
    "poison.events",
    "poison.decisions",
)
"""Every fault type the cluster profile must inject."""


class _ClusterServices(ServiceControl):
    """The runner's pre-flight check: the three nodes (the databases are not touched)."""

    def __init__(self, services: Services, brokers: BrokerCluster) -> None:
        super().__init__(services)
        self.brokers = brokers

    def check_all(self) -> None:
        self.brokers.check_all()
        self.brokers.wait_healthy(120)


class ClusterRunner(Runner):
    """:class:`~tests.chaos.runner.Runner` with the broker faults instead of the single
    node's process and service faults."""

    def __init__(self, services: Services, profile: Profile, **kwargs: Any) -> None:
        super().__init__(services, profile, **kwargs)
        self.brokers = BrokerCluster(services.kafka_bootstrap)
        self.control = _ClusterServices(services, self.brokers)

    def _round_faults(self, r: int) -> list[tuple[Any, ...]]:
        specs: list[tuple[Any, ...]] = [
            ("broker", "kill", role) for role in B.ROLES for _ in range(KILLS_PER_ROLE)
        ]
        specs += [("broker", "pause")] * PAUSES
        self.rnd.shuffle(specs)
        # The long faults somewhere in the middle, not back to back.
        third = len(specs) // 3
        specs.insert(self.rnd.randint(third, 2 * third), ("broker", "down"))
        specs.insert(self.rnd.randint(third, len(specs)), ("broker", "rolling"))
        return specs

    def run(self) -> dict[str, Any]:
        try:
            return super().run()
        finally:
            self.brokers.close()

    def _inject(self, main: System, spec: tuple[Any, ...]) -> FaultRecord:
        if spec[0] != "broker":
            return super()._inject(main, spec)
        started = self.book.now()
        try:
            return self._strike(main, spec)
        except Exception as exc:
            # A fault that could not be carried out (a node that would not come back in
            # time, metadata unavailable) must not end the run: every node is started
            # again, the fault is logged, and the missing count fails the requirements.
            self.log(f"{spec[1]} fault failed: {type(exc).__name__}: {exc}; restoring the nodes")
            for node in NODES:
                with contextlib.suppress(Exception):
                    self.brokers.resume(node)
                with contextlib.suppress(Exception):
                    self.brokers.start(node)
            with contextlib.suppress(Exception):
                self.brokers.wait_healthy()
            rec = FaultRecord(f"broker.{spec[1]}.failed", "?", started, self.book.now(), str(exc))
            self.book.record(rec)
            return rec

    def _strike(self, main: System, spec: tuple[Any, ...]) -> FaultRecord:
        brokers, book, rnd = self.brokers, self.book, self.rnd
        if spec[1] == "kill":
            return B.kill_by_role(brokers, book, rnd, main, spec[2])
        if spec[1] == "pause":
            return B.pause_leader(brokers, book, rnd, main)
        if spec[1] == "down":
            return B.down_for_minutes(brokers, book, rnd, main)
        return B.rolling_restart(brokers, book, rnd)

    def _report(self, main: System, *args: Any, **kwargs: Any) -> dict[str, Any]:
        report = super()._report(main, *args, **kwargs)
        faults: Counter[str] = Counter(report["faults"])
        missing = [f for f in CLUSTER_FAULT_TYPES if not faults.get(f)]
        kills = {
            "leader": self.book.kills.get("broker.leader", 0),
            "txn_coordinator": self.book.kills.get("broker.txn_coordinator", 0),
            "group_coordinator": self.book.kills.get("broker.group_coordinator", 0),
            "paused_leader": self.book.kills.get("broker.paused", 0),
            "down_for_minutes": self.book.kills.get("broker.down", 0),
            "rolling_restart_nodes": self.book.kills.get("broker.rolling", 0),
        }
        by_kind: dict[str, list[float]] = {}
        for q in main.quiesce:
            if q.seconds is not None:
                by_kind.setdefault(q.label, []).append(q.seconds)
        report["kills"] = kills
        report["missing_fault_types"] = missing
        report["quiesce_by_fault_s"] = {
            kind: {"p50": percentile(v, 0.5), "p99": percentile(v, 0.99), "n": len(v)}
            for kind, v in sorted(by_kind.items())
        }
        # Each fault's own figure, beside the percentiles: which kind of strike is slow.
        # A fault that struck while the sagas of the one before were still pending waits
        # for those too (its clock starts later, its figure is the earlier one's, less the
        # gap): marked, and the percentiles given again without such faults.
        overlapping = _overlapping(main.quiesce)
        report["quiesce_log"] = [
            {
                "fault": q.label,
                "seconds": None if q.seconds is None else round(q.seconds, 2),
                "during_previous_recovery": i in overlapping,
            }
            for i, q in enumerate(main.quiesce)
        ]
        alone = [
            q.seconds
            for i, q in enumerate(main.quiesce)
            if i not in overlapping and q.seconds is not None and not q.gone
        ]
        report["quiesce_not_overlapping_s"] = {
            "p50": percentile(alone, 0.5),
            "p99": percentile(alone, 0.99),
            "faults": len(alone),
        }
        report["cluster"] = {
            "bootstrap": self.brokers.bootstrap,
            "replication_factor": self.profile.replication_factor,
        }
        req = report["requirements"]
        req["every_fault_type"] = not missing
        req["min_kills"] = (
            all(kills[role] >= KILLS_PER_ROLE for role in B.ROLES)
            and kills["paused_leader"] >= PAUSES
            and kills["down_for_minutes"] >= 1
            and kills["rolling_restart_nodes"] >= 3
        )
        report["passed"] = (
            report["violations"] == 0 and report["negative_controls_detected"] and all(req.values())
        )
        return report


def _overlapping(quiesce: list[Any]) -> set[int]:
    """Indexes of the faults that recovered while an earlier fault's sagas were pending."""
    out: set[int] = set()
    open_until = float("-inf")
    for i, q in enumerate(quiesce):
        if q.at < open_until:
            out.add(i)
        end = float("inf") if q.seconds is None else q.at + q.seconds
        open_until = max(open_until, end)
    return out
