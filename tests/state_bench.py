"""Bounded state: what a restart and a new client cost after 10,000 and after 1,000,000 sagas.

``make state-bench`` (``python -m tests.state_bench``). For each history size it
writes, under a fresh topic prefix, the records a real run of that many
three-step sagas writes — the request, six step events, the decision, the
``committing`` and ``committed`` statuses and, once a saga is older than the
retention, the coordinator's tombstone — each with the time it would have had
(``--rate`` sagas per second, ending now), and commits the coordinator group's
offsets at the end of its input topics, as a coordinator that processed them
would have. It waits until the broker has deleted the status topic's segments
older than its retention (twice the coordinator's), then measures:

* a coordinator's restart-to-ready time (``saga coordinator run`` started, to its
  partitions restored) and its resident memory once ready;
* a new ``SagaClient``'s start-to-ready time (its status view caught up).

It prints one table and writes ``reports/state-bench.json``. Nothing here is a
pass/fail test; the issue's bound is that the 1,000,000 figures stay within 1.5x
of the 10,000 ones.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

from saga.coordinator import SagaClient
from saga.streams import (
    Decision,
    Mode,
    Outcome,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepProgress,
    StepStatus,
    encode,
)
from saga.streams._duration import parse_duration_ms
from saga.streams.kafka import Consumer, KafkaSettings, Producer, create_topics, delete_topics
from tests._infra import unique_name

ROOT = Path(__file__).resolve().parents[1]
PARTICIPANTS = ("bank", "wallet", "rewards")
READY = re.compile(r"assigned partitions \[[0-9, ]+\] \(restored (\d+) sagas\)")


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def history(
    settings: KafkaSettings,
    first: int,
    sagas: int,
    rate: float,
    retention_ms: int,
    now: int,
    *,
    recent: bool,
) -> dict[str, int]:
    """Write the records of sagas ``first`` to ``first + sagas - 1``, ending at ``now``.

    ``recent``: these are the last sagas before the measurement, so only the ones
    older than the retention get their tombstone; otherwise every one does (at the
    time the coordinator would have written it). Returns the records per topic.
    """
    topics = settings.topics
    producer = Producer(
        KafkaSettings(
            bootstrap=settings.bootstrap,
            prefix=settings.prefix,
            extra={"linger.ms": "50", "batch.num.messages": "10000"},
        ),
        client_id="state-bench",
    )
    step_ms = 1000.0 / rate
    tombstones: collections.deque[tuple[int, str]] = collections.deque()
    counts = collections.Counter[str]()

    def put(topic: str, key: str, value: bytes | None, at: int) -> None:
        producer.produce(topic, key, value, timestamp_ms=at)
        counts[topic] += 1

    steps = tuple(
        Step(p, "increment", {"target": "accounts", "key": f"k{i}", "field": "b", "by": 1})
        for i, p in enumerate(PARTICIPANTS)
    )
    for i in range(sagas):
        created = now - int((sagas - i) * step_ms) - 1000
        tx = f"s{first + i:09d}"
        while tombstones and tombstones[0][0] <= created:
            at, old = tombstones.popleft()
            put(topics.status, old, None, at)
        request = SagaRequest(tx, "transfer", Mode.PARALLEL, steps, created + 2000, created)
        put(topics.requests, tx, encode(request), created)
        for n, p in enumerate(PARTICIPANTS):
            put(
                topics.events,
                tx,
                encode(StepEvent(tx, n, p, StepStatus.APPLIED, created + 200)),
                created + 200,
            )
        decided = created + 500
        put(
            topics.decisions,
            tx,
            encode(Decision(tx, Outcome.COMMIT, "all steps applied", decided)),
            decided,
        )
        for state, status, at in (
            (SagaState.COMMITTING, StepStatus.APPLIED, decided),
            (SagaState.COMMITTED, StepStatus.COMMITTED, created + 1000),
        ):
            record = SagaStatus(
                tx,
                "transfer",
                state,
                tuple(StepProgress(p, status) for p in PARTICIPANTS),
                "all steps applied",
                created,
                at,
                created + 2000,
                request.fingerprint(),
            )
            put(topics.status, tx, encode(record), at)
        for n, p in enumerate(PARTICIPANTS):
            event = StepEvent(tx, n, p, StepStatus.COMMITTED, created + 800)
            put(topics.events, tx, encode(event), created + 800)
        forget = created + 2000 + retention_ms  # max(deadline, last change) + retention
        if forget <= now or not recent:
            tombstones.append((forget, tx))
        if i % 100_000 == 99_999:
            say(f"  {i + 1:,} sagas written")
            producer.poll(0)
    for at, old in tombstones:
        put(topics.status, old, None, at)
    producer.flush(120)
    producer.close()
    return dict(counts)


def commit_coordinator_offsets(settings: KafkaSettings, partitions: int) -> None:
    """Where a coordinator that processed the whole history would stand."""
    topics = settings.topics
    group = Consumer(settings, group_id=f"{topics.prefix}.coordinator", client_id="state-bench")
    try:
        ends = {}
        for topic in (topics.requests, topics.events, topics.decisions):
            for p in range(partitions):
                ends[(topic, p)] = group.watermarks(topic, p)[1]
        group.commit(ends)
    finally:
        group.close()


def status_records(settings: KafkaSettings, partitions: int) -> int:
    reader = Consumer(settings, group_id=None, client_id="state-bench.count")
    try:
        total = 0
        for p in range(partitions):
            low, high = reader.watermarks(settings.topics.status, p)
            total += high - low
        return total
    finally:
        reader.close()


def wait_for_retention(settings: KafkaSettings, partitions: int, keep: int, limit_s: float) -> int:
    """Wait until the broker deleted the status topic's segments past its retention:
    at most ``keep`` records left (about the open segments), and some deleted."""
    deadline = time.monotonic() + limit_s
    reader = Consumer(settings, group_id=None, client_id="state-bench.wait")
    try:
        while True:
            marks = [reader.watermarks(settings.topics.status, p) for p in range(partitions)]
            left = sum(high - low for low, high in marks)
            deleted = any(low > 0 for low, _ in marks)
            if (deleted and left <= keep) or time.monotonic() >= deadline:
                return left
            time.sleep(5)
    finally:
        reader.close()


def rss_mb(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    kb = int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1))  # type: ignore[union-attr]
    return kb / 1024


def measure_coordinator(settings: KafkaSettings, retention: str, log: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["SAGA_KAFKA_BOOTSTRAP"] = settings.bootstrap
    env["SAGA_TOPIC_PREFIX"] = settings.prefix
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator", "-v", "coordinator", "run",
             "--instance-id", "bench", "--retention", retention],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = started + 600
        while time.monotonic() < deadline:
            found = READY.search(log.read_text(errors="replace"))
            if found:
                ready_s = time.monotonic() - started
                return {
                    "ready_s": round(ready_s, 2),
                    "rss_mb": round(rss_mb(proc.pid), 1),
                    "restored": int(found.group(1)),
                }
            if proc.poll() is not None:
                raise SystemExit(f"the coordinator exited; see {log}")
            time.sleep(0.05)
        raise SystemExit(f"the coordinator was not ready within 600 s; see {log}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure_client(settings: KafkaSettings) -> dict[str, Any]:
    started = time.monotonic()
    client = SagaClient(settings)
    try:
        if not client.wait_caught_up(600):
            raise SystemExit("the client's status view did not catch up within 600 s")
        return {"ready_s": round(time.monotonic() - started, 2), "sagas": len(client.statuses())}
    finally:
        client.close()


def run_size(args: argparse.Namespace, sagas: int) -> dict[str, Any]:
    bootstrap = os.environ.get("SAGA_KAFKA_BOOTSTRAP")
    if not bootstrap:
        raise SystemExit(
            'no Kafka address: run `make infra-up` and eval "$(infra/services.sh env)"'
        )
    settings = KafkaSettings(bootstrap=bootstrap, prefix=unique_name("state"))
    retention_ms = parse_duration_ms(args.retention)
    create_topics(
        settings,
        args.partitions,
        retention_ms=retention_ms,
        status_segment_bytes=args.segment_bytes,
    )
    try:
        say(f"{sagas:,} sagas under {settings.prefix}: writing their history")
        recent = min(args.live, sagas)
        t0 = time.monotonic()
        counts = collections.Counter(
            history(
                settings,
                0,
                sagas - recent,
                args.rate,
                retention_ms,
                int(time.time() * 1000),
                recent=False,
            )
        )
        written = time.monotonic() - t0
        per_segment = args.segment_bytes // 200
        say(f"  {sagas - recent:,} written in {written:.0f} s; waiting for the broker's retention")
        left = wait_for_retention(
            settings, args.partitions, args.partitions * per_segment, args.wait
        )
        say(f"  status topic: {left:,} records left; writing the last {recent:,} sagas")
        counts.update(
            history(
                settings,
                sagas - recent,
                recent,
                args.rate,
                retention_ms,
                int(time.time() * 1000),
                recent=True,
            )
        )
        commit_coordinator_offsets(settings, args.partitions)
        left = status_records(settings, args.partitions)
        client: list[dict[str, Any]] = []
        coordinator: list[dict[str, Any]] = []
        for _ in range(args.repeat):
            client.append(measure_client(settings))
            log = args.out.parent / f"state-bench-{sagas}.log"
            coordinator.append(measure_coordinator(settings, args.retention, log))
        return {
            "sagas": sagas,
            "records_written": dict(counts),
            "status_records_left": left,
            "coordinator_ready_s": median(c["ready_s"] for c in coordinator),
            "coordinator_rss_mb": median(c["rss_mb"] for c in coordinator),
            "coordinator_restored": int(median(c["restored"] for c in coordinator)),
            "client_ready_s": median(c["ready_s"] for c in client),
            "client_sagas": int(median(c["sagas"] for c in client)),
            "runs": {"coordinator": coordinator, "client": client},
        }
    finally:
        delete_topics(settings, list(settings.topics.all))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000", help="history sizes, in sagas")
    parser.add_argument(
        "--rate", type=float, default=1000.0, help="sagas per second of the history"
    )
    parser.add_argument("--retention", default="30s", help="the coordinator's --retention")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument(
        "--live", type=int, default=5000, help="sagas written just before measuring"
    )
    parser.add_argument("--segment-bytes", type=int, default=1 << 20, help="status topic segments")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per size (median)")
    parser.add_argument("--wait", type=float, default=900, help="seconds to wait for retention")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "state-bench.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = [run_size(args, int(n)) for n in args.sizes.split(",")]
    base = results[0]
    print()
    header = ("sagas", "status left", "restored", "coord ready s", "coord RSS MB", "client ready s")
    print("  ".join(f"{h:>14}" for h in header))
    for r in results:
        cells = (
            f"{r['sagas']:,}",
            f"{r['status_records_left']:,}",
            f"{r['coordinator_restored']:,}",
            f"{r['coordinator_ready_s']:.2f}",
            f"{r['coordinator_rss_mb']:.1f}",
            f"{r['client_ready_s']:.2f}",
        )
        print("  ".join(f"{c:>14}" for c in cells))
    for r in results[1:]:
        print(
            f"ratio {r['sagas']:,} / {base['sagas']:,}: coordinator ready "
            f"{r['coordinator_ready_s'] / base['coordinator_ready_s']:.2f}x, RSS "
            f"{r['coordinator_rss_mb'] / base['coordinator_rss_mb']:.2f}x, client ready "
            f"{r['client_ready_s'] / base['client_ready_s']:.2f}x (bound: 1.5x)"
        )
    report = {"settings": {k: str(v) for k, v in vars(args).items()}, "results": results}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
