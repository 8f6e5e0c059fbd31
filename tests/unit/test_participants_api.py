"""The public surface of :mod:`participants`: what ``__all__`` names, and that it resolves.

Changing the public API is a decision: this list changes with it, on purpose.
"""

from __future__ import annotations

import subprocess
import sys

import participants

PUBLIC = [
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
    "Storage",
    "SuccessorCompensated",
    "Unit",
    "WorkItem",
    "load_handlers",
    "open_storage",
]


def test_all_is_the_public_api() -> None:
    assert participants.__all__ == PUBLIC


def test_every_public_name_resolves() -> None:
    for name in participants.__all__:
        assert getattr(participants, name) is not None, name


def test_the_adapters_derive_from_the_storage_base_class() -> None:
    for adapter in (participants.SqlStorage, participants.MongoStorage, participants.RedisStorage):
        assert issubclass(adapter, participants.LedgerStorage)
        assert issubclass(adapter, participants.Storage)


def test_internals_are_not_exported() -> None:
    for name in ("run_item", "plan", "Plan", "Effect", "Decided", "WithHandlers", "unique"):
        assert not hasattr(participants, name), name


def test_importing_the_package_loads_no_storage_driver() -> None:
    code = (
        "import sys, participants; "
        "print(sorted(m for m in ('sqlalchemy', 'pymongo', 'redis') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "[]"
