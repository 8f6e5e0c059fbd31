"""The demo workload: a shop's orders as sagas across three storages.

Each order is one saga of three steps, each in another storage:

* ``ledger``    (PostgreSQL) debits the customer's account (never below 0);
* ``inventory`` (MongoDB wire) takes the items from stock (never below 0);
* ``loyalty``   (Redis) credits the customer one point per unit of money spent.

``saga demo`` checks that every local service answers, creates fresh topics and
data, starts a coordinator and the three participants as real processes,
drives a few thousand orders (about a fifth designed to fail: insufficient
funds or out of stock), shows a live progress bar, prints a summary with
decision latencies, checks across the stores that money and stock are
conserved, and stops what it started.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from saga.coordinator import SagaClient
from saga.streams import (
    ConfigurationError,
    Decision,
    SagaState,
    SagaStatus,
    Step,
    TransientError,
    decode_as,
)
from saga.streams.kafka import Consumer, KafkaSettings, create_topics, wait_for_broker

ACCOUNTS = 200
OPENING_BALANCE = 1_000
PRODUCTS = 50
OPENING_STOCK = 500
PRICE = 5
SCHEMA = "saga_demo"  # PostgreSQL schema, MongoDB database and Redis key prefix

_metadata = sa.MetaData(schema=SCHEMA)
accounts = sa.Table(
    "accounts",
    _metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("balance", sa.BigInteger, nullable=False),
)


@dataclass(frozen=True)
class DemoConfig:
    kafka: KafkaSettings
    postgres_url: str
    mongo_url: str | None
    redis_url: str | None
    sagas: int = 2_000
    fail_share: float = 0.2
    partitions: int = 4
    seed: int = 7
    logs: Path = Path(".infra/logs/demo")
    reconcile: bool = True


def _sa_url(url: str) -> str:
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


def check_services(cfg: DemoConfig, console: Console) -> None:
    """One line per service: it answers, or the demo stops with a sentence saying which."""
    wait_for_broker(cfg.kafka, timeout=20)
    console.print(f"  kafka      {cfg.kafka.bootstrap}  [green]answers[/]")
    engine = sa.create_engine(_sa_url(cfg.postgres_url))
    try:
        with engine.connect() as conn:
            version = conn.execute(sa.text("SHOW server_version")).scalar()
    except sa.exc.OperationalError as exc:
        raise TransientError(f"PostgreSQL at {cfg.postgres_url} does not answer") from exc
    finally:
        engine.dispose()
    console.print(f"  postgres   {version}  [green]answers[/]")
    if cfg.mongo_url:
        import pymongo

        client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(
            cfg.mongo_url, serverSelectionTimeoutMS=5000
        )
        try:
            info = client.server_info()
        except pymongo.errors.PyMongoError as exc:
            raise TransientError(
                f"the MongoDB-wire server at {cfg.mongo_url} does not answer"
            ) from exc
        finally:
            client.close()
        console.print(f"  mongo      wire version {info.get('version')}  [green]answers[/]")
    if cfg.redis_url:
        import redis

        r = redis.Redis.from_url(cfg.redis_url, socket_timeout=5)
        try:
            aof = r.config_get("appendonly").get("appendonly")
        except redis.RedisError as exc:
            raise TransientError(f"Redis at {cfg.redis_url} does not answer") from exc
        finally:
            r.close()
        console.print(f"  redis      appendonly={aof}  [green]answers[/]")


def prepare_tables(cfg: DemoConfig, *, fresh: bool = True) -> None:
    """The demo's accounts (PostgreSQL), stock (MongoDB wire) and points (Redis).

    ``fresh`` (the demo) drops what a previous run left and starts from the opening
    figures; otherwise (``saga demo --setup-only``, the compose init step) only what is
    missing is created, so a second run keeps the data sagas have changed.
    """
    engine = sa.create_engine(_sa_url(cfg.postgres_url))
    rows = [{"id": f"acct-{i:04d}", "balance": OPENING_BALANCE} for i in range(ACCOUNTS)]
    try:
        with engine.begin() as conn:
            if fresh:
                conn.execute(sa.schema.DropSchema(SCHEMA, cascade=True, if_exists=True))
            conn.execute(sa.schema.CreateSchema(SCHEMA, if_not_exists=True))
            _metadata.create_all(conn)
            if fresh:
                conn.execute(accounts.insert(), rows)
            else:
                from sqlalchemy.dialects.postgresql import insert

                conn.execute(insert(accounts).on_conflict_do_nothing(), rows)
    finally:
        engine.dispose()
    import pymongo
    import redis

    assert cfg.mongo_url is not None and cfg.redis_url is not None
    mongo: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(cfg.mongo_url)
    try:
        if fresh:
            mongo.drop_database(SCHEMA)
        stock = mongo[SCHEMA]["stock"]
        present = {d["_id"] for d in stock.find({}, {"_id": 1})}
        missing = [f"sku-{i:03d}" for i in range(PRODUCTS) if f"sku-{i:03d}" not in present]
        if missing:
            stock.insert_many([{"_id": sku, "qty": OPENING_STOCK} for sku in missing])
    finally:
        mongo.close()
    r = redis.Redis.from_url(cfg.redis_url)
    try:
        if fresh:
            stale = list(r.scan_iter(match=f"{SCHEMA}:*", count=1000))
            if stale:
                r.delete(*stale)
        with r.pipeline() as pipe:
            for i in range(ACCOUNTS):
                pipe.hsetnx(f"{SCHEMA}:points:acct-{i:04d}", "points", 0)
            pipe.execute()
    finally:
        r.close()


def setup_only(cfg: DemoConfig, console: Console) -> int:
    """``saga demo --setup-only``: the demo's topics and data where they are missing; exit 0.

    Repeating it is harmless: existing topics and rows are kept as they are.
    """
    console.print("Services:")
    check_services(cfg, console)
    created = create_topics(cfg.kafka, cfg.partitions)
    prepare_tables(cfg, fresh=False)
    console.print(
        f"Topics under prefix {cfg.kafka.prefix} ({len(created)} created), accounts "
        f"(PostgreSQL schema {SCHEMA}), stock (MongoDB database {SCHEMA}) and points "
        f"(Redis prefix {SCHEMA}) are ready.",
        markup=False,
        highlight=False,
    )
    return 0


def reconcile_command(cfg: DemoConfig, environ: Mapping[str, str]) -> str:
    """The ``saga reconcile`` command that audits this run again, to copy into a shell.

    The stores' URLs appear as the variables the demo reads (``$SAGA_POSTGRES_URL``,
    ...) in single quotes, never as text: they hold passwords, and the job reads the
    variables itself, so no password reaches a command line (``ps``) either.
    ``--bootstrap`` is given only when the
    environment's ``SAGA_KAFKA_BOOTSTRAP`` would not name the same broker.
    """
    parts = ["saga reconcile"]
    if environ.get("SAGA_KAFKA_BOOTSTRAP") != cfg.kafka.bootstrap:
        parts.append(f"--bootstrap {cfg.kafka.bootstrap}")
    parts += [
        f"--prefix {cfg.kafka.prefix}",
        f"--ledger 'sql:$SAGA_POSTGRES_URL#schema={SCHEMA}'",
        f"--ledger 'mongo:$SAGA_MONGO_URL#database={SCHEMA}'",
        f"--ledger 'redis:$SAGA_REDIS_URL#prefix={SCHEMA}'",
    ]
    return " \\\n    ".join(parts)


def print_reconcile_command(cfg: DemoConfig, console: Console) -> None:
    console.print(
        f"This run's topic prefix: {cfg.kafka.prefix}. To audit it again (with the "
        'services\' addresses exported: eval "$(infra/services.sh env)"):',
        markup=False,
        highlight=False,
    )
    console.print(
        "  " + reconcile_command(cfg, os.environ), markup=False, highlight=False, soft_wrap=True
    )


@contextmanager
def processes(cfg: DemoConfig) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The coordinator and the participants, as the user would run them."""
    cfg.logs.mkdir(parents=True, exist_ok=True)
    common = ["--bootstrap", cfg.kafka.bootstrap, "--prefix", cfg.kafka.prefix]

    def participant(name: str, storage: str, url: str, target: str) -> tuple[list[str], str]:
        # The URL (and its password) goes through the environment, not the command line.
        return [
            *("participant", "run", *common, "--name", name, "--storage", storage),
            *("--schema", SCHEMA, "--targets", target),
        ], url

    assert cfg.mongo_url is not None and cfg.redis_url is not None
    commands: dict[str, tuple[list[str], str | None]] = {
        "coordinator": (
            ["coordinator", "run", *common, "--participants", "ledger,inventory,loyalty"],
            None,
        ),
        "ledger": participant("ledger", "sql", cfg.postgres_url, "accounts"),
        "inventory": participant("inventory", "mongo", cfg.mongo_url, "stock"),
        "loyalty": participant("loyalty", "redis", cfg.redis_url, "points"),
    }
    procs = []
    try:
        for name, (args, url) in commands.items():
            log = (cfg.logs / f"{name}.log").open("wb")
            env = {k: v for k, v in os.environ.items() if k != "SAGA_STORAGE_URL"}
            if url is not None:
                env["SAGA_STORAGE_URL"] = url
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "coordinator", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
            log.close()
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def _await_announced(client: SagaClient, steps: list[Step], timeout_s: float) -> None:
    """Wait (up to ``timeout_s``) until every participant ``steps`` name has announced
    itself, so that the first saga does not wait for them (and nobody warns about it)."""
    deadline = time.monotonic() + timeout_s
    while client.unannounced(steps) and time.monotonic() < deadline:
        time.sleep(0.2)  # the client reads the registry again at most once a second


