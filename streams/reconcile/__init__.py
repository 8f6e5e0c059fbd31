"""The reconciliation job: audit the saga log and the participants' ledgers with PySpark.

``saga reconcile`` (:mod:`streams.reconcile.cli`) reads ``requests``, ``events``,
``decisions`` and ``dlq`` as a batch through Spark's Kafka source, checks the
invariants of docs/architecture.md §6 per transaction, cross-checks the ledgers,
runs business checks, writes Parquet findings and a JSON summary, and replays
stuck sagas.

Public API::

    ReconcileConfig, LedgerSource, TableSource, BusinessCheck   what to do
    parse_ledger, parse_table, parse_check, parse_duration_ms   building them from text
    run -> RunResult                                            one run
    CLASSES, INVARIANTS                                         the verdicts
    ReconcileError                                              "could not run" (exit 2)
"""

from saga.streams.reconcile._audit import CLASSES, INVARIANTS
from saga.streams.reconcile._config import (
    DEFAULT_GRACE_MS,
    BusinessCheck,
    LedgerSource,
    ReconcileConfig,
    StoreSpec,
    TableSource,
    parse_check,
    parse_duration_ms,
    parse_ledger,
    parse_table,
)
from saga.streams.reconcile._job import RunResult, run
from saga.streams.reconcile._spark import ReconcileError

__all__ = [
    "CLASSES",
    "DEFAULT_GRACE_MS",
    "INVARIANTS",
    "BusinessCheck",
    "LedgerSource",
    "ReconcileConfig",
    "ReconcileError",
    "RunResult",
    "StoreSpec",
    "TableSource",
    "parse_check",
    "parse_duration_ms",
    "parse_ledger",
    "parse_table",
    "run",
]
