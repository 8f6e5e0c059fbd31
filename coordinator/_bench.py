"""The benchmark: sustained sagas/s and latencies against two baselines measured in the same run.

``saga bench`` runs these phases (``--phases`` picks some):

* ``main``     closed loop at maximum (a window of sagas in flight), all commit;
* ``latency``  open loop at a fixed rate (``--rate`` sagas/s): decision latency;
* ``rollback`` closed loop with a share of sagas rejected (``--rollback-fail-share``);
* ``direct``   the direct-write baseline: the same increments on the same three
  stores, batched, written by plain loops (one process per store) without saga
  machinery;
* ``log``      the log bound: produce + consume throughput of records like the
  saga's (sampled from the main run's topics) on the same broker, divided by the
  records one saga writes.

Each saga phase gets fresh topics (``<prefix>.<phase>``), freshly prepared data
and fresh coordinator and participant processes, started exactly as a user
would (``python -m coordinator coordinator run`` / ``participant run``), and
drains every saga it sent before it stops them: nothing of one phase runs
during the next.

The workload is a transfer of three steps, one per participant, built from the
built-in ``increment`` action: ``bank`` debits an account in PostgreSQL (never
below 0), ``wallet`` credits a wallet in the MongoDB-wire server, ``rewards``
credits points in Redis. A saga designed to fail addresses a key that does not
exist in one of the three stores (rotating), so exactly ``fail share`` of the
sagas are rejected and the other two steps are compensated.

Figures, over the measured window after the warm-up:

* sagas/s: sagas whose final status (``committed`` / ``rolled_back``) was
  published inside the window, divided by its length;
* decision latency: the coordinator's decision record ``at_ms`` minus the
  request's ``created_ms``; completion latency: the final status' ``updated_ms``
  minus ``created_ms`` (both for the sagas submitted inside the window);
* CPU seconds per saga of every process, from ``/proc/<pid>/stat``
  (PostgreSQL: the postmaster and all its children).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import platform
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import orjson
import sqlalchemy as sa
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from streams import (
    ConfigurationError,
    Mode,
    SagaRequest,
    Step,
    TransientError,
    encode,
)
from streams._kafka import (
    Consumer,
    KafkaSettings,
    Producer,
    create_topics,
    delete_topics,
)
from streams._lifecycle import wall_clock_ms

PHASES: Final = ("main", "latency", "rollback", "direct", "log")
SAGA_PHASES: Final = ("main", "latency", "rollback")
PARTICIPANTS: Final = ("bank", "wallet", "rewards")
STORAGE_OF: Final = {"bank": "sql", "wallet": "mongo", "rewards": "redis"}
TARGET_OF: Final = {"bank": "accounts", "wallet": "wallets", "rewards": "points"}
OPENING_BALANCE: Final = 10**12  # debits never reach the minimum: only designed failures fail
MAX_AMOUNT: Final = 100
SERVICES: Final = ("kafka", "postgres", "redis", "ferretdb")
_PID_FILE: Final = {"kafka": "kafka", "postgres": "postgres", "redis": "redis", "ferretdb": "mongo"}
_CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
_PROBE_TIMEOUT_S: Final = 120.0
CLIENT: Final = "client (bench)"
_MONGO_UPDATES_PER_COMMAND: Final = 50


@dataclass(frozen=True)
class BenchConfig:
    kafka: KafkaSettings
    postgres_url: str
    mongo_url: str
    redis_url: str
    phases: tuple[str, ...] = PHASES
    warmup: float = 10.0
    duration: float = 60.0
    latency_duration: float = 30.0
    rollback_duration: float = 30.0
    baseline_duration: float = 20.0
    rate: float = 500.0
    window: int = 1000
    fail_share: float = 0.0
    rollback_fail_share: float = 0.2
    partitions: int = 4
    workers: int = 1
    accounts: int = 10_000
    batch: int = 500
    saga_timeout: float = 60.0
    drain_timeout: float = 120.0
    schema: str = "saga_bench"
    report: Path = Path("reports/bench.json")
    logs: Path = Path(".infra/logs/bench")
    seed: int = 7
    keep_topics: bool = False
    service_pids: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown or not self.phases:
            raise ConfigurationError(
                f"unknown phase {', '.join(unknown) or '(none given)'}: "
                f"pick from {', '.join(PHASES)}"
            )
        if self.warmup < 0 or min(self.duration, self.latency_duration) <= 0:
            raise ConfigurationError("durations must be positive seconds (the warm-up may be 0)")
        if min(self.rollback_duration, self.baseline_duration) <= 0:
            raise ConfigurationError("durations must be positive seconds (the warm-up may be 0)")
        if self.rate <= 0 or self.window < 1 or self.batch < 1 or self.accounts < 1:
            raise ConfigurationError("--rate, --window, --batch and --accounts must be positive")
        if not 0 <= self.fail_share <= 1 or not 0 <= self.rollback_fail_share <= 1:
            raise ConfigurationError("a failure share is a fraction between 0 and 1")
        unknown = [n for n in self.service_pids if n not in SERVICES]
        if unknown:
            raise ConfigurationError(
                f"--service-pid names {', '.join(unknown)}: use one of {', '.join(SERVICES)}"
            )
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", self.schema) is None:
            raise ConfigurationError(
                f"--schema {self.schema!r} must be a letter or _ followed by up to 62 "
                "letters, digits or _"
            )


def _sa_url(url: str) -> str:
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def account(i: int) -> str:
    return f"a{i:06d}"


def _mongo_client(url: str) -> Any:
    """A client that gives up on a server that stops answering, instead of waiting forever."""
    import pymongo

    return pymongo.MongoClient(url, serverSelectionTimeoutMS=10_000, socketTimeoutMS=60_000)


# --------------------------------------------------------------------------- services


def check_services(cfg: BenchConfig, console: Console) -> None:
    """One line per service: it answers, or the bench stops with a sentence saying which."""
    from coordinator._demo import DemoConfig
    from coordinator._demo import check_services as check

    check(DemoConfig(cfg.kafka, cfg.postgres_url, cfg.mongo_url, cfg.redis_url), console)
    # A stuck MongoDB-wire server still answers the handshake; ask it for real work.
    import pymongo

    client: pymongo.MongoClient[dict[str, Any]] = pymongo.MongoClient(
        cfg.mongo_url, serverSelectionTimeoutMS=5_000, socketTimeoutMS=10_000
    )
    try:
        client[cfg.schema].list_collection_names()
    except pymongo.errors.PyMongoError as exc:
        raise TransientError(
            f"the MongoDB-wire server at {cfg.mongo_url} accepts connections but does not "
            "answer database commands within 10 s: is it stuck? (restart it)"
        ) from exc
    finally:
        client.close()


@contextmanager
def _store(cfg: BenchConfig, which: str) -> Iterator[Any]:
    """A connection to one store; its failures read as one sentence naming the store."""
    import pymongo
    import redis

    urls = {"postgres": cfg.postgres_url, "mongo": cfg.mongo_url, "redis": cfg.redis_url}
    names = {"postgres": "PostgreSQL", "mongo": "the MongoDB-wire server", "redis": "Redis"}
    handle: Any = None
    try:
        if which == "postgres":
            handle = sa.create_engine(_sa_url(cfg.postgres_url))
        elif which == "mongo":
            handle = _mongo_client(cfg.mongo_url)
        else:
            handle = redis.Redis.from_url(cfg.redis_url, socket_timeout=60)
        yield handle
    except (sa.exc.OperationalError, pymongo.errors.PyMongoError, redis.RedisError) as exc:
        detail = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        raise TransientError(f"{names[which]} at {urls[which]} failed: {detail}") from exc
    finally:
        if handle is not None:
            handle.dispose() if which == "postgres" else handle.close()


def prepare_data(cfg: BenchConfig) -> None:
    """Fresh accounts in the three stores (and no ledgers): the schema, database and keys."""
    with _store(cfg, "postgres") as engine, engine.begin() as conn:
        conn.execute(sa.schema.DropSchema(cfg.schema, cascade=True, if_exists=True))
        conn.execute(sa.schema.CreateSchema(cfg.schema))
        table = _accounts_table(cfg.schema)
        table.create(conn)
        conn.execute(
            table.insert(),
            [{"id": account(i), "balance": OPENING_BALANCE} for i in range(cfg.accounts)],
        )
    with _store(cfg, "mongo") as mongo:
        mongo.drop_database(cfg.schema)
        wallets = mongo[cfg.schema][TARGET_OF["wallet"]]
        for start in range(0, cfg.accounts, 5000):
            end = min(cfg.accounts, start + 5000)
            wallets.insert_many([{"_id": account(i), "balance": 0} for i in range(start, end)])
    with _store(cfg, "redis") as r:
        _drop_redis(r, cfg.schema)
        with r.pipeline(transaction=False) as pipe:
            for i in range(cfg.accounts):
                pipe.hset(_points_key(cfg.schema, account(i)), "points", 0)
            pipe.execute()


def drop_data(cfg: BenchConfig) -> None:
    """Remove what :func:`prepare_data` and the participants created."""
    with _store(cfg, "postgres") as engine, engine.begin() as conn:
        conn.execute(sa.schema.DropSchema(cfg.schema, cascade=True, if_exists=True))
    with _store(cfg, "mongo") as mongo:
        mongo.drop_database(cfg.schema)
    with _store(cfg, "redis") as r:
        _drop_redis(r, cfg.schema)


def _points_key(schema: str, key: str) -> str:
    return f"{schema}:{TARGET_OF['rewards']}:{key}"


def _drop_redis(r: Any, prefix: str) -> None:
    batch: list[bytes] = []
    for key in r.scan_iter(match=f"{prefix}:*", count=5000):
        batch.append(key)
        if len(batch) >= 5000:
            r.unlink(*batch)
            batch = []
    if batch:
        r.unlink(*batch)


def _accounts_table(schema: str) -> sa.Table:
    return sa.Table(
        TARGET_OF["bank"],
        sa.MetaData(schema=schema),
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("balance", sa.BigInteger, nullable=False),
    )


def store_totals(cfg: BenchConfig) -> dict[str, int]:
    """Money moved per store: debited from PostgreSQL, credited to MongoDB and Redis."""
    table = _accounts_table(cfg.schema)
    with _store(cfg, "postgres") as engine, engine.connect() as conn:
        left = conn.execute(sa.select(sa.func.sum(table.c.balance))).scalar()
    with _store(cfg, "mongo") as mongo:
        docs = mongo[cfg.schema][TARGET_OF["wallet"]].find({}, {"balance": 1})
        wallets = sum(int(d.get("balance", 0)) for d in docs)
    with _store(cfg, "redis") as r, r.pipeline(transaction=False) as pipe:
        for i in range(cfg.accounts):
            pipe.hget(_points_key(cfg.schema, account(i)), "points")
        points = sum(int(v or 0) for v in pipe.execute())
    return {
        "bank": cfg.accounts * OPENING_BALANCE - int(left or 0),
        "wallet": wallets,
        "rewards": points,
    }


# --------------------------------------------------------------------------- CPU accounting


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # fields from 3 (state) on


def _children(pid: int) -> list[int]:
    """The live children of ``pid`` (from /proc/<pid>/task/*/children, else a scan of /proc)."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    listed = False
    for task in tasks:
        try:
            found.extend(int(c) for c in (task / "children").read_text().split())
            listed = True
        except (OSError, ValueError):
            continue
    if listed:
        return found
    for entry in Path("/proc").iterdir():  # kernels without CONFIG_PROC_CHILDREN
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[1] == str(pid):
                found.append(int(entry.name))
    return found


def process_cpu_s(pid: int, *, tree: bool = True) -> float | None:
    """utime + stime of ``pid`` in seconds; with ``tree``, also its live and reaped descendants."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    ticks = int(fields[11]) + int(fields[12])
    if tree:
        ticks += int(fields[13]) + int(fields[14])  # reaped children
        for child in _children(pid):
            ticks += round((process_cpu_s(child, tree=True) or 0.0) * _CLK_TCK)
    return ticks / _CLK_TCK


def _port_of(url: str, default: int) -> int:
    if "://" not in url:
        url = "kafka://" + url.split(",", maxsplit=1)[0]
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1].split(",")[0]
    if ":" in netloc:
        with suppress(ValueError):
            return int(netloc.rsplit(":", 1)[1])
    return default


def _listens_on(pid: int, port: int) -> bool | None:
    """Whether ``pid`` holds a listening TCP socket on ``port`` (``None``: cannot tell)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    for fd in fds:
        with suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
    return False


def infra_dir() -> Path:
    configured = Path(os.environ.get("SAGA_INFRA_DIR", ".infra"))
    if configured.is_absolute() or (Path.cwd() / configured).exists():
        return configured
    return Path(__file__).resolve().parent.parent / configured


def service_pids(cfg: BenchConfig) -> dict[str, int | None]:
    """The pids of the local services infra/services.sh started and that serve cfg's addresses."""
    ports = {
        "kafka": _port_of(cfg.kafka.bootstrap, 9092),
        "postgres": _port_of(cfg.postgres_url, 5432),
        "redis": _port_of(cfg.redis_url, 6379),
        "ferretdb": _port_of(cfg.mongo_url, 27017),
    }
    pids: dict[str, int | None] = {}
    for name in SERVICES:
        if name in cfg.service_pids:  # given by the user: trusted if it exists
            given = cfg.service_pids[name]
            pids[name] = given if _stat_fields(given) is not None else None
            continue
        pid: int | None = None
        with suppress(OSError, ValueError):
            text = (infra_dir() / "pids" / f"{_PID_FILE[name]}.pid").read_text().split()
            pid = int(text[0]) if text else None
        if pid is not None and (
            _stat_fields(pid) is None or _listens_on(pid, ports[name]) is False
        ):
            pid = None
        pids[name] = pid
    return pids


@dataclass
class CpuMeter:
    """CPU seconds of named processes between :meth:`start` and :meth:`stop`."""

    pids: dict[str, int | None]
    self_only: frozenset[str] = frozenset()
    _start: dict[str, float | None] = field(default_factory=dict)
    used: dict[str, float | None] = field(default_factory=dict)

    def _read(self) -> dict[str, float | None]:
        return {
            name: None if pid is None else process_cpu_s(pid, tree=name not in self.self_only)
            for name, pid in self.pids.items()
        }

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> None:
        end = self._read()
        self.used = {
            name: None
            if self._start.get(name) is None or end[name] is None
            else round(max(0.0, end[name] - self._start[name]), 3)  # type: ignore[operator]
            for name in self.pids
        }


# --------------------------------------------------------------------------- processes


@contextmanager
def saga_processes(
    cfg: BenchConfig, settings: KafkaSettings, logs: Path
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The coordinator and ``workers`` processes per participant, as the user would run them."""
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--bootstrap", settings.bootstrap, "--prefix", settings.prefix]
    urls = {"sql": cfg.postgres_url, "mongo": cfg.mongo_url, "redis": cfg.redis_url}
    commands: dict[str, list[str]] = {
        "coordinator": [
            *("coordinator", "run", *common, "--instance-id", "bench"),
            *("--participants", ",".join(PARTICIPANTS)),
        ]
    }
    for name in PARTICIPANTS:
        storage = STORAGE_OF[name]
        for w in range(cfg.workers):
            commands[f"{name}#{w} ({storage})"] = [
                *("participant", "run", *common, "--name", name, "--storage", storage),
                *("--url", urls[storage], "--schema", cfg.schema, "--targets", TARGET_OF[name]),
            ]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, args in commands.items():
            log_name = name.split(" ")[0].replace("#", "-")
            with (logs / f"{log_name}.log").open("wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "coordinator", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def _check_alive(procs: Mapping[str, subprocess.Popen[bytes]], logs: Path) -> None:
    for name, p in procs.items():
        if p.poll() is not None:
            raise ConfigurationError(
                f"the {name} process exited early (status {p.returncode}); see its log in {logs}"
            )


# --------------------------------------------------------------------------- workload


class Workload:
    """Transfers of three steps; exactly ``fail_share`` of them rejected (a missing key)."""

    def __init__(
        self, *, accounts: int, fail_share: float, seed: int, tx_prefix: str, timeout_s: float
    ) -> None:
        self.accounts = accounts
        self.share = Fraction(fail_share).limit_denominator(10_000)
        self.rng = random.Random(seed)
        self.tx_prefix = tx_prefix
        self.timeout_ms = int(timeout_s * 1000)
        self.n = 0
        self.failures = 0

    def next(self) -> tuple[SagaRequest, int, bool]:
        """A request, its amount and whether it is designed to fail."""
        n = self.n
        self.n += 1
        share = self.share
        fails = math.floor((n + 1) * share) > math.floor(n * share)
        rng = self.rng
        amount = rng.randint(1, MAX_AMOUNT)
        keys = [account(rng.randrange(self.accounts)) for _ in PARTICIPANTS]
        if fails:
            keys[self.failures % 3] = f"missing-{n}"
            self.failures += 1
        steps = (
            Step(
                "bank",
                "increment",
                {"target": "accounts", "key": keys[0], "field": "balance", "by": -amount, "min": 0},
            ),
            Step(
                "wallet",
                "increment",
                {"target": "wallets", "key": keys[1], "field": "balance", "by": amount},
            ),
            Step(
                "rewards",
                "increment",
                {"target": "points", "key": keys[2], "field": "points", "by": amount},
            ),
        )
        now = wall_clock_ms()
        request = SagaRequest(
            tx_id=f"{self.tx_prefix}-{n}",
            saga="bench-transfer",
            mode=Mode.PARALLEL,
            steps=steps,
            deadline_ms=now + self.timeout_ms,
            created_ms=now,
        )
        return request, amount, fails


# --------------------------------------------------------------------------- statistics


def latency_summary(values: Sequence[int]) -> dict[str, float | None]:
    """p50 / p95 / p99 (nearest rank) and max, in ms; ``None`` without values."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "max": None, "n": 0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])

    return {
        "p50": rank(0.50),
        "p95": rank(0.95),
        "p99": rank(0.99),
        "max": float(ordered[-1]),
        "n": len(ordered),
    }


# --------------------------------------------------------------------------- saga phases


@dataclass
class SagaPhaseResult:
    name: str
    mode: str
    fail_share: float
    warmup_s: float
    duration_s: float
    offered_rate: float | None
    window: int | None
    sent: int = 0
    sent_in_window: int = 0
    completed_in_window: int = 0
    committed_in_window: int = 0
    rolled_back_in_window: int = 0
    failed: int = 0
    unexpected_rollbacks: int = 0
    unfinished: int = 0
    sagas_per_s: float = 0.0
    send_rate: float = 0.0
    shed: int = 0
    decision_latency_ms: dict[str, float | None] = field(default_factory=dict)
    completion_latency_ms: dict[str, float | None] = field(default_factory=dict)
    decision_seen_latency_ms: dict[str, float | None] = field(default_factory=dict)
    cpu_s: dict[str, float | None] = field(default_factory=dict)
    cpu_s_per_saga: dict[str, float | None] = field(default_factory=dict)
    cpu_cores_used: dict[str, float | None] = field(default_factory=dict)
    records_by_topic: dict[str, int] = field(default_factory=dict)
    records_per_saga: float | None = None
    records_per_saga_without_markers: float | None = None
    stores_agree: bool | None = None
    store_totals: dict[str, int] = field(default_factory=dict)
    expected_total: int = 0

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Tracker:
    """What the client knows about each saga it sent (wall-clock ms throughout)."""

    def __init__(self) -> None:
        self.created: dict[str, int] = {}
        self.amount: dict[str, int] = {}
        self.doomed: set[str] = set()
        self.decided_at: dict[str, int] = {}
        self.decision_seen: dict[str, int] = {}
        self.done: dict[str, tuple[int, str]] = {}

    def on_records(self, messages: Sequence[Any], decisions_topic: str) -> int:
        """Take decision and status records; returns how many sagas became final."""
        finished = 0
        now = wall_clock_ms()
        for m in messages:
            if m.value is None:
                continue
            try:
                data = orjson.loads(m.value)
            except orjson.JSONDecodeError:
                continue
            tx = data.get("tx_id")
            if tx not in self.created:
                continue
            if m.topic == decisions_topic:
                if tx not in self.decided_at:
                    self.decided_at[tx] = int(data["at_ms"])
                    self.decision_seen[tx] = now
            elif (
                data.get("state") in ("committed", "rolled_back", "failed") and tx not in self.done
            ):
                self.done[tx] = (int(data["updated_ms"]), str(data["state"]))
                finished += 1
        return finished


class SagaPhase:
    """One saga phase on fresh topics, data and processes (see :func:`run_saga_phase`)."""

    def __init__(
        self,
        cfg: BenchConfig,
        console: Console,
        result: SagaPhaseResult,
        services: Mapping[str, int | None],
        seed: int,
    ) -> None:
        self.cfg = cfg
        self.console = console
        self.result = result
        self.services = services
        self.settings = KafkaSettings(
            cfg.kafka.bootstrap, f"{cfg.kafka.prefix}.{result.name}", cfg.kafka.extra
        )
        self.topics = self.settings.topics
        self.logs = cfg.logs / result.name
        self.workload = Workload(
            accounts=cfg.accounts,
            fail_share=result.fail_share,
            seed=seed,
            tx_prefix=self.settings.prefix,
            timeout_s=cfg.saga_timeout,
        )
        self.tracker = _Tracker()
        self.completed = 0
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self.meter = CpuMeter({})
        self.t0_ms = self.t1_ms = 0
        self.completed_at_t0 = 0

    # -- the pieces the loop uses

    @property
    def producer(self) -> Producer:
        assert self._producer is not None
        return self._producer

    @property
    def consumer(self) -> Consumer:
        assert self._consumer is not None
        return self._consumer

    def send_one(self) -> None:
        request, amount, doomed = self.workload.next()
        tx = request.tx_id
        self.tracker.created[tx] = request.created_ms
        self.tracker.amount[tx] = amount
        if doomed:
            self.tracker.doomed.add(tx)
        self.producer.produce(self.topics.requests, tx, encode(request))

    def receive(self, timeout: float) -> None:
        batch = self.consumer.poll_batch(5000, timeout)
        if batch:
            self.completed += self.tracker.on_records(batch, self.topics.decisions)

    @property
    def in_flight(self) -> int:
        return len(self.tracker.created) - self.completed

    def check_alive(self) -> None:
        _check_alive(self.procs, self.logs)

    # -- the phase

    def run(self) -> list[tuple[bytes | None, bytes | None]]:
        """Runs the phase, fills :attr:`result`; returns a sample of the phase's records."""
        cfg, result = self.cfg, self.result
        with self.console.status(
            f"{result.name}: preparing {cfg.accounts} accounts per store and the topics"
        ):
            prepare_data(cfg)
            create_topics(self.settings, cfg.partitions)
        try:
            with saga_processes(cfg, self.settings, self.logs) as procs:
                self.procs = procs
                self._producer = Producer(self.settings, client_id="saga.bench")
                self._consumer = Consumer(
                    self.settings, group_id=None, client_id="saga.bench.status"
                )
                try:
                    self.consumer.assign(
                        [
                            (t, p, 0)
                            for t in (self.topics.decisions, self.topics.status)
                            for p in range(cfg.partitions)
                        ]
                    )
                    self._await_ready()
                    self._drive()
                finally:
                    self.consumer.close()
                    self.producer.close()
            self._summarise()
            result.records_by_topic = _end_offsets(self.settings, cfg.partitions)
            if self.tracker.created:
                total = sum(result.records_by_topic.values())
                result.records_per_saga = round(total / len(self.tracker.created), 3)
            sample, record_share = _sample_records(
                self.settings, cfg.partitions, result.records_by_topic
            )
            if self.tracker.created:
                records = sum(
                    n * record_share.get(t, 1.0) for t, n in result.records_by_topic.items()
                )
                result.records_per_saga_without_markers = round(
                    records / len(self.tracker.created), 3
                )
            with self.console.status(f"{result.name}: checking the three stores"):
                self._check_stores()
        finally:
            if not cfg.keep_topics:
                with suppress(Exception):
                    delete_topics(self.settings, self.topics.all)
        return sample

    def _await_ready(self) -> None:
        """One saga through every process: they have joined their groups once it finishes."""
        workers = len(self.procs) - 1
        with self.console.status(
            f"{self.result.name}: starting the coordinator and {workers} participant workers"
        ):
            self.send_one()
            self.producer.flush(30)
            deadline = time.monotonic() + _PROBE_TIMEOUT_S
            while self.completed == 0:
                self.receive(0.1)
                self.check_alive()
                if time.monotonic() > deadline:
                    raise TransientError(
                        f"the first saga did not finish within {_PROBE_TIMEOUT_S:.0f} s; "
                        f"see the logs in {self.logs}"
                    )

    def _drive(self) -> None:
        """Warm-up, then the measured window, then drain every saga sent."""
        cfg, result = self.cfg, self.result
        pids: dict[str, int | None] = {n: p.pid for n, p in self.procs.items()}
        pids[CLIENT] = os.getpid()
        pids.update(self.services)
        self.meter = CpuMeter(pids, self_only=frozenset({CLIENT}))
        closed = result.mode == "closed"
        how = f"closed loop, window {cfg.window}" if closed else f"open loop at {cfg.rate:g}/s"
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        with progress:
            task = progress.add_task(
                f"{result.name} ({how})", total=cfg.warmup + result.duration_s, info=""
            )
            sent_before = len(self.tracker.created)
            start = time.monotonic()
            t0, t1 = start + cfg.warmup, start + cfg.warmup + result.duration_s
            self.t0_ms = 0
            measuring = False
            next_ui = next_check = start
            sent_at_t0 = shed = 0
            # Open loop: while `window` sagas are in flight the system is not keeping up;
            # the sagas due are shed (counted, not sent), so backlog and drain stay bounded.
            backlog_cap = cfg.window
            while (now := time.monotonic()) < t1:
                if not measuring and now >= t0:
                    self.meter.start()
                    self.t0_ms = wall_clock_ms()
                    sent_at_t0 = len(self.tracker.created)
                    self.completed_at_t0 = self.completed
                    measuring = True
                if closed:
                    due = cfg.window - self.in_flight
                    timeout = 0.01 if due <= 0 else 0.0
                else:
                    offered = int((now - start) * cfg.rate)
                    due = offered - (len(self.tracker.created) - sent_before) - shed
                    timeout = min(0.005, 0.5 / cfg.rate)
                    if due > 0 and self.in_flight >= backlog_cap:
                        shed += due
                        result.shed += due if measuring else 0
                        due = 0
                for _ in range(min(due, 2000)):
                    self.send_one()
                self.receive(timeout)
                if now >= next_check:
                    self.check_alive()
                    next_check = now + 1.0
                if now >= next_ui:
                    info = self._progress_info(measuring)
                    progress.update(task, completed=now - start, info=info)
                    next_ui = now + 0.25
            self.meter.stop()
            self.t1_ms = wall_clock_ms()
            result.sent_in_window = len(self.tracker.created) - sent_at_t0
            progress.update(task, completed=cfg.warmup + result.duration_s)
            self.producer.flush(30)
            # Drain: every saga sent finishes before the processes stop, so nothing
            # of this phase is left to load the next one.
            total = len(self.tracker.created)
            drain = progress.add_task("  draining", total=total, info="")
            deadline = time.monotonic() + cfg.drain_timeout
            while self.completed < total and time.monotonic() < deadline:
                self.receive(0.1)
                self.check_alive()
                progress.update(drain, completed=self.completed, info=f"{self.in_flight} in flight")
            progress.update(drain, completed=self.completed)

    def _progress_info(self, measuring: bool) -> str:
        if not measuring:
            return f"warm-up  done {self.completed:,}  in flight {self.in_flight:,}"
        done = self.completed - self.completed_at_t0
        rate = done / max(0.001, (wall_clock_ms() - self.t0_ms) / 1000)
        shed = f"  shed {self.result.shed:,}" if self.result.shed else ""
        return f"measuring  ~{rate:,.0f} sagas/s  in flight {self.in_flight:,}{shed}"

    def _summarise(self) -> None:
        result, tracker = self.result, self.tracker
        t0_ms, t1_ms = self.t0_ms, self.t1_ms
        window_s = (t1_ms - t0_ms) / 1000
        result.duration_s = round(window_s, 3)
        result.sent = len(tracker.created)
        result.unfinished = result.sent - len(tracker.done)
        finals = [state for at, state in tracker.done.values() if t0_ms <= at < t1_ms]
        result.committed_in_window = finals.count("committed")
        result.rolled_back_in_window = finals.count("rolled_back")
        result.completed_in_window = result.committed_in_window + result.rolled_back_in_window
        result.failed = sum(1 for _, s in tracker.done.values() if s == "failed")
        result.unexpected_rollbacks = sum(
            1
            for tx, (_, s) in tracker.done.items()
            if s == "rolled_back" and tx not in tracker.doomed
        )
        result.sagas_per_s = round(result.completed_in_window / window_s, 1)
        result.send_rate = round(result.sent_in_window / window_s, 1)
        # Latencies of the sagas submitted inside the window (all drained by now).
        created = tracker.created
        in_window = [tx for tx, c in created.items() if t0_ms <= c < t1_ms]

        def summary(ends: Mapping[str, int]) -> dict[str, float | None]:
            return latency_summary([ends[tx] - created[tx] for tx in in_window if tx in ends])

        result.decision_latency_ms = summary(tracker.decided_at)
        result.decision_seen_latency_ms = summary(tracker.decision_seen)
        result.completion_latency_ms = summary({tx: at for tx, (at, _) in tracker.done.items()})
        used = self.meter.used
        n = result.completed_in_window
        result.cpu_s = used
        result.cpu_s_per_saga = {
            k: None if v is None or n == 0 else round(v / n, 6) for k, v in used.items()
        }
        result.cpu_cores_used = {
            k: None if v is None else round(v / window_s, 3) for k, v in used.items()
        }

    def _check_stores(self) -> None:
        """Each store moved exactly the money of the committed sagas (no lost or extra step)."""
        if self.result.unfinished:
            return  # steps still in flight: the totals cannot match yet (stores_agree: null)
        totals = store_totals(self.cfg)
        tracker = self.tracker
        expected = sum(
            tracker.amount[tx] for tx, (_, state) in tracker.done.items() if state == "committed"
        )
        self.result.store_totals = totals
        self.result.expected_total = expected
        self.result.stores_agree = all(v == expected for v in totals.values())


def run_saga_phase(
    cfg: BenchConfig,
    console: Console,
    name: str,
    *,
    mode: str,
    fail_share: float,
    duration: float,
    services: Mapping[str, int | None],
    seed: int,
) -> tuple[SagaPhaseResult, list[tuple[bytes | None, bytes | None]]]:
    """One saga phase; returns its figures and a sample of the records it wrote."""
    result = SagaPhaseResult(
        name=name,
        mode=mode,
        fail_share=fail_share,
        warmup_s=cfg.warmup,
        duration_s=duration,
        offered_rate=cfg.rate if mode == "open" else None,
        window=cfg.window if mode == "closed" else None,
    )
    phase = SagaPhase(cfg, console, result, services, seed)
    sample = phase.run()
    return result, sample


def _end_offsets(settings: KafkaSettings, partitions: int) -> dict[str, int]:
    """Records per topic: end minus start offsets (transaction markers take offsets too)."""
    consumer = Consumer(settings, group_id=None, client_id="saga.bench.offsets")
    try:
        counts: dict[str, int] = {}
        for topic in settings.topics.all:
            total = 0
            for p in range(partitions):
                low, high = consumer.watermarks(topic, p)
                total += high - low
            counts[topic.rsplit(".", 1)[1]] = total
        return counts
    finally:
        consumer.close()


def _sample_records(
    settings: KafkaSettings, partitions: int, counts: Mapping[str, int], per_topic: int = 2000
) -> tuple[list[tuple[bytes | None, bytes | None]], dict[str, float]]:
    """Records like the phase's, and the share of each topic's offsets that are records.

    Reads up to ``per_topic`` records from the start of each saga topic and mixes
    them in the proportions the phase wrote. Transaction markers take offsets but
    are no records; the share of offsets that hold records, per topic, is measured
    over the offsets the sample spans.
    """
    shorts = [s for s in ("requests", "events", "decisions", "status") if counts.get(s)]
    topic_of = {f"{settings.prefix}.{s}": s for s in shorts}
    got: dict[str, list[tuple[bytes | None, bytes | None]]] = {s: [] for s in shorts}
    spans: dict[tuple[str, int], list[int]] = {}  # [first offset, last offset, records]
    consumer = Consumer(settings, group_id=None, client_id="saga.bench.sample")
    try:
        ends = {(t, p): consumer.watermarks(t, p)[1] for t in topic_of for p in range(partitions)}
        consumer.assign([(t, p, 0) for t, p in ends])  # one assignment: one metadata wait
        todo = set(ends)
        deadline = time.monotonic() + 30
        while todo and time.monotonic() < deadline:
            for m in consumer.poll_batch(5000, 0.2):
                short = topic_of[m.topic]
                if len(got[short]) < per_topic:
                    got[short].append((m.key, m.value))
                span = spans.setdefault(m.partition_key, [m.offset, m.offset, 0])
                span[1], span[2] = m.offset, span[2] + 1
            for tp, pos in consumer.position(list(todo)).items():
                if (pos or 0) >= ends[tp] or len(got[topic_of[tp[0]]]) >= per_topic:
                    todo.discard(tp)
            consumer.pause([tp for tp in ends if tp not in todo])
    finally:
        consumer.close()
    record_share: dict[str, float] = {}
    mixed: list[tuple[bytes | None, bytes | None]] = []
    total = sum(counts.values()) or 1
    for topic, short in topic_of.items():
        mine = [s for (t, _), s in spans.items() if t == topic]
        covered = sum(last - first + 1 for first, last, _ in mine)
        record_share[short] = sum(n for *_, n in mine) / covered if covered else 1.0
        sample = got[short]
        if sample:
            share = max(1, round(10_000 * counts[short] / total))
            mixed.extend(sample[i % len(sample)] for i in range(share))
    random.Random(1).shuffle(mixed)
    return mixed, record_share


# --------------------------------------------------------------------------- direct writes


def _direct_worker(
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
    """Write ``store``'s increments of the workload in batches, with no saga machinery."""
    rng = random.Random(seed)
    try:
        write = _direct_writer(store, url, schema)
        out.put(("ready", store, os.getpid(), 0, 0.0))
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
        out.put(("done", store, os.getpid(), writes, last - start))
    except Exception as exc:  # reported to the parent, which raises one sentence
        out.put(("error", store, os.getpid(), 0, f"{type(exc).__name__}: {exc}"))


def _direct_writer(store: str, url: str, schema: str) -> Callable[[list[tuple[str, int]]], None]:
    if store == "bank":
        engine = sa.create_engine(_sa_url(url))
        table = _accounts_table(schema)
        stmt = (
            sa.update(table)
            .where(table.c.id == sa.bindparam("k"), table.c.balance - sa.bindparam("a") >= 0)
            .values(balance=table.c.balance - sa.bindparam("a"))
        )

        def write_sql(items: list[tuple[str, int]]) -> None:
            with engine.begin() as conn:  # one transaction per batch, like the participant
                conn.execute(stmt, [{"k": k, "a": a} for k, a in items])

        return write_sql
    if store == "wallet":
        import pymongo

        client: pymongo.MongoClient[dict[str, Any]] = _mongo_client(url)
        wallets = client[schema][TARGET_OF["wallet"]]

        def write_mongo(items: list[tuple[str, int]]) -> None:
            # No transactions on FerretDB: the batch is a few update commands. FerretDB
            # v1.24 on SQLite stops answering altogether when one update command holds
            # 100 updates or more, hence at most _MONGO_UPDATES_PER_COMMAND per command.
            ops = [pymongo.UpdateOne({"_id": k}, {"$inc": {"balance": a}}) for k, a in items]
            for i in range(0, len(ops), _MONGO_UPDATES_PER_COMMAND):
                wallets.bulk_write(ops[i : i + _MONGO_UPDATES_PER_COMMAND], ordered=False)

        return write_mongo
    import redis

    r = redis.Redis.from_url(url, socket_timeout=60)

    def write_redis(items: list[tuple[str, int]]) -> None:
        with r.pipeline(transaction=True) as pipe:  # MULTI/EXEC per batch
            for k, a in items:
                pipe.hincrby(_points_key(schema, k), "points", a)
            pipe.execute()

    return write_redis


@dataclass
class DirectResult:
    duration_s: float
    batch: int
    writes_per_s: dict[str, float] = field(default_factory=dict)
    sagas_per_s: float = 0.0
    cpu_s: dict[str, float | None] = field(default_factory=dict)
    cpu_s_per_saga: dict[str, float | None] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def run_direct(cfg: BenchConfig, console: Console, services: dict[str, int | None]) -> DirectResult:
    """The direct-write baseline: one process per store, all three writing at once."""
    with console.status("direct: preparing the accounts"):
        prepare_data(cfg)
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    out = ctx.Queue()
    urls = {"bank": cfg.postgres_url, "wallet": cfg.mongo_url, "rewards": cfg.redis_url}
    workers = [
        ctx.Process(
            target=_direct_worker,
            args=(
                s,
                urls[s],
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
    result = DirectResult(duration_s=cfg.baseline_duration, batch=cfg.batch)
    try:
        for w in workers:
            w.start()
        pids: dict[str, int | None] = {}
        for _ in workers:
            kind, store, pid, _, info = _get(out, 60, "a direct-write worker did not start")
            if kind == "error":
                raise TransientError(f"the direct writes to {store} failed: {info}")
            pids[f"direct writer ({STORAGE_OF[store]})"] = pid
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
                f"direct writes (batches of {cfg.batch}, 3 stores at once)",
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
        STORAGE_OF[s]: round(writes / elapsed, 1) for s, (writes, elapsed) in done.items()
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
    from streams import (
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


# --------------------------------------------------------------------------- the run


def _git_commit() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(dirty)}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 3)


def run_bench(cfg: BenchConfig, console: Console) -> int:
    started = time.monotonic()
    console.rule("[bold]saga bench")
    console.print("Services:")
    check_services(cfg, console)
    services = service_pids(cfg)
    missing = [n for n, p in services.items() if p is None]
    if missing:
        console.print(
            f"  CPU of {', '.join(missing)}: n/a (not started by infra/services.sh "
            f"under {infra_dir()})"
        )
    console.print(
        f"Phases: {', '.join(cfg.phases)}; topics under [bold]{cfg.kafka.prefix}.<phase>[/] "
        f"({cfg.partitions} partitions); {cfg.accounts} accounts per store; "
        f"{cfg.workers} worker(s) per participant; logs in {cfg.logs}"
    )
    load_before = os.getloadavg()
    phases: dict[str, SagaPhaseResult] = {}
    sample: list[tuple[bytes | None, bytes | None]] = []
    sample_per_saga: float | None = None
    direct: DirectResult | None = None
    log_bound: LogResult | None = None
    plan = {
        "main": ("closed", cfg.fail_share, cfg.duration),
        "latency": ("open", cfg.fail_share, cfg.latency_duration),
        "rollback": ("closed", cfg.rollback_fail_share, cfg.rollback_duration),
    }
    try:
        for i, name in enumerate(SAGA_PHASES):
            if name not in cfg.phases:
                continue
            mode, share, duration = plan[name]
            result, records = run_saga_phase(
                cfg, console, name, mode=mode, fail_share=share, duration=duration,
                services=services, seed=cfg.seed + 1000 * i,
            )  # fmt: skip
            phases[name] = result
            _print_phase(console, result)
            if records and (not sample or name == "main") and result.records_per_saga:
                sample, sample_per_saga = records, result.records_per_saga
        if "direct" in cfg.phases:
            direct = run_direct(cfg, console, services)
            console.print(
                f"  direct writes: {direct.sagas_per_s:,.0f} sagas/s "
                f"({', '.join(f'{k} {v:,.0f}/s' for k, v in direct.writes_per_s.items())})"
            )
        if "log" in cfg.phases:
            measured = sample_per_saga is not None
            if not sample or sample_per_saga is None:
                sample, sample_per_saga = synthetic_records()
            log_bound = run_log_bound(cfg, console, sample, sample_per_saga, measured)
            console.print(
                f"  log bound: {log_bound.records_per_s:,.0f} records/s / "
                f"{log_bound.records_per_saga:g} records per saga = "
                f"{log_bound.sagas_per_s:,.0f} sagas/s"
            )
    finally:
        with suppress(Exception):
            drop_data(cfg)
    report = build_report(cfg, phases, direct, log_bound, started, load_before)
    cfg.report.parent.mkdir(parents=True, exist_ok=True)
    cfg.report.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(console, report)
    console.print(f"report: [bold]{cfg.report}[/]")
    runs = list(phases.values())
    warnings = [f"{r.name}: {r.unfinished:,} sagas unfinished" for r in runs if r.unfinished]
    warnings += [
        f"{r.name}: the system did not keep up with {r.offered_rate:g} sagas/s; "
        f"{r.shed:,} sagas were shed (not sent) in the window"
        for r in runs
        if r.shed
    ]
    warnings += [
        f"{r.name}: {r.unexpected_rollbacks:,} sagas rolled back that were meant to commit "
        "(deadline passed?)"
        for r in runs
        if r.unexpected_rollbacks
    ]
    problems = [f"{r.name}: {r.failed:,} sagas failed" for r in runs if r.failed]
    problems += [
        f"{r.name}: the stores disagree with the committed sagas: {r.store_totals} "
        f"moved, {r.expected_total} expected"
        for r in runs
        if r.stores_agree is False
    ]
    for w in warnings:
        console.print(f"[bold yellow]{w}[/]")
    for p in problems:
        console.print(f"[bold red]{p}[/]")
    return 1 if problems else 0


def build_report(
    cfg: BenchConfig,
    phases: Mapping[str, SagaPhaseResult],
    direct: DirectResult | None,
    log_bound: LogResult | None,
    started: float,
    load_before: tuple[float, float, float],
) -> dict[str, Any]:
    main = phases.get("main")
    latency = phases.get("latency") or main
    rollback = phases.get("rollback")
    sagas_per_s = main.sagas_per_s if main else None
    direct_rate = direct.sagas_per_s if direct else None
    log_rate = log_bound.sagas_per_s if log_bound else None
    rollback_rate = rollback.sagas_per_s if rollback else None
    records_per_saga = (
        main.records_per_saga if main else (log_bound.records_per_saga if log_bound else None)
    )
    return {
        "sagas_per_s": sagas_per_s,
        "decision_latency_ms": latency.decision_latency_ms if latency else None,
        "completion_latency_ms": latency.completion_latency_ms if latency else None,
        "latency_phase": latency.name if latency else None,
        "direct_write_sagas_per_s": direct_rate,
        "log_bound_sagas_per_s": log_rate,
        "rollback_sagas_per_s": rollback_rate,
        "rollback_ratio": _ratio(rollback_rate, sagas_per_s),
        "direct_write_ratio": _ratio(sagas_per_s, direct_rate),
        "log_bound_ratio": _ratio(sagas_per_s, log_rate),
        "cpu_s_per_saga": main.cpu_s_per_saga if main else None,
        "cpu_cores_used": main.cpu_cores_used if main else None,
        "records_per_saga": records_per_saga,
        "phases": {name: r.as_json() for name, r in phases.items()},
        "direct_write": direct.as_json() if direct else None,
        "log_bound": log_bound.as_json() if log_bound else None,
        "parameters": {
            "phases": list(cfg.phases),
            "prefix": cfg.kafka.prefix,
            "warmup_s": cfg.warmup,
            "duration_s": cfg.duration,
            "latency_duration_s": cfg.latency_duration,
            "rollback_duration_s": cfg.rollback_duration,
            "baseline_duration_s": cfg.baseline_duration,
            "rate": cfg.rate,
            "window": cfg.window,
            "fail_share": cfg.fail_share,
            "rollback_fail_share": cfg.rollback_fail_share,
            "partitions": cfg.partitions,
            "workers": cfg.workers,
            "accounts": cfg.accounts,
            "batch": cfg.batch,
            "saga_timeout_s": cfg.saga_timeout,
            "steps_per_saga": len(PARTICIPANTS),
        },
        "machine": {
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "git": _git_commit(),
        "wall_s": round(time.monotonic() - started, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# --------------------------------------------------------------------------- output


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f} ms"


def _num(v: float | None, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:,.1f}{unit}"


def _print_phase(console: Console, r: SagaPhaseResult) -> None:
    console.print(
        f"  {r.name}: {r.sagas_per_s:,.1f} sagas/s over {r.duration_s:g} s "
        f"({r.committed_in_window} committed, {r.rolled_back_in_window} rolled back); "
        f"decision p99 {_ms(r.decision_latency_ms.get('p99'))}"
    )


def _latency_cell(key: str, q: str) -> Callable[[Mapping[str, Any]], str]:
    return lambda r: _ms(r[key][q])


def _agree_text(r: Mapping[str, Any]) -> str:
    if r["stores_agree"] is None:
        return "n/a"
    return "yes" if r["stores_agree"] else "[red]NO[/]"


def _mode_text(r: Mapping[str, Any]) -> str:
    if r["window"]:
        return f"closed, {r['window']:,}"
    return f"open, {r['offered_rate']:g}/s"


def _cpu_cell(r: Mapping[str, Any], name: str) -> str:
    per_saga, cores = r["cpu_s_per_saga"].get(name), r["cpu_cores_used"].get(name)
    if per_saga is None or cores is None:
        return "n/a"
    return f"{1000 * per_saga:.2f} ({cores:.2f})"


def print_summary(console: Console, report: Mapping[str, Any]) -> None:
    """The figures of every phase (one column each), then the baselines and the ratios.

    Kept within 80 columns, so that it reads in a plain terminal and in a log file.
    """
    phases: Mapping[str, Any] = report["phases"]
    table = Table(title="saga bench: the measured window of each phase")
    table.add_column("figure")
    for name in phases:
        table.add_column(name, justify="right")
    rows: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = [
        ("loop, in flight or rate", _mode_text),
        ("failure share", lambda r: f"{r['fail_share']:.0%}"),
        ("window", lambda r: f"{r['duration_s']:.1f} s"),
        ("sent (per s)", lambda r: f"{r['sent_in_window']:,} ({r['send_rate']:,.0f})"),
        ("shed (overloaded)", lambda r: f"{r['shed']:,}"),
        ("completed", lambda r: f"{r['completed_in_window']:,}"),
        (
            "  committed/rolled back",
            lambda r: f"{r['committed_in_window']:,}/{r['rolled_back_in_window']:,}",
        ),
        ("[bold]sagas/s[/]", lambda r: f"[bold]{r['sagas_per_s']:,.1f}[/]"),
    ]
    for kind in ("decision", "completion"):
        for q in ("p50", "p95", "p99", "max"):
            rows.append((f"{kind} {q}", _latency_cell(f"{kind}_latency_ms", q)))
    rows += [
        ("log records per saga", lambda r: _num(r["records_per_saga"])),
        ("  without tx markers", lambda r: _num(r["records_per_saga_without_markers"])),
        ("unfinished/failed", lambda r: f"{r['unfinished']}/{r['failed']}"),
        ("stores agree", _agree_text),
    ]
    for label, get in rows:
        table.add_row(label, *(get(r) for r in phases.values()))
    cpu_names: list[str] = []
    for r in phases.values():
        cpu_names += [n for n in r["cpu_s_per_saga"] if n not in cpu_names]
    table.add_section()
    table.add_row("[bold]CPU ms/saga (cores)[/]", *("" for _ in phases))
    for n in cpu_names:
        table.add_row(f"  {n}", *(_cpu_cell(r, n) for r in phases.values()))
    table.add_row(
        "  total",
        *(
            f"{1000 * sum(v for v in r['cpu_s_per_saga'].values() if v is not None):.2f} "
            f"({sum(v for v in r['cpu_cores_used'].values() if v is not None):.2f})"
            for r in phases.values()
        ),
    )
    if phases:
        console.print(table)

    base = Table(title="baselines and ratios")
    base.add_column("figure")
    base.add_column("value", justify="right")
    direct = report.get("direct_write")
    if direct:
        for store, rate in direct["writes_per_s"].items():
            base.add_row(
                f"direct writes {store} (batches of {direct['batch']})", f"{rate:,.0f} writes/s"
            )
        base.add_row(
            "[bold]direct-write sagas/s[/] (slowest store)",
            f"[bold]{direct['sagas_per_s']:,.0f}[/]",
        )
        for n, v in direct["cpu_s_per_saga"].items():
            base.add_row(f"  CPU ms/saga {n}", "n/a" if v is None else f"{1000 * v:.3f}")
    log_bound = report.get("log_bound")
    if log_bound:
        base.add_row(
            "log produce + consume",
            f"{log_bound['records_per_s']:,.0f} records/s of {log_bound['record_bytes']:.0f} B",
        )
        base.add_row(
            "records per saga" + ("" if log_bound["records_per_saga_measured"] else " (estimated)"),
            f"{log_bound['records_per_saga']:g}",
        )
        base.add_row("[bold]log-bound sagas/s[/]", f"[bold]{log_bound['sagas_per_s']:,.0f}[/]")
    base.add_row("sagas/s (main)", _num(report["sagas_per_s"]))
    base.add_row("rollback sagas/s", _num(report["rollback_sagas_per_s"]))
    for label, key in (
        ("rollback / main", "rollback_ratio"),
        ("main / direct writes", "direct_write_ratio"),
        ("main / log bound", "log_bound_ratio"),
    ):
        base.add_row(label, "n/a" if report[key] is None else f"{report[key]:.3f}")
    console.print(base)
