"""What a store says about one step belongs to that step, not to the batch or the process.

Every adapter sorts its driver's errors into four :class:`Verdict` s (its table lives
beside its driver: :mod:`participants.sql._errors`, :mod:`participants.redis._errors`,
:mod:`participants.mongo._errors`):

* ``transient``: the store is unreachable, short of resources, shutting down, or lost a
  conflict; the batch is retried with backoff, however long it takes;
* ``timeout``: one statement ran out of time (a statement or lock timeout); it may pass
  on another try, so the step is run again a few times before it is refused;
* ``refused``: the store refused the statement for what it is (a constraint, a
  trigger's raised exception, a data or syntax error, a missing privilege); the step
  is refused at once;
* ``configuration``: the process cannot work at all (credentials); it exits, and a
  restart's start-up check names what to fix.

A refusal met inside an action becomes :class:`StoreRefused`, which the storage base
class records on the one item it belongs to (:meth:`~participants._storage.LedgerStorage.run_one`):
a new step fails (its saga rolls back), a decision the store refuses is tried again with
a bounded backoff and then parked and reported (``compensation_failed`` with the
store's words; a commit leaves the step applied, so a re-driven decision tries again).
:class:`~participants._store_errors.StoreErrors` wraps an adapter's actions (built-in and
custom) so that a driver error raised inside one is classified where the step is known.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Protocol

from saga.streams import BusinessRejection

log = logging.getLogger("saga.participant")


class Verdict(StrEnum):
    """What a store's error means for the work (see the module doc)."""

    TRANSIENT = "transient"
    TIMEOUT = "timeout"
    REFUSED = "refused"
    CONFIGURATION = "configuration"


class StoreRefused(BusinessRejection):
    """The store refused one step's statement (``timeout``: the statement ran out of time).

    A :class:`~streams.BusinessRejection`, so that wherever a rejection is undone (a
    unit's savepoint, a queued write) a refusal is undone the same way. ``step`` is set
    by the storage base class when it lets the refusal through to try the item again.
    """

    def __init__(self, reason: str, *, timeout: bool = False) -> None:
        super().__init__(reason)
        self.timeout = timeout
        self.step: int | None = None


def step_name(action: str, args: Mapping[str, Any]) -> str:
    """``the increment of accounts/alice`` (a built-in action's record), else ``the <action>
    step`` (a custom action, whose arguments name no record)."""
    target, key = args.get("target"), args.get("key")
    if isinstance(target, str) and isinstance(key, str | int) and not isinstance(key, bool):
        return f"the {action} of {target}/{key}"
    return f"the {action} step"


def refusal(store: str, what: str, detail: str, code: str | None, verdict: Verdict) -> StoreRefused:
    """The refusal of ``what`` by ``store``, in the store's words and its error code:
    ``PostgreSQL refused the increment of accounts/frozen: account frozen (P0001)``."""
    said = f"{detail} ({code})" if code else detail
    if verdict is Verdict.TIMEOUT:
        return StoreRefused(f"{store} timed out on {what}: {said}", timeout=True)
    return StoreRefused(f"{store} refused {what}: {said}")


class _Policy(Protocol):
    refusal_attempts: int
    refusal_backoff_s: float


def run_again_after(
    participant: str, tx_id: str, refused: StoreRefused, runs: int, policy: _Policy
) -> bool:
    """After run ``runs`` of an item of ``tx_id`` ended in ``refused``: log it, and either
    wait (the backoff, doubling from ``policy.refusal_backoff_s``) and say run it again,
    or, after ``policy.refusal_attempts`` runs, say record the refusal instead."""
    if runs >= policy.refusal_attempts:
        log.error(
            "participant %r: %s refused %d times; recorded on its step (a new step fails, a "
            "decision is parked and reported compensation_failed): %s",
            participant,
            tx_id,
            runs,
            refused.reason,
            extra={"tx_id": tx_id},
        )
        return False
    log.warning(
        "participant %r: %s, run %d of %d: %s",
        participant,
        tx_id,
        runs,
        policy.refusal_attempts,
        refused.reason,
        extra={"tx_id": tx_id},
    )
    time.sleep(policy.refusal_backoff_s * 2 ** (runs - 1))
    return True