@dataclass(frozen=True)
class Order:
    steps: list[Step]
    qty: int
    designed_to_fail: bool


def order_saga(rng: random.Random, fail_share: float) -> Order:
    """One customer buys ``qty`` of one product for ``amount``; some are designed to fail."""
    account = f"acct-{rng.randrange(ACCOUNTS):04d}"
    sku = f"sku-{rng.randrange(PRODUCTS):03d}"
    qty, amount = rng.randint(1, 3), rng.randint(1, 40)
    doomed = rng.random() < fail_share
    if doomed and rng.random() < 0.5:
        amount = OPENING_BALANCE * 10  # insufficient funds
    elif doomed:
        qty = OPENING_STOCK * 10  # out of stock
    steps = [
        Step(
            "ledger",
            "increment",
            {"target": "accounts", "key": account, "field": "balance", "by": -amount, "min": 0},
        ),
        Step(
            "inventory",
            "increment",
            {"target": "stock", "key": sku, "field": "qty", "by": -qty, "min": 0},
        ),
        Step(
            "loyalty",
            "increment",
            {"target": "points", "key": account, "field": "points", "by": amount},
        ),
    ]
    return Order(steps, qty, doomed)


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def read_decisions(settings: KafkaSettings) -> dict[str, Decision]:
    consumer = Consumer(settings, group_id=None, client_id="saga.demo")
    found: dict[str, Decision] = {}
    try:
        topic = settings.topics.decisions
        ends = {}
        for p in range(consumer.list_partitions(topic)):
            low, high = consumer.watermarks(topic, p)
            if high > low:
                ends[p] = high
        consumer.assign([(topic, p, 0) for p in ends])
        deadline = time.monotonic() + 60
        while ends and time.monotonic() < deadline:
            for m in consumer.poll_batch(5000, 0.2):
                d = decode_as(m.value, Decision)
                assert isinstance(d, Decision)
                found.setdefault(d.tx_id, d)
            pos = consumer.position([(topic, p) for p in ends])
            ends = {p: h for p, h in ends.items() if (pos.get((topic, p)) or 0) < h}
    finally:
        consumer.close()
    return found


