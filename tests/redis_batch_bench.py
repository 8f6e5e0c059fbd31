"""Storage-level micro-bench of the Redis participant: script path against per-step path.

``python -m tests.redis_batch_bench [ROUNDS]`` (needs ``SAGA_REDIS_URL``, e.g. from
``infra/services.sh env``). Each round runs one batch of 500 new ``increment`` steps
on each path, then rolls the 500 back in one batch, alternating which path goes
first; the first round warms up. Prints, per path and phase, the median over rounds
of the participant's CPU and wall time per step and Redis's own time per step (from
``INFO commandstats``; commands a script calls are counted under their own names
too, so the script path counts ``EVALSHA`` only; the per-step path counts every
command, other clients' included on a shared Redis).
Keys live under a fresh prefix, removed at the end. Not part of any test target.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import redis

from saga.participants._barrier import Requested
from saga.participants._storage import DecisionArrived, WorkItem
from saga.participants.redis._adapter import RedisStorage
from saga.streams import Mode, Outcome, StepStatus

BATCH = 500
RECORDS = 50


def batch(tag: str, first: int, now: int) -> list[WorkItem]:
    return [
        Requested(
            f"{tag}-{n}",
            0,
            "increment",
            {"target": "points", "key": n % RECORDS, "field": "balance", "by": 1, "min": 0},
            Mode.PARALLEL,
            1,
            now + 3_600_000,
            now,
            fingerprint=f"fp-{n}",
        )
        for n in range(first, first + BATCH)
    ]


def server_usec(client: redis.Redis, script: bool) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    if script:
        return sum(v["usec"] for k, v in stats.items() if k.startswith("cmdstat_evalsha"))
    return sum(v["usec"] for v in stats.values())


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main(rounds: int) -> None:
    url = os.environ["SAGA_REDIS_URL"]
    client = redis.Redis.from_url(url, decode_responses=True)
    now = int(time.time() * 1000)
    kinds = ("script", "per-step")
    stores: dict[str, RedisStorage] = {}
    figures: dict[str, list[tuple[float, float, float]]] = {
        f"{kind} {phase}": [] for kind in kinds for phase in ("apply", "rollback")
    }
    for kind in kinds:
        prefix = f"redis-batch-bench-{os.getpid()}-{kind}"
        store = RedisStorage("rewards", url, ["points"], prefix=prefix, scripts=kind == "script")
        store.setup()
        for key in range(RECORDS):
            client.hset(store.record_key("points", key), "balance", "0")
        stores[kind] = store
    try:
        for r in range(rounds + 1):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                items = batch(f"r{r}", r * BATCH, now)
                rollbacks: list[WorkItem] = [
                    DecisionArrived(item.tx_id, Outcome.ROLLBACK, now + 1) for item in items
                ]
                for phase, work, status in (
                    ("apply", items, StepStatus.APPLIED),
                    ("rollback", rollbacks, StepStatus.COMPENSATED),
                ):
                    u0 = server_usec(client, kind == "script")
                    c0, w0 = time.process_time(), time.perf_counter()
                    reports = stores[kind].execute(work)
                    c1, w1 = time.process_time(), time.perf_counter()
                    u1 = server_usec(client, kind == "script")
                    assert [x.status for x in reports] == [status] * BATCH
                    if r > 0:
                        figures[f"{kind} {phase}"].append(
                            ((c1 - c0) / BATCH * 1e3, (w1 - w0) / BATCH * 1e3, (u1 - u0) / BATCH)
                        )
        for kind, rows in figures.items():
            cpu, wall, server = (median([row[i] for row in rows]) for i in range(3))
            print(
                f"{kind:18s} per step: CPU {cpu:.3f} ms, wall {wall:.3f} ms, "
                f"Redis {server:.1f} us (median of {len(rows)} rounds of {BATCH})"
            )
    finally:
        for store in stores.values():
            keys = list(client.scan_iter(match=f"{store.prefix}:*", count=1000))
            for at in range(0, len(keys), 500):
                client.delete(*keys[at : at + 500])
            store.close()
        client.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
