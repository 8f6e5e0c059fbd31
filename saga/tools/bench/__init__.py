"""The benchmark: sustained sagas/s and latencies against two baselines measured in the same run.

``saga bench`` runs these phases (``--phases`` picks some):

* ``main``     closed loop at maximum (a window of sagas in flight), all commit;
* ``latency``  open loop at a fixed rate (``--rate`` sagas/s): decision latency;
* ``rollback`` closed loop with a share of sagas rejected (``--rollback-fail-share``);
* ``hot``      the main phase's closed loop with every step on one of 10 records per
  store (under ``read_committed``: escrow increments of a few hot records);
* ``direct``   the direct-write baseline: the same increments on the same three
  stores, batched, written by plain loops (one process per store) without saga
  machinery;
* ``log``      the log bound: produce + consume throughput of records like the
  saga's (sampled from the main run's topics) on the same broker, divided by the
  records one saga writes.

Every saga asks for the level ``--isolation`` names (default ``read_committed``); with
``both`` the main and latency phases run at each level in turn (``main-none``,
``latency-none`` at ``none``) and the report puts them side by side
(:mod:`saga.tools.bench.isolation`).

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

from saga.tools.bench.config import BenchConfig
from saga.tools.bench.run import run_bench

__all__ = ["BenchConfig", "run_bench"]