def run_demo(cfg: DemoConfig, console: Console) -> int:
    console.rule("[bold]saga demo")
    console.print("Services:")
    check_services(cfg, console)
    create_topics(cfg.kafka, cfg.partitions)
    prepare_tables(cfg)
    console.print(
        f"Topics under prefix [bold]{cfg.kafka.prefix}[/], {ACCOUNTS} accounts "
        f"of {OPENING_BALANCE} in PostgreSQL schema {SCHEMA}."
    )
    rng = random.Random(cfg.seed)
    created: dict[str, int] = {}
    quantities: dict[str, int] = {}
    with processes(cfg) as procs, SagaClient(cfg.kafka, status_from_beginning=False) as client:
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[counts]}"),
            TimeElapsedColumn(),
            console=console,
        )
        # One saga first (designed to roll back, so it leaves no trace): the
        # processes have joined their groups once it finishes, so the latencies
        # below measure sagas, not start-up.
        with console.status("starting the coordinator and participants"):
            warm_up = order_saga(rng, 1.0).steps
            _await_announced(client, warm_up, timeout_s=120)
            warm = client.submit(warm_up, saga="warm-up", timeout=120)
            client.result(warm, timeout=120)
        with progress:
            task = progress.add_task("sagas", total=cfg.sagas, counts="")
            for _ in range(cfg.sagas):
                order = order_saga(rng, cfg.fail_share)
                request = client.build(order.steps, saga="order", timeout=60)
                client.send(request, wait_delivery=False)
                created[request.tx_id] = request.created_ms
                quantities[request.tx_id] = order.qty
            client.flush()
            deadline = time.monotonic() + 180
            while True:
                snap = client.statuses()
                final = Counter(
                    s.state.value for tx, s in snap.items() if tx in created and s.state.final
                )
                done = sum(final.values())
                progress.update(
                    task,
                    completed=done,
                    counts=(f"committed {final['committed']}  rolled back {final['rolled_back']}"),
                )
                if done >= cfg.sagas:
                    break
                if any(p.poll() is not None for p in procs):
                    raise ConfigurationError(
                        f"a demo process exited early; see the logs in {cfg.logs}"
                    )
                if time.monotonic() > deadline:
                    raise TransientError(
                        f"only {done} of {cfg.sagas} sagas finished within 180 s; "
                        f"see the logs in {cfg.logs}"
                    )
                time.sleep(0.2)
        statuses = {tx: s for tx, s in client.statuses().items() if tx in created}
    decisions = read_decisions(cfg.kafka)
    verdict = summarize(cfg, console, created, quantities, statuses, decisions)
    if cfg.reconcile:
        verdict = max(verdict, reconcile_demo(cfg, console))
    print_reconcile_command(cfg, console)
    return verdict


