"""The SQL participant's storage alone: increments in batches of 500, CPU per step.

``python -m tests.sql_batch_bench [--rounds 4] [--batches 10] [--size 500]`` (with
``SAGA_POSTGRES_URL``). It builds the bench's table shape (``accounts``: text key,
``bigint`` balance, 10,000 rows) in a fresh schema and, per round, drives one
:class:`~participants.SqlStorage` through ``--batches`` batches of requests (the
bank's step: ``by`` negative with ``min 0``; one in five on a missing key, so it
fails), then the rollback decisions of the same transactions (their
compensations). It prints steps/s, and the CPU per step of this process and of the
PostgreSQL backend serving it (from ``/proc``, so the server must be local).

To compare two versions, run it from each checkout in turn (``PYTHONPATH``)
several times, alternating: the machine's other load moves the figures.
Nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import os
import random
import time
import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.schema import CreateSchema, DropSchema

from saga.participants._barrier import Requested
from saga.participants._storage import DecisionArrived, WorkItem
from saga.participants.sql._adapter import SqlStorage
from saga.streams import Mode, Outcome

URL = os.environ.get("SAGA_POSTGRES_URL", "postgresql://saga:saga@127.0.0.1:15432/saga")
TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu(pid: int) -> float:
    """Seconds of CPU the process ``pid`` has used (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def batch_args(description: str, size: int) -> argparse.Namespace:
    """The command line of a storage-alone bench (this one's and its siblings')."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--size", type=int, default=size)
    parser.add_argument("--accounts", type=int, default=10_000)
    return parser.parse_args()


def main() -> None:
    args = batch_args(__doc__.splitlines()[0], 500)
    engine = sa.create_engine(URL.replace("postgresql://", "postgresql+psycopg://", 1))
    schema = f"b_{uuid.uuid4().hex[:12]}"
    table = sa.Table(
        "accounts",
        sa.MetaData(schema=schema),
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("balance", sa.BigInteger, nullable=False),
    )
    with engine.begin() as connection:
        connection.execute(CreateSchema(schema))
        table.create(connection)
        connection.execute(
            sa.insert(table), [{"id": f"a{i}", "balance": 10**9} for i in range(args.accounts)]
        )
    rng = random.Random(7)
    try:
        for n in range(args.rounds):
            storage = SqlStorage("bank", URL, ["accounts"], schema=schema)
            storage.setup()
            with storage._engine.connect() as connection:  # the pool's one connection
                pid = connection.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            batches: list[list[WorkItem]] = []
            for b in range(args.batches):
                batch: list[WorkItem] = []
                for i in range(args.size):
                    key = f"missing-{i}" if i % 5 == 0 else f"a{rng.randrange(args.accounts)}"
                    step = {"target": "accounts", "key": key, "field": "balance"}
                    batch.append(
                        Requested(
                            f"r{n}-{b}-{i}",
                            0,
                            "increment",
                            {**step, "by": -3, "min": 0},
                            Mode.PARALLEL,
                            3,
                            2**62,
                            0,
                        )
                    )
                batches.append(batch)
            rollbacks: list[list[WorkItem]] = [
                [DecisionArrived(item.tx_id, Outcome.ROLLBACK, 1) for item in batch]
                for batch in batches
            ]
            for label, work in (("apply", batches), ("compensate", rollbacks)):
                wall, cpu, server = time.perf_counter(), time.process_time(), backend_cpu(pid)
                for batch in work:
                    storage.execute(batch)
                steps = sum(len(batch) for batch in work)
                wall = time.perf_counter() - wall
                cpu = time.process_time() - cpu
                server = backend_cpu(pid) - server
                print(
                    f"round {n} {label:10} {steps / wall:8.0f} steps/s  "
                    f"participant {1000 * cpu / steps:.3f} ms/step  "
                    f"PostgreSQL {1000 * server / steps:.3f} ms/step"
                )
            storage.close()
    finally:
        with engine.begin() as connection:
            connection.execute(DropSchema(schema, cascade=True))
        engine.dispose()


if __name__ == "__main__":
    main()
