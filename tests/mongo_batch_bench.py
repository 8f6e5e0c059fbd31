"""The MongoDB participant's storage alone, on FerretDB: new steps in batches, cost per step.

``python -m tests.mongo_batch_bench [--rounds 4] [--batches 10] [--size 300]`` (with
``SAGA_MONGO_URL`` and ``SAGA_INFRA_DIR``, whose ``pids/mongo.pid`` names the local
FerretDB). It builds the bench's wallet shape (``wallets``: text ``_id``, an integer
balance, 10,000 documents) in a fresh database and, per round, drives one
:class:`~participants.MongoStorage` through ``--batches`` batches of requests (the
wallet's step: ``increment`` by a positive amount, no bounds). It prints steps/s and
the CPU per step of this process and of FerretDB (from ``/proc``: the whole server,
so another client's work counts too).

To compare two versions, run it from each checkout in turn (``PYTHONPATH``) several
times, alternating: the machine's other load moves the figures. Nothing here is a
pass/fail test.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from pathlib import Path

from pymongo import MongoClient

from saga.participants._barrier import Requested
from saga.participants._storage import WorkItem
from saga.participants.mongo._adapter import MongoStorage
from saga.streams import Mode
from tests.sql_batch_bench import backend_cpu, batch_args

URL = os.environ.get("SAGA_MONGO_URL", "mongodb://127.0.0.1:27027/")


def main() -> None:
    args = batch_args(__doc__.splitlines()[0], 300)
    infra = Path(os.environ.get("SAGA_INFRA_DIR", ".infra"))
    pid = int((infra / "pids" / "mongo.pid").read_text())
    database = f"b_{uuid.uuid4().hex[:12]}"
    client: MongoClient[dict[str, object]] = MongoClient(URL)
    client[database]["wallets"].insert_many(
        [{"_id": f"acct-{i:05d}", "balance": 1000} for i in range(args.accounts)]
    )
    rng = random.Random(7)
    try:
        for n in range(args.rounds):
            storage = MongoStorage("wallet", URL, ["wallets"], database=database)
            storage.setup()
            batches: list[list[WorkItem]] = []
            for b in range(args.batches):
                batch: list[WorkItem] = []
                for i in range(args.size):
                    key = f"acct-{rng.randrange(args.accounts):05d}"
                    step = {"target": "wallets", "key": key, "field": "balance", "by": 3}
                    batch.append(
                        Requested(f"r{n}-{b}-{i}", 1, "increment", step, Mode.PARALLEL, 3, 2**62, 0)
                    )
                batches.append(batch)
            wall, cpu, server = time.perf_counter(), time.process_time(), backend_cpu(pid)
            for batch in batches:
                storage.execute(batch)
            steps = sum(len(batch) for batch in batches)
            wall = time.perf_counter() - wall
            cpu = time.process_time() - cpu
            server = backend_cpu(pid) - server
            print(
                f"round {n} {steps / wall:8.0f} steps/s  "
                f"participant {1000 * cpu / steps:.3f} ms/step  "
                f"FerretDB {1000 * server / steps:.3f} ms/step",
                flush=True,
            )
            storage.close()
    finally:
        client.drop_database(database)
        client.close()


if __name__ == "__main__":
    main()
