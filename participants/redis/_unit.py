"""The Redis adapter's unit: one work item's rounds of WATCH ... MULTI ... EXEC.

See :mod:`participants._redis` for the rounds and why they are safe; the keys are
:class:`participants._ledger.RedisLedgerKeys`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, Final, cast

import redis
from redis import exceptions as redis_errors
from redis.client import Pipeline

from saga.participants._barrier import LedgerEntry, LedgerStatus, finished_ms, isolation_of
from saga.participants._ledger import (
    MARKER_FIELD,
    SEEN_FIELD,
    RedisLedgerKeys,
    entry_json,
    entry_of_json,
    field_of_step,
    step_of_field,
)
from saga.participants._refusals import step_name
from saga.participants._storage import Unit
from saga.participants.redis._errors import step_refusal
from saga.participants.redis._session import RedisSession, watch_hgetall
from saga.streams import TX_ID_PATTERN, InvalidRecord, Isolation, Mode

TX_ID: Final = re.compile(TX_ID_PATTERN)
log = logging.getLogger("saga.participant")


def finished_here(entry: LedgerEntry) -> int | None:
    """:func:`~participants._barrier.finished_ms`, except that an applied
    ``read_committed`` step is not finished before its decision: its hold or reservation
    stays in the side hash until then, so its entry stays too (pruned, a late decision
    would find nothing to commit or release)."""
    if (
        entry.status is LedgerStatus.APPLIED
        and isolation_of(entry.before) is Isolation.READ_COMMITTED
    ):
        return None
    return finished_ms(entry)


def tx_finished_ms(fields: Mapping[str, str]) -> int | None:
    """When every entry and marker of a transaction's hash finished (``None``: not yet)."""
    latest: int | None = None
    for text in fields.values():
        finished = finished_here(entry_of_json(text))
        if finished is None:
            return None
        latest = finished if latest is None else max(latest, finished)
    return latest


def known_fingerprint(fields: Mapping[str, str]) -> str | None:
    steps = steps_of(fields)
    if steps:
        return next((e.fingerprint for e in steps if e.fingerprint), None)
    seen = fields.get(SEEN_FIELD)
    return None if seen is None else entry_of_json(seen).fingerprint


def may_wait(entry: LedgerEntry) -> bool:
    """Whether a step of a sequential saga may still need a neighbour's event."""
    if entry.mode is not Mode.SEQUENTIAL:
        return False
    if entry.status is LedgerStatus.WAITING:
        return True
    # Applied or failed and not decided: its rollback may wait for its successor's
    # compensation, and the predecessor's event, read again after a crash, reports it again.
    # (A commit leaves an applied step as it is, so it stays listed until it is pruned.)
    return entry.status in (LedgerStatus.APPLIED, LedgerStatus.FAILED)


def steps_of(fields: Mapping[str, str]) -> list[LedgerEntry]:
    found = [
        entry_of_json(text) for name, text in fields.items() if step_of_field(name) is not None
    ]
    return sorted(found, key=lambda entry: entry.step)


class RedisUnit(Unit[RedisSession]):
    """One work item's rounds of WATCH ... MULTI ... EXEC (see the module doc).

    ``_ledgers`` is this unit's view of each transaction's ledger hash: what it
    read, plus what it wrote. A round that reads a ledger again after an EXEC
    compares it with this view, so a change made by someone else between two
    rounds makes the item run again, like a change during a round does.
    """

    def __init__(
        self, client: redis.Redis, keys: RedisLedgerKeys, prefix: str, targets: frozenset[str]
    ) -> None:
        self.keys = keys
        self.pipe: Pipeline = client.pipeline(transaction=True)
        self.native = RedisSession(self.pipe, prefix, targets)
        self._ledgers: dict[str, dict[str, str]] = {}
        self._watched: set[str] = set()

    def close(self) -> None:
        self.pipe.reset()

    def _ledger(self, tx_id: str) -> dict[str, str]:
        if not isinstance(tx_id, str) or not TX_ID.fullmatch(tx_id):
            raise InvalidRecord(f"transaction id {tx_id!r} breaks the wire contract")
        if tx_id not in self._watched:
            fresh = watch_hgetall(self.pipe, self.keys.tx(tx_id))
            if tx_id in self._ledgers and fresh != self._ledgers[tx_id]:
                raise redis_errors.WatchError(f"the ledger of {tx_id} changed between two steps")
            self._ledgers[tx_id] = fresh
            self._watched.add(tx_id)
        return self._ledgers[tx_id]

    def entry(self, tx_id: str, step: int) -> LedgerEntry | None:
        text = self._ledger(tx_id).get(field_of_step(step))
        return None if text is None else entry_of_json(text)

    def entries(self, tx_id: str) -> list[LedgerEntry]:
        return steps_of(self._ledger(tx_id))

    def tx_rolled_back(self, tx_id: str) -> bool:
        return MARKER_FIELD in self._ledger(tx_id)

    def known_fingerprint(self, tx_id: str) -> str | None:
        return known_fingerprint(self._ledger(tx_id))

    def write(self, entry: LedgerEntry) -> None:
        fields = self._ledger(entry.tx_id)
        name = self.keys.tx(entry.tx_id)
        field = field_of_step(entry.step)
        text = entry_json(entry)
        after = {**fields, field: text}
        self.pipe.multi()
        queued = self.native.take_queue()
        for command in queued:
            cast(Any, self.pipe).execute_command(*command)
        self.pipe.hset(name, field, text)
        if any(may_wait(step) for step in steps_of(after)):
            self.pipe.sadd(self.keys.in_flight, entry.tx_id)
        else:
            self.pipe.srem(self.keys.in_flight, entry.tx_id)
        finished = tx_finished_ms(after)
        if finished is None:
            self.pipe.zrem(self.keys.finished, entry.tx_id)
        else:
            self.pipe.zadd(self.keys.finished, {entry.tx_id: finished})
        self._exec(entry, len(queued))
        self._ledgers[entry.tx_id] = after
        self._watched.clear()

    def _exec(self, entry: LedgerEntry, queued: int) -> None:
        """``EXEC``; raises WatchError when a watched key changed (run again). A command of
        the step that Redis refused when it was queued (a wrong command or argument
        count) made ``EXEC`` run nothing: the step's refusal. One Redis refused while
        running it (``WRONGTYPE`` on a handler's key) did not stop the others, the
        entry's among them, and Redis undoes nothing: the step stays as recorded, and the
        refusal is logged for its handler's author."""
        what = (
            "the ledger entry"
            if entry.action is None
            else step_name(entry.action, entry.args or {})
        )
        try:
            results = self.pipe.execute(raise_on_error=False)
        except redis_errors.ResponseError as exc:
            refused = step_refusal(exc, what)
            if refused is None:
                raise
            refused.step = entry.step
            raise refused from exc
        failed = [r for r in results[:queued] if isinstance(r, redis_errors.ResponseError)]
        for error in failed:
            log.error("%s of %s ran only in part: %s", what, entry.tx_id, error)
        ours = [r for r in results[queued:] if isinstance(r, redis_errors.ResponseError)]
        if ours:
            raise ours[0]

    def rollback_effect(self) -> None:
        self.native.take_queue()
