"""What the coordinator schedules on its timers, and the re-drive of stalled decisions.

:class:`Chores` holds the rules that put entries on a partition's timers
(:class:`~coordinator._retention.PartitionState`; the heaps change only when a batch
commits, :mod:`coordinator._timers`): a saga's deadline, when it may be forgotten
(retention), and when its decision is sent again.

**Re-driven decisions.** A saga decided but not finished (``committing``: a step has
something to confirm; ``rolling_back``: a step is not compensated yet) waits for its
participants. One that dropped the decision, or failed to act on it, would leave the
saga there until ``saga reconcile --replay``. So when such a saga has not changed for
:attr:`Redrive.after_ms`, the coordinator publishes its decision again, then again
after twice as long, four times, ... at most :attr:`Redrive.limit` times since its last
change (any change starts the count again); after that it logs that the saga is left to
the audit. A copy carries ``saga.replayed.by: coordinator`` (outside the signature, as
the reconciliation job's replays), is routed as the first (``coordinator._route``:
on a commit, to the participants that still have something to confirm) and is counted
in ``saga_decisions_redriven_total``, not as a decision. The participants' barrier
makes a repeated decision harmless: a step acted on already reports its event again.
The counts live in memory: a restarted coordinator starts them again, and re-drives
at once what stalled before it started. A saga restored ``committing`` is re-driven at
once whatever its age: while re-drives are on, a step's ``committed`` report that leaves
its saga ``committing`` is not published on the status topic (:meth:`Chores.unpublished`),
so the restored saga does not know it.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from saga.coordinator import _route
from saga.coordinator._machine import Saga
from saga.coordinator._machine_io import Input, StepReported
from saga.coordinator._retention import PartitionState
from saga.coordinator._timers import TimerBatch
from saga.streams import Decision, SagaState, StepStatus, encode
from saga.streams._routing import Headers
from saga.streams._signing import UNSIGNED_HEADER_PREFIX

__all__ = ["DEFAULT_REDRIVE", "REDRIVEN_BY", "STALLED", "Chores", "Redrive"]

log = logging.getLogger("saga.coordinator")

STALLED: Final = frozenset({SagaState.COMMITTING, SagaState.ROLLING_BACK})
"""States in which a saga waits for its participants to act on its decision."""

REDRIVEN_BY: Final = (f"{UNSIGNED_HEADER_PREFIX}by", b"coordinator")
"""The header of a decision the coordinator sent again (as ``saga reconcile``'s replays)."""

_REDRIVE_PER_BATCH: Final = 1000  # a restart over many stalled sagas: spread over batches


@dataclass(frozen=True, slots=True)
class Redrive:
    """When the decision of a stalled saga is sent again (see the module docstring).

    ``after_ms`` 0 (or ``limit`` 0) turns re-drives off.
    """

    after_ms: int = 30_000
    limit: int = 5

    @property
    def on(self) -> bool:
        return self.after_ms > 0 and self.limit > 0

    def first(self, updated_ms: int) -> int:
        """When a saga unchanged since ``updated_ms`` is first re-driven."""
        return updated_ms + self.after_ms

    def following(self, sent_ms: int, sent: int) -> int:
        """When the next re-drive follows the ``sent``-th one, sent at ``sent_ms``: the wait
        doubles each time (a restart that re-drives at once does not send a burst)."""
        return sent_ms + self.after_ms * (1 << sent)


DEFAULT_REDRIVE: Final = Redrive()


class Chores:
    """The timer rules of one coordinator (``retention_ms``: see CoordinatorService)."""

    def __init__(self, retention_ms: int, redrive: Redrive) -> None:
        self.retention_ms = retention_ms
        self.redrive = redrive

    def forget_at(self, saga: Saga) -> int | None:
        """When ``saga`` may be forgotten (see CoordinatorService), or None: keep it."""
        if not saga.request_seen:
            return saga.updated_ms + self.retention_ms
        if saga.state in (SagaState.COMMITTED, SagaState.ROLLED_BACK):
            return max(saga.deadline_ms, saga.updated_ms) + self.retention_ms
        return None

    @staticmethod
    def due(partitions: Iterable[PartitionState], now: int) -> bool:
        """Whether a timer of ``partitions`` is due at ``now`` (a batch should run)."""
        return any(part.due(now) for part in partitions)

    def unpublished(self, before: Saga | None, after: Saga | None, inp: Input) -> bool:
        """Whether the status of ``after`` goes unpublished: ``inp`` is a step's ``committed``
        report that leaves its saga ``committing`` (its next status, ``committed``, says it).
        Any other report is published: a commit the store refused (``compensation_failed``,
        parked) is what an operator must see.

        The status topic is the coordinator's changelog, so a coordinator that takes the
        saga over (a crash, a rebalance) restores it without those reports; it sends the
        decision again at once (:meth:`restored`), and the participants report their
        committed steps again. So only while re-drives are on. Under ``read_committed``
        every step reports its commit: this saves the status topic, its readers and the
        coordinator's encoding about half a record per saga of three steps."""
        return (
            self.redrive.on
            and isinstance(inp, StepReported)
            and inp.event.status is StepStatus.COMMITTED
            and before is not None
            and after is not None
            and before.state is SagaState.COMMITTING
            and after.state is SagaState.COMMITTING
        )

    def restored(self, part: PartitionState, saga: Saga) -> None:
        """Schedule a saga just rebuilt from the status topic (``part.forget`` is heapified
        by the caller once every saga is in)."""
        if not saga.decided and saga.request_seen:
            heapq.heappush(part.deadlines, (saga.deadline_ms, saga.tx_id))
        if (at := self.forget_at(saga)) is not None:
            part.forget.append((at, saga.tx_id))
        if self.redrive.on and saga.state is SagaState.COMMITTING:
            # Its steps' `committed` reports are not on the status topic (coordinator._service):
            # the decision goes again at once, so its participants report them again.
            part.redriven[saga.tx_id] = (saga.updated_ms, 0, saga.updated_ms)
            heapq.heappush(part.redrive, (saga.updated_ms, saga.tx_id))
        elif self.redrive.on and saga.state in STALLED:
            heapq.heappush(part.redrive, (self.redrive.first(saga.updated_ms), saga.tx_id))

    def merged(self, part: PartitionState, tx_id: str, before: Saga | None, after: Saga) -> None:
        """Schedule a saga whose change a committed batch merged into memory."""
        forget_at = self.forget_at(after)
        if forget_at is not None and (before is None or self.forget_at(before) != forget_at):
            part.forget_later(forget_at, tx_id)  # (a finished saga's time is on disk)
        if after.state not in STALLED:
            part.redriven.pop(tx_id, None)
        elif self.redrive.on and (
            before is None or before.updated_ms != after.updated_ms or before.state != after.state
        ):
            heapq.heappush(part.redrive, (self.redrive.first(after.updated_ms), tx_id))

    def redriven(
        self,
        part: PartitionState,
        timers: TimerBatch,
        changed: Mapping[str, tuple[int, Saga]],
    ) -> list[tuple[Decision, bytes, Headers]]:
        """The decisions of ``part``'s stalled sagas to send again in this batch."""
        out: list[tuple[Decision, bytes, Headers]] = []
        for due_ms, tx_id in timers.fire(part, "redrive", _REDRIVE_PER_BATCH):
            saga = part.sagas.get(tx_id)
            if tx_id in changed or saga is None or saga.outcome is None:
                continue  # it moved in this batch (its merge schedules it again), or is gone
            mark = part.redriven.get(tx_id)
            if mark is not None and mark[0] == saga.updated_ms:
                sent, expected = mark[1], mark[2]
            else:
                sent, expected = 0, self.redrive.first(saga.updated_ms)
            if saga.state not in STALLED or due_ms != expected:
                continue  # a stale entry: the saga changed since it was scheduled
            decision = Decision(tx_id, saga.outcome, saga.reason or "", timers.now)
            headers = [*_route.decision_route(decision, saga), REDRIVEN_BY]
            out.append((decision, encode(decision), headers))
            following = self.redrive.following(timers.now, sent + 1)
            timers.redriven(part, tx_id, (saga.updated_ms, sent + 1, following))
            if sent + 1 < self.redrive.limit:
                timers.push(part, "redrive", (following, tx_id))
            else:
                log.warning(
                    "transaction %s is still %s after its decision was sent again %d times; "
                    "it is left to `saga reconcile` (see `saga status %s`)",
                    tx_id,
                    saga.state.value,
                    sent + 1,
                    tx_id,
                    extra={"tx_id": tx_id},
                )
        return out
