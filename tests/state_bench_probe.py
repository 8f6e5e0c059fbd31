"""What one saga costs the coordinator: heap per finished and per in-flight saga, disk per
finished saga; on the in-memory log, no broker (``python -m tests.state_bench --probe``).

A coordinator with default settings (retention seven days) decides sagas of three steps
fed straight to its batch processing, as a running one would read them. The heap it
holds is the deep size of its per-partition state (the sagas in memory, their timers,
the tables' bookkeeping), measured before and after: N sagas run to ``committed``
(finished), then N more left ``pending`` (in flight). Disk: the pages of its SQLite store
of finished sagas, per row.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

from saga.coordinator._retention import PartitionState, Sagas
from saga.coordinator._service import CoordinatorService
from saga.streams import KafkaSettings, StepEvent, StepStatus, encode
from saga.streams.testing import InMemoryLog, ManualClock
from tests.state_bench_history import PARTICIPANTS, request, tx_name

_PARTITIONS = 4
_BATCH = 2000


def deep_size(root: object) -> int:
    """Bytes of ``root`` and of everything it holds that nothing outside shares (enum
    members, interned names and small ints aside: they exist anyway)."""
    seen: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type) or obj is None or isinstance(obj, bool):
            continue
        if hasattr(obj, "__class__") and obj.__class__.__module__ == "enum":
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack += list(obj)
        elif hasattr(obj, "__slots__"):
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        stack.append(getattr(obj, name))
        elif hasattr(obj, "__dict__") and not callable(obj):
            stack.append(vars(obj))
    return total


class _Probe:
    def __init__(self) -> None:
        settings = KafkaSettings(bootstrap="memory:9092", prefix="probe")
        self.topics = settings.topics
        self.clock = ManualClock(1_700_000_000_000)
        self.log = InMemoryLog(settings, clock=self.clock)
        self.log.create_topics(_PARTITIONS)
        self.service = CoordinatorService(
            settings, instance_id="probe", clock=self.clock, log=self.log
        )
        service = self.service
        service._producer.init()
        service._partition_count = _PARTITIONS
        service._partitions = {
            p: PartitionState(Sagas(service._finished.table(p))) for p in range(_PARTITIONS)
        }
        self.reader = self.log.consumer(None, client_id="probe")
        self.reader.assign(
            [
                (t, p, 0)
                for t in (self.topics.requests, self.topics.events)
                for p in range(_PARTITIONS)
            ]
        )
        self.sent = 0

    def run(self, count: int, *, finish: bool) -> None:
        for first in range(0, count, _BATCH):
            txs = [tx_name(self.sent + n, "m") for n in range(min(_BATCH, count - first))]
            self.sent += len(txs)
            now = self.clock()
            with self.log.producer() as producer:
                for tx in txs:
                    producer.produce(
                        self.topics.requests, tx, encode(request(tx, now, now + 30_000))
                    )
                    if finish:
                        for i, p in enumerate(PARTICIPANTS):
                            event = StepEvent(tx, i, p, StepStatus.APPLIED, now)
                            producer.produce(self.topics.events, tx, encode(event))
            while batch := self.reader.poll_batch(5000, 0):
                self.service._process(batch, self.clock())
            self.clock.advance(50)

    def held(self) -> int:
        gc.collect()
        return deep_size(self.service._partitions)

    def disk_bytes(self) -> int:
        db = self.service._finished._db
        return int(db.execute("PRAGMA page_count").fetchone()[0]) * int(
            db.execute("PRAGMA page_size").fetchone()[0]
        )


def probe(count: int) -> dict[str, Any]:
    """Heap per finished and per in-flight saga, disk per finished saga (``count`` each)."""
    p = _Probe()
    p.run(_BATCH, finish=True)  # warm-up: the first tables and pages exist
    p.clock.advance(60_000)  # past the warm-up's deadlines (their timers are gone)
    p.run(1, finish=True)
    start_heap, start_disk = p.held(), p.disk_bytes()
    p.run(count, finish=True)
    p.clock.advance(60_000)  # their deadlines pass: nothing of them left in memory
    p.run(1, finish=True)
    finished_heap, finished_disk = p.held(), p.disk_bytes()
    p.run(count, finish=False)
    flight_heap = p.held()
    service = p.service
    assert service.stats.commits >= count + _BATCH, service.stats
    return {
        "sagas": count,
        "finished_heap_bytes_per_saga": round((finished_heap - start_heap) / (count + 1), 1),
        "finished_disk_bytes_per_saga": round((finished_disk - start_disk) / (count + 1), 1),
        "in_flight_heap_bytes_per_saga": round((flight_heap - finished_heap) / count, 1),
        "in_memory": service.sagas_in_memory,
        "held": service.sagas_held,
    }
