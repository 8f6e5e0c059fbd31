"""The participant side of saga: the runtime, the storage adapters and custom actions.

Public API::

    ParticipantRuntime, ParticipantStats   consume -> barrier -> apply -> emit
                                           (``saga participant run``)
    open_storage                           build a storage adapter by kind: sql, mongo, redis
    SqlStorage, MongoStorage, RedisStorage the adapters (each imports its driver when first used)
    SqlSession, MongoSession, RedisSession what actions and handlers get as ``native``
    Handler, Reject, load_handlers         custom actions (try / confirm / cancel)
    current_step, StepScope                the step a handler runs for (a holder's name)
    Actions                                custom actions as one object (``handlers=``)
    Storage                                what the runtime asks of a storage
    LedgerStorage, Unit, RunBatchAgain     the base class a new adapter derives from
    Requested, PredecessorApplied,         the work items a storage executes, and the
    SuccessorCompensated, DecisionArrived, events it reports
    RequestSeen, WorkItem, Report
    LedgerEntry, LedgerStatus              what a storage's ledger holds

Everything else (the barrier, the item algorithm, the adapters' parts) lives in
private modules; tests import it from there.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from saga.participants._barrier import (
    LedgerEntry,
    LedgerStatus,
    PredecessorApplied,
    Requested,
    SuccessorCompensated,
)
from saga.participants._handlers import Handler, Reject, current_step, load_handlers
from saga.participants._observe import ParticipantStats
from saga.participants._open import open_storage
from saga.participants._runtime import ParticipantRuntime
from saga.participants._storage import (
    Actions,
    DecisionArrived,
    LedgerStorage,
    Report,
    RequestSeen,
    RunBatchAgain,
    StepScope,
    Storage,
    Unit,
    WorkItem,
)

if TYPE_CHECKING:
    from saga.participants.mongo._adapter import MongoSession, MongoStorage
    from saga.participants.redis._adapter import RedisSession, RedisStorage
    from saga.participants.sql._adapter import SqlSession, SqlStorage

# The adapters import their drivers (SQLAlchemy, pymongo, redis-py): only on first use.
_ADAPTERS = {
    "SqlStorage": "saga.participants.sql._adapter",
    "SqlSession": "saga.participants.sql._adapter",
    "MongoStorage": "saga.participants.mongo._adapter",
    "MongoSession": "saga.participants.mongo._adapter",
    "RedisStorage": "saga.participants.redis._adapter",
    "RedisSession": "saga.participants.redis._adapter",
}


def __getattr__(name: str) -> Any:
    module = _ADAPTERS.get(name)
    if module is None:
        raise AttributeError(f"module 'participants' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "Actions",
    "DecisionArrived",
    "Handler",
    "LedgerEntry",
    "LedgerStatus",
    "LedgerStorage",
    "MongoSession",
    "MongoStorage",
    "ParticipantRuntime",
    "ParticipantStats",
    "PredecessorApplied",
    "RedisSession",
    "RedisStorage",
    "Reject",
    "Report",
    "RequestSeen",
    "Requested",
    "RunBatchAgain",
    "SqlSession",
    "SqlStorage",
    "StepScope",
    "Storage",
    "SuccessorCompensated",
    "Unit",
    "WorkItem",
    "current_step",
    "load_handlers",
    "open_storage",
]