def reconcile_demo(cfg: DemoConfig, console: Console) -> int:
    """Audit the demo's log and the three ledgers with the Spark job; print its summary."""
    console.rule("[bold]saga reconcile over the demo's log")
    assert cfg.mongo_url is not None and cfg.redis_url is not None
    # The URLs hold passwords: they go by environment, which the job reads itself, so
    # no password is on a command line (`ps`).
    stores = {
        "SAGA_DEMO_POSTGRES_URL": cfg.postgres_url,
        "SAGA_DEMO_MONGO_URL": cfg.mongo_url,
        "SAGA_DEMO_REDIS_URL": cfg.redis_url,
    }
    command = [
        sys.executable, "-m", "coordinator", "reconcile",
        "--bootstrap", cfg.kafka.bootstrap, "--prefix", cfg.kafka.prefix,
        "--ledger", f"sql:$SAGA_DEMO_POSTGRES_URL#schema={SCHEMA}",
        "--ledger", f"mongo:$SAGA_DEMO_MONGO_URL#database={SCHEMA}",
        "--ledger", f"redis:$SAGA_DEMO_REDIS_URL#prefix={SCHEMA}",
        "--out", str(cfg.logs / "reconcile"),
    ]  # fmt: skip
    code = subprocess.call(command, env={**os.environ, **stores})
    if code == 0:
        console.print("[bold green]reconciliation: the log and the stores agree[/]")
    else:
        console.print(f"[bold red]reconciliation exited {code}[/]; see {cfg.logs / 'reconcile'}")
    return code


