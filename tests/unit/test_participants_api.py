"""The public surface of :mod:`participants`: what ``__all__`` names, and that it resolves.

Changing the public API is a decision: this list changes with it, on purpose.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import pytest

from saga import participants
from saga.streams import Mode, Outcome, StepStatus, TransientError

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
    "StepScope",
    "Storage",
    "SuccessorCompensated",
    "Unit",
    "WorkItem",
    "current_step",
    "load_handlers",
    "open_storage",
]


def test_all_is_the_public_api() -> None:
    assert participants.__all__ == PUBLIC


def test_every_public_name_resolves() -> None:
    for name in participants.__all__:
        assert getattr(participants, name) is not None, name


def test_the_adapters_derive_from_the_storage_base_class() -> None:
    for adapter in (
        participants.SqlStorage,
        participants.MongoStorage,
        participants.RedisStorage,
    ):
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


# ---------------------------------------------------------------- the base class's contract


class Boom(Exception):
    """The in-memory store's driver error."""


class MemoryUnit(participants.Unit[dict[str, Any]]):
    """A ledger in a dict; the native session is the business dict itself."""

    def __init__(self, store: MemoryStorage) -> None:
        self.store = store
        self.native = store.data
        self.finished: list[BaseException | None] = []

    def entry(self, tx_id: str, step: int) -> participants.LedgerEntry | None:
        return self.store.entries.get((tx_id, step))

    def entries(self, tx_id: str) -> list[participants.LedgerEntry]:
        found = [e for (tx, step), e in self.store.entries.items() if tx == tx_id and step >= 0]
        return sorted(found, key=lambda e: e.step)

    def tx_rolled_back(self, tx_id: str) -> bool:
        return (tx_id, -1) in self.store.entries

    def known_fingerprint(self, tx_id: str) -> str | None:
        return None

    def write(self, entry: participants.LedgerEntry) -> None:
        if self.store.races:
            self.store.races -= 1
            raise Race
        self.store.entries[(entry.tx_id, entry.step)] = entry

    def rollback_effect(self) -> None:
        pass

    def finish(self, error: BaseException | None) -> None:
        self.store.finished.append(error)


class Race(Exception):
    """Another writer won."""


class MemoryActions(participants.Actions[dict[str, Any]]):
    def apply(self, native: dict[str, Any], action: str, args: Mapping[str, Any]) -> Any:
        if action == "explode":
            raise Boom("the store broke")
        native[args["key"]] = args["value"]
        return None

    def compensate(
        self, native: dict[str, Any], action: str, args: Mapping[str, Any], before: Any
    ) -> None:
        native.pop(args["key"], None)

    def confirm(self, native: dict[str, Any], action: str, args: Mapping[str, Any]) -> None:
        if args.get("refuse_confirm"):
            raise participants.Reject("not now")


class MemoryStorage(participants.LedgerStorage[dict[str, Any], int]):
    driver_errors = (Boom,)
    max_attempts = 3

    def __init__(self) -> None:
        super().__init__()
        self.name = "mem"
        self.where = "memory"
        self.actions = MemoryActions()
        self.data: dict[str, Any] = {}
        self.entries: dict[tuple[str, int], participants.LedgerEntry] = {}
        self.races = 0
        self.finished: list[BaseException | None] = []
        self.batches: list[int] = []
        self.seen_runs: list[list[str]] = []
        self.again_once = False

    def prepare(self) -> None:
        pass

    @contextmanager
    def open_batch(self, items: Sequence[participants.WorkItem], attempt: int) -> Iterator[int]:
        self.batches.append(attempt)
        yield attempt
        if self.again_once and attempt == 0:
            raise participants.RunBatchAgain

    def open_unit(
        self,
        batch: int,
        item: participants.WorkItem,
        previous: participants.Unit[dict[str, Any]] | None,
    ) -> MemoryUnit:
        return MemoryUnit(self)

    def run_again(self, unit: participants.Unit[dict[str, Any]], exc: Exception) -> bool:
        return isinstance(exc, Race)

    def mark_seen(self, batch: int, items: Sequence[participants.RequestSeen]) -> None:
        self.seen_runs.append([item.tx_id for item in items])

    def translate(self, exc: BaseException, what: str) -> NoReturn:
        raise TransientError(f"could not {what}: {exc}") from exc

    def ledger(self, tx_id: str | None = None) -> list[participants.LedgerEntry]:
        return [e for (tx, _), e in self.entries.items() if tx_id in (None, tx)]

    def in_flight_sequential(self) -> set[str]:
        return set()

    def prune(self, horizon_ms: int, limit: int) -> int:
        return 0


def put(tx_id: str, key: str = "k", **extra: Any) -> participants.Requested:
    return participants.Requested(
        tx_id, 0, "put", {"key": key, "value": 1, **extra}, Mode.PARALLEL, 1, 10_000, 1
    )


def test_an_item_that_loses_a_race_runs_again_then_is_a_transient_error() -> None:
    storage = MemoryStorage()
    storage.races = 2
    reports = storage.execute([put("tx-1")])
    assert [r.status for r in reports] == [StepStatus.APPLIED]
    assert [type(e) for e in storage.finished] == [Race, Race, type(None)]
    storage.races = 5
    with pytest.raises(TransientError, match="kept conflicting"):
        storage.execute([put("tx-2")])


def test_a_rejected_confirmation_reports_nothing_and_the_batch_goes_on() -> None:
    storage = MemoryStorage()
    storage.execute([put("tx-1", refuse_confirm=True), put("tx-2", key="j")])
    decided = [
        participants.DecisionArrived("tx-1", Outcome.COMMIT, 2),
        participants.DecisionArrived("tx-2", Outcome.COMMIT, 2),
    ]
    assert [(r.tx_id, r.status) for r in storage.execute(decided)] == [
        ("tx-2", StepStatus.COMMITTED)
    ]
    assert isinstance(storage.finished[-2], participants.Reject)
    assert storage.entries[("tx-1", 0)].status is participants.LedgerStatus.APPLIED


def test_driver_errors_are_translated_at_the_boundary() -> None:
    storage = MemoryStorage()
    explode = participants.Requested("tx-1", 0, "explode", {}, Mode.PARALLEL, 1, 10_000, 1)
    with pytest.raises(TransientError, match="could not run a batch: the store broke"):
        storage.execute([explode])
    assert isinstance(storage.finished[-1], Boom)


def test_a_batch_may_ask_to_run_again_and_seen_requests_go_together() -> None:
    storage = MemoryStorage()
    storage.again_once = True
    seen = [participants.RequestSeen(f"s-{i}", "f" * 64, 10_000, 1) for i in range(3)]
    storage.execute([seen[0], seen[1], put("tx-1"), seen[2]])
    assert storage.batches == [0, 1]
    assert storage.seen_runs == [["s-0", "s-1"], ["s-2"], ["s-0", "s-1"], ["s-2"]]
