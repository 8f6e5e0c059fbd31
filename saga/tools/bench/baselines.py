"""The two baselines measured in the same run as the sagas.

* direct writes: the saga's increments on the same three stores, batched, by
  plain loops (one process per store), without saga machinery;
* log bound: produce + consume throughput of records like the saga's on the
  same broker, divided by the records one saga writes.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Final

import sqlalchemy as sa
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from saga.streams import TransientError, encode
from saga.streams.kafka import Consumer, KafkaSettings, Producer, create_topics, delete_topics
from saga.tools.bench.config import (
    FIELD_OF,
    MAX_AMOUNT,
    PARTICIPANTS,
    TARGET_OF,
    BenchConfig,
    Layout,
    account,
)
from saga.tools.bench.proc import CpuMeter
from saga.tools.bench.stores import mongo_client, prepare_data, redis_key, sa_url, target_table
from saga.tools.bench.workload import Workload

_MONGO_UPDATES_PER_COMMAND: Final = 50


# --------------------------------------------------------------------------- direct writes


def _direct_worker(
    participant: str,
    store: str,
    url: str,
    schema: str,
    accounts: int,
    batch: int,
    duration: float,
    seed: int,
    go: Any,
    out: Any,
) -> None:
    """Write ``participant``'s increments of the workload in batches to ``store``, with no
    saga machinery."""
    rng = random.Random(seed)
    try:
        write = _direct_writer(participant, store, url, schema)
        out.put(("ready", participant, os.getpid(), 0, 0.0))
        go.wait()
        writes = 0
        start = time.monotonic()
        end = start + duration
        last = start
        while last < end:
            write(
                [
                    (account(rng.randrange(accounts)), rng.randint(1, MAX_AMOUNT))
                    for _ in range(batch)
                ]
            )
            writes += batch
            last = time.monotonic()
        out.put(("done", participant, os.getpid(), writes, last - start))
    except Exception as exc:  # reported to the parent, which raises one sentence
        out.put(("error", participant, os.getpid(), 0, f"{type(exc).__name__}: {exc}"))


def _direct_writer(
    participant: str, store: str, url: str, schema: str
) -> Callable[[list[tuple[str, int]]], None]:
    """One batch of ``participant``'s increments (the bank's are debits) as one write."""
    sign = -1 if participant == "bank" else 1
    field = FIELD_OF[participant]
    if store in ("postgres", "mariadb"):
        engine = sa.create_engine(sa_url(url))
        table = target_table(schema, participant, store)
        column = table.c[field]
        where = table.c.id == sa.bindparam("k")
        if sign < 0:
            where = sa.and_(where, column + sa.bindparam("a") >= 0)
        stmt = sa.update(table).where(where).values({field: column + sa.bindparam("a")})

        def write_sql(items: list[tuple[str, int]]) -> None:
            with engine.begin() as conn:  # one transaction per batch, like the participant
                conn.execute(stmt, [{"k": k, "a": sign * a} for k, a in items])

        return write_sql
    if store == "ferretdb":
        import pymongo

        client: pymongo.MongoClient[dict[str, Any]] = mongo_client(url)
        docs = client[schema][TARGET_OF[participant]]

        def write_mongo(items: list[tuple[str, int]]) -> None:
            # No transactions on FerretDB: the batch is a few update commands. FerretDB
            # v1.24 on SQLite stops answering altogether when one update command holds
            # 100 updates or more, hence at most _MONGO_UPDATES_PER_COMMAND per command.
            ops = [pymongo.UpdateOne({"_id": k}, {"$inc": {field: sign * a}}) for k, a in items]
            for i in range(0, len(ops), _MONGO_UPDATES_PER_COMMAND):
                docs.bulk_write(ops[i : i + _MONGO_UPDATES_PER_COMMAND], ordered=False)

        return write_mongo
    import redis

    r = redis.Redis.from_url(url, socket_timeout=60)

    def write_redis(items: list[tuple[str, int]]) -> None:
        with r.pipeline(transaction=True) as pipe:  # MULTI/EXEC per batch
            for k, a in items:
                pipe.hincrby(redis_key(schema, participant, k), field, sign * a)
            pipe.execute()

    return write_redis


@dataclass
class DirectResult:
    duration_s: float
    batch: int
    layout: str = "default"
    writes_per_s: dict[str, float] = field(default_factory=dict)
    sagas_per_s: float = 0.0
    cpu_s: dict[str, float | None] = field(default_factory=dict)
    cpu_s_per_saga: dict[str, float | None] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_direct(
    cfg: BenchConfig, layout: Layout, console: Console, services: Mapping[str, int | None]
) -> DirectResult:
    """The direct-write baseline: one process per participant, on the store ``layout``
    gives it, all three writing at once."""
    with console.status(f"direct ({layout.name}): preparing the accounts"):
        prepare_data(cfg, layout)
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    out = ctx.Queue()
    urls = {
        "postgres": cfg.postgres_url,
        "ferretdb": cfg.mongo_url,
        "redis": cfg.redis_url,
        "mariadb": cfg.mariadb_url,
    }
    workers = [
        ctx.Process(
            target=_direct_worker,
            args=(
                s,
                layout.stores[s],
                urls[layout.stores[s]],
                cfg.schema,
                cfg.accounts,
                cfg.batch,
                cfg.baseline_duration,
                cfg.seed + i,
                go,
                out,
            ),
            daemon=True,
        )
        for i, s in enumerate(PARTICIPANTS)
    ]
    result = DirectResult(duration_s=cfg.baseline_duration, batch=cfg.batch, layout=layout.name)
    try:
        for w in workers:
            w.start()
        pids: dict[str, int | None] = {}
        for _ in workers:
            kind, store, pid, _, info = _get(out, 60, "a direct-write worker did not start")
            if kind == "error":
                raise TransientError(f"the direct writes to {store} failed: {info}")
            pids[f"direct writer {store} ({layout.kind(store)})"] = pid
        pids.update(services)
        meter = CpuMeter(pids)
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        with progress:
            task = progress.add_task(
                f"direct writes, {layout.name} (batches of {cfg.batch}, 3 at once)",
                total=cfg.baseline_duration,
            )
            meter.start()
            go.set()
            start = time.monotonic()
            done: dict[str, tuple[int, float]] = {}
            while len(done) < len(workers):
                progress.update(
                    task, completed=min(cfg.baseline_duration, time.monotonic() - start)
                )
                item = _poll(out, 0.25)
                if item is not None:
                    kind, store, _, writes, info = item
                    if kind == "error":
                        raise TransientError(f"the direct writes to {store} failed: {info}")
                    done[store] = (writes, float(info))
                    if len(done) == 1:
                        meter.stop()  # the window where all three wrote at once
                elif any(w.exitcode not in (None, 0) for w in workers):
                    raise TransientError("a direct-write worker died without a result")
                if time.monotonic() - start > cfg.baseline_duration + 120:
                    raise TransientError("the direct-write workers did not finish in time")
            progress.update(task, completed=cfg.baseline_duration)
    finally:
        go.set()
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
    result.writes_per_s = {
        f"{s} ({layout.kind(s)})": round(writes / elapsed, 1)
        for s, (writes, elapsed) in done.items()
    }
    result.sagas_per_s = min(result.writes_per_s.values())
    result.cpu_s = meter.used
    n = result.sagas_per_s * cfg.baseline_duration
    result.cpu_s_per_saga = {
        k: None if v is None or n <= 0 else round(v / n, 6) for k, v in meter.used.items()
    }
    return result


def _poll(queue: Any, timeout: float) -> tuple[str, str, int, int, Any] | None:
    """The next ``(kind, who, pid, count, info)`` a worker reported, or ``None``."""
    import queue as queue_mod

    try:
        item: tuple[str, str, int, int, Any] = queue.get(timeout=timeout)
    except queue_mod.Empty:
        return None
    return item


def _get(queue: Any, timeout: float, problem: str) -> tuple[str, str, int, int, Any]:
    item = _poll(queue, timeout)
    if item is None:
        raise TransientError(problem)
    return item


# --------------------------------------------------------------------------- log bound


def _log_producer(
    bootstrap: str,
    prefix: str,
    extra: dict[str, str],
    records: list[tuple[bytes | None, bytes | None]],
    duration: float,
    go: Any,
    out: Any,
) -> None:
    try:
        settings = KafkaSettings(bootstrap, prefix, extra)
        producer = Producer(settings, client_id="saga.bench.log")
        topic = settings.topics.requests
        out.put(("ready", "producer", os.getpid(), 0, 0.0))
        go.wait()
        start = time.monotonic()
        end = start + duration
        n = 0
        size = len(records)
        while True:
            for i in range(1000):
                key, value = records[(n + i) % size]
                producer.produce(topic, key, value)
            n += 1000
            if time.monotonic() >= end:
                break
        producer.flush(60)
        elapsed = time.monotonic() - start
        producer.close()
        out.put(("done", "producer", os.getpid(), n, elapsed))
    except Exception as exc:
        out.put(("error", "producer", os.getpid(), 0, f"{type(exc).__name__}: {exc}"))


def _log_consumer(
    bootstrap: str,
    prefix: str,
    extra: dict[str, str],
    partitions: int,
    limit_s: float,
    go: Any,
    total: Any,
    out: Any,
) -> None:
    try:
        settings = KafkaSettings(bootstrap, prefix, extra)
        consumer = Consumer(settings, group_id=None, client_id="saga.bench.log")  # read_committed
        topic = settings.topics.requests
        consumer.assign([(topic, p, 0) for p in range(partitions)])
        consumer.poll_batch(1, 0.5)  # connected before the clock starts
        out.put(("ready", "consumer", os.getpid(), 0, 0.0))
        go.wait()
        start = time.monotonic()
        n = 0
        last = start
        while time.monotonic() - start < limit_s:
            batch = consumer.poll_batch(10_000, 0.1)
            if batch:
                n += len(batch)
                last = time.monotonic()
            expected = total.value
            if expected >= 0 and n >= expected:
                break
        consumer.close()
        out.put(("done", "consumer", os.getpid(), n, last - start))
    except Exception as exc:
        out.put(("error", "consumer", os.getpid(), 0, f"{type(exc).__name__}: {exc}"))


@dataclass
class LogResult:
    duration_s: float
    records: int = 0
    record_bytes: float = 0.0
    records_per_s: float = 0.0
    produce_records_per_s: float = 0.0
    records_per_saga: float = 0.0
    records_per_saga_measured: bool = True
    sagas_per_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def synthetic_records() -> tuple[list[tuple[bytes | None, bytes | None]], float]:
    """Without a saga phase: the records one committed saga writes, encoded by the codec."""
    from saga.streams import (
        Decision,
        Outcome,
        SagaState,
        SagaStatus,
        StepEvent,
        StepProgress,
        StepStatus,
    )

    workload = Workload(
        accounts=10_000, fail_share=0.0, seed=1, tx_prefix="bench-synthetic", timeout_s=60
    )
    records: list[tuple[bytes | None, bytes | None]] = []
    for _ in range(200):
        request, _, _ = workload.next()
        tx, at = request.tx_id, request.created_ms
        key = tx.encode()
        records.append((key, encode(request)))
        for status in (StepStatus.APPLIED, StepStatus.COMMITTED):
            for i, p in enumerate(PARTICIPANTS):
                records.append((key, encode(StepEvent(tx, i, p, status, at))))
        records.append((key, encode(Decision(tx, Outcome.COMMIT, "all steps applied", at))))
        for state, step in (
            (SagaState.COMMITTING, StepStatus.APPLIED),
            (SagaState.COMMITTED, StepStatus.COMMITTED),
        ):
            progress = tuple(StepProgress(p, step) for p in PARTICIPANTS)
            status_record = SagaStatus(
                tx,
                "bench-transfer",
                state,
                progress,
                "all steps applied",
                at,
                at,
                at + 60_000,
                request.fingerprint(),
            )
            records.append((key, encode(status_record)))
    per_saga = len(records) / 200
    random.Random(1).shuffle(records)
    return records, per_saga


def run_log_bound(
    cfg: BenchConfig,
    console: Console,
    records: list[tuple[bytes | None, bytes | None]],
    records_per_saga: float,
    measured: bool,
) -> LogResult:
    """Produce (idempotent, acks=all) and consume (read_committed) at once, on a fresh topic."""
    settings = KafkaSettings(cfg.kafka.bootstrap, f"{cfg.kafka.prefix}.log", cfg.kafka.extra)
    create_topics(settings, cfg.partitions)
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    total = ctx.Value("q", -1)
    out = ctx.Queue()
    extra = dict(cfg.kafka.extra)
    limit = cfg.baseline_duration + 120
    procs = [
        ctx.Process(
            target=_log_producer,
            args=(
                settings.bootstrap,
                settings.prefix,
                extra,
                records,
                cfg.baseline_duration,
                go,
                out,
            ),
            daemon=True,
        ),
        ctx.Process(
            target=_log_consumer,
            args=(
                settings.bootstrap,
                settings.prefix,
                extra,
                cfg.partitions,
                limit,
                go,
                total,
                out,
            ),
            daemon=True,
        ),
    ]
    result = LogResult(duration_s=cfg.baseline_duration)
    result.record_bytes = round(
        sum(len(k or b"") + len(v or b"") for k, v in records) / max(1, len(records)), 1
    )
    try:
        for p in procs:
            p.start()
        for _ in procs:
            kind, who, _, _, info = _get(out, 60, "a log-bound process did not start")
            if kind == "error":
                raise TransientError(f"the log-bound {who} failed: {info}")
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        done: dict[str, tuple[int, float]] = {}
        with progress:
            task = progress.add_task(
                f"log bound ({result.record_bytes:.0f}-byte records, produce + consume)",
                total=cfg.baseline_duration,
            )
            go.set()
            start = time.monotonic()
            while len(done) < 2:
                progress.update(
                    task, completed=min(cfg.baseline_duration, time.monotonic() - start)
                )
                item = _poll(out, 0.25)
                if item is not None:
                    kind, who, _, n, info = item
                    if kind == "error":
                        raise TransientError(f"the log-bound {who} failed: {info}")
                    done[who] = (n, float(info))
                    if who == "producer":
                        total.value = n
                elif any(p.exitcode not in (None, 0) for p in procs):
                    raise TransientError("a log-bound process died without a result")
                if time.monotonic() - start > limit + 30:
                    raise TransientError("the log-bound processes did not finish in time")
            progress.update(task, completed=cfg.baseline_duration)
    finally:
        go.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if not cfg.keep_topics:
            with suppress(Exception):
                delete_topics(settings, settings.topics.all)
    produced, produce_s = done["producer"]
    consumed, consume_s = done["consumer"]
    if consumed < produced:
        raise TransientError(
            f"the log-bound consumer read {consumed} of {produced} records: is Kafka overloaded?"
        )
    result.records = produced
    result.produce_records_per_s = round(produced / produce_s, 1)
    result.records_per_s = round(produced / max(produce_s, consume_s), 1)
    result.records_per_saga = records_per_saga
    result.records_per_saga_measured = measured
    result.sagas_per_s = round(result.records_per_s / records_per_saga, 1)
    return result