def summarize(
    cfg: DemoConfig,
    console: Console,
    created: dict[str, int],
    quantities: dict[str, int],
    statuses: Mapping[str, SagaStatus],
    decisions: dict[str, Decision],
) -> int:
    states = Counter(getattr(s, "state", SagaState.PENDING).value for s in statuses.values())
    reasons = Counter(
        _reason_kind(getattr(s, "reason", "") or "")
        for s in statuses.values()
        if getattr(s, "state", None) is SagaState.ROLLED_BACK
    )
    latency = [d.at_ms - created[tx] for tx, d in decisions.items() if tx in created]
    table = Table(title="summary")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("sagas submitted", str(len(created)))
    table.add_row("committed", str(states["committed"]))
    table.add_row("rolled back", str(states["rolled_back"]))
    for reason, count in reasons.most_common():
        table.add_row(f"  {reason}", str(count))
    table.add_row("failed (operator must act)", str(states["failed"]))
    table.add_row("decision latency p50", f"{_percentile(latency, 0.50):.0f} ms")
    table.add_row("decision latency p99", f"{_percentile(latency, 0.99):.0f} ms")
    console.print(table)

    balances, negative_balances = _money(cfg)
    points = _points(cfg)
    stock, negative_stock = _stock(cfg)
    opening_money = ACCOUNTS * OPENING_BALANCE
    sold = sum(quantities[tx] for tx, st in statuses.items() if st.state is SagaState.COMMITTED)
    opening_stock = PRODUCTS * OPENING_STOCK
    money_ok = balances + points == opening_money
    stock_ok = opening_stock - stock == sold

    def verdict(good: bool) -> str:
        return "[green]ok[/]" if good else "[red]VIOLATED[/]"

    checks = Table(title="cross-store check")
    checks.add_column("check")
    checks.add_column("result")
    checks.add_row(
        "balances (PostgreSQL) + points (Redis) == opening money",
        f"{balances} + {points} == {opening_money}: {verdict(money_ok)}",
    )
    checks.add_row(
        "stock taken (MongoDB) == units in committed orders",
        f"{opening_stock} - {stock} == {sold}: {verdict(stock_ok)}",
    )
    checks.add_row("no negative balance or stock", verdict(negative_balances + negative_stock == 0))
    console.print(checks)
    ok = money_ok and stock_ok and negative_balances + negative_stock == 0 and not states["failed"]
    console.print("[bold green]demo passed[/]" if ok else "[bold red]demo found a violation[/]")
    return 0 if ok else 1


def _money(cfg: DemoConfig) -> tuple[int, int]:
    engine = sa.create_engine(_sa_url(cfg.postgres_url))
    try:
        with engine.connect() as conn:
            total = conn.execute(sa.select(sa.func.sum(accounts.c.balance))).scalar()
            negative = conn.execute(
                sa.select(sa.func.count()).where(accounts.c.balance < 0)
            ).scalar()
    finally:
        engine.dispose()
    return int(total or 0), int(negative or 0)


def _points(cfg: DemoConfig) -> int:
    import redis

    assert cfg.redis_url is not None
    r = redis.Redis.from_url(cfg.redis_url, decode_responses=True)
    try:
        keys = list(r.scan_iter(match=f"{SCHEMA}:points:*", count=1000))
        with r.pipeline() as pipe:
            for key in keys:
                pipe.hget(key, "points")
            return sum(int(v or 0) for v in pipe.execute())
    finally:
        r.close()


def _stock(cfg: DemoConfig) -> tuple[int, int]:
    import pymongo

    assert cfg.mongo_url is not None
    mongo: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(cfg.mongo_url)
    try:
        docs = list(mongo[SCHEMA]["stock"].find({}, {"qty": 1}))
    finally:
        mongo.close()
    quantities = [int(str(d.get("qty", 0))) for d in docs]
    return sum(quantities), sum(q < 0 for q in quantities)


def _reason_kind(reason: str) -> str:
    if "balance" in reason and "below the minimum" in reason:
        return "insufficient funds"
    if "qty" in reason and "below the minimum" in reason:
        return "out of stock"
    if reason == "deadline passed":
        return "deadline passed"
    return reason.split(":", 1)[0] if reason else "unknown"
