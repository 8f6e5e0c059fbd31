"""The participant side of saga: the runtime, the barrier and the storage adapters.

Public API::

    ParticipantRuntime      consume -> barrier -> apply -> emit (``saga participant run``)
    open_storage            build a storage adapter by kind: sql, mongo, redis
    Storage, Unit, Actions  what an adapter implements
    Handler, Reject         custom actions (try / confirm / cancel)
    plan, LedgerEntry       the pure barrier
"""

from participants._barrier import (
    Decided,
    Effect,
    LedgerEntry,
    LedgerStatus,
    Plan,
    PredecessorApplied,
    Requested,
    SuccessorCompensated,
    plan,
)
from participants._handlers import Handler, Reject, WithHandlers, load_handlers
from participants._open import open_storage
from participants._runtime import ParticipantRuntime, ParticipantStats
from participants._storage import Actions, DecisionArrived, Report, Storage, Unit, run_item

__all__ = [
    "Actions",
    "Decided",
    "DecisionArrived",
    "Effect",
    "Handler",
    "LedgerEntry",
    "LedgerStatus",
    "ParticipantRuntime",
    "ParticipantStats",
    "Plan",
    "PredecessorApplied",
    "Reject",
    "Report",
    "Requested",
    "Storage",
    "SuccessorCompensated",
    "Unit",
    "WithHandlers",
    "load_handlers",
    "open_storage",
    "plan",
    "run_item",
]
