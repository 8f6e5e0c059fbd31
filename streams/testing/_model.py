"""Records, transactions, groups and the pieces shared by the in-memory clients."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from saga.streams.kafka import Message, Partition

if TYPE_CHECKING:
    from saga.streams.testing._clients import InMemoryConsumer
    from saga.streams.testing._log import InMemoryLog

_PARK_LIMIT_S = 60.0  # a parked service thread nobody releases ends itself


class Killed(BaseException):
    """The simulated process was killed (:meth:`InMemoryLog.kill`); not an ``Exception``,
    so that no ``except Exception`` of a service catches it."""


class ManualClock:
    """A clock (milliseconds) that moves only when told: pass it as a service's ``clock``."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = start_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> int:
        """Move the clock ``ms`` forward; returns the new time."""
        self.now_ms += ms
        return self.now_ms


@dataclass(slots=True, eq=False)
class _Txn:
    transactional_id: str
    state: Literal["open", "committed", "aborted"] = "open"
    doomed: str | None = None  # why the commit must fail
    touched: set[Partition] = field(default_factory=set)
    offsets: dict[tuple[str, Partition], int] = field(default_factory=dict)  # (group, tp)


@dataclass(slots=True)
class _Entry:
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int
    txn: _Txn | None = None
    marker: bool = False  # a transaction marker: occupies an offset, never delivered

    def visible(self, read_committed: bool) -> bool:
        if self.marker:
            return False
        return not read_committed or self.txn is None or self.txn.state == "committed"


@dataclass(slots=True)
class _Group:
    generation: int = 0
    members: dict[str, InMemoryConsumer] = field(default_factory=dict)
    assignment: dict[str, list[Partition]] = field(default_factory=dict)
    committed: dict[Partition, int] = field(default_factory=dict)
    pending: dict[Partition, _Txn] = field(default_factory=dict)


class _Gate:
    """Where a :class:`Stepper`'s thread waits at each poll until the test lets it go."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.permits = 0
        self.parks = 0
        self.done = False

    def park(self) -> None:
        with self.cond:
            self.parks += 1
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.permits > 0, timeout=_PARK_LIMIT_S):
                raise Killed("parked too long: the test never released this service")
            self.permits -= 1


def _message(topic: str, partition: int, offset: int, entry: _Entry) -> Message:
    return Message(
        topic=topic,
        partition=partition,
        offset=offset,
        key=entry.key,
        value=entry.value,
        headers=entry.headers,
        timestamp_ms=entry.timestamp_ms,
    )


class _Client:
    def __init__(self, log: InMemoryLog, client_id: str) -> None:
        self.log = log
        self.client_id = client_id
        self.thread_id: int | None = None  # the thread of the last call
        self.dead = False
        self.closed = False

    def _touch(self) -> None:
        ident = threading.get_ident()
        if self.dead or ident in self.log._dead_threads:
            raise Killed(f"{type(self).__name__} {self.client_id} was killed")
        self.thread_id = ident
