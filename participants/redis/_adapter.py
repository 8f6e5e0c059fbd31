"""The Redis storage: hash records and the step ledger, changed together (a script or MULTI/EXEC).

redis-py is imported by this adapter's modules only: :mod:`participants.redis._session`
(the native session), :mod:`participants.redis._actions` (the built-in actions, at both
isolation levels; the side hash: :mod:`participants.redis._isolation`),
:mod:`participants.redis._unit` (one item's rounds), :mod:`participants.redis._batch`
(the script path; its planning is :mod:`participants.redis._plan`, its Lua
:mod:`participants.redis._script`) and this one.
Keys (``prefix`` defaults to ``saga``; the ledger's are
:class:`participants._ledger.RedisLedgerKeys`, which the reconciliation job reads too)::

    <prefix>:<target>:<key>                       a record: a hash of field -> text
    <prefix>:ledger:+isolation:<target>:<key>     its side hash: the holds, reservations and
                                                  bounds of sagas on it (``+`` is in no
                                                  participant name)
    <prefix>:ledger:<participant>:tx:<tx_id>      the ledger of one transaction: a hash of
                                                  step -> entry (JSON), "rolled_back" -> the
                                                  transaction-level rollback marker and
                                                  "seen" -> the seen marker (a request with
                                                  no step here, and its fingerprint)
    <prefix>:ledger:<participant>:in_flight       a set: sequential transactions with a step
                                                  that may wait for a neighbour
    <prefix>:ledger:<participant>:finished        a sorted set: transactions that may be
                                                  finished, scored by when (for pruning)
    <prefix>:ledger:<participant>:finished_ready  set once the sorted set covers every
                                                  transaction (ledgers from before it existed)

Seen markers are written with ``HSETNX``, pipelined for a run of requests without
a step here; the transaction's known fingerprint is its step entries' when it has
any, else the seen marker's. Pruning removes a transaction's hash when every field
is finished (:func:`participants.redis._unit.finished_here`: an applied
``read_committed`` step is not, before its decision) at or before the horizon; the
sorted set only proposes candidates (its scores may be stale), the hash read under
WATCH decides. Pruning never touches a side hash.

Isolation (DESIGN.md §9). At ``read_committed`` (the default) a step leaves the record
alone: ``insert``/``put``/``update``/``delete`` hold it and ``increment`` reserves
(escrow) in its side hash, in the same ``MULTI``/``EXEC`` or script call as the ledger
entry, and the commit decision writes the record (the step reports ``committed``). A
step of another saga on a held record fails at once, naming the holder (no waiting: no
deadlock across participants, no partition blocked; the client may resubmit). At
``none`` a step writes at once, still refusing a record another saga holds, and its
compensation refuses to overwrite another saga's work or to cross a bound a bounded
increment relied on (``compensation_failed``, naming the record).

Two paths. New steps of the built-in ``increment`` (on integer fields) and decisions of
transactions with at most one such step here go to Redis in runs, one Lua script call
per run of up to 500 steps (:mod:`participants.redis._batch`: the barrier stays here in
Python; the script checks that the ledger is what the plan assumed, applies, reserves,
commits, releases or compensates each step and writes its entry, in batch order).
Everything else (repeats, decisions of several steps, neighbours' signals, the other
actions, decimals, custom handlers) takes the per-step path below, which is also where
the script hands back a step whose check failed.

Per-step path: optimistic, with WATCH/MULTI/EXEC, and the barrier decided in Python.
A unit WATCHes the transaction's ledger hash and reads it, the action WATCHes and
reads the record it needs and its side hash and *queues* its writes (nothing is
written yet), and
:meth:`RedisUnit.write` sends ``MULTI``, the queued writes, the ledger entry and the
in-flight set update, ``EXEC``. When another client changed a watched key in
between (a script call included), ``EXEC`` does nothing and the item is run again
from the start (up to ``max_attempts`` times, then a :class:`~streams.TransientError`).
Each ledger write ends one such round; a decision covering several steps runs one round
per step, and the next round checks that the ledger it read is unchanged. Each WATCH and
the reads it guards go out together
(:func:`participants.redis._session.watch_hgetalls`), so a step costs three
round trips: the ledger, the record with its side hash, ``MULTI``...``EXEC``.

Why the barrier is not in Lua: the barrier (:func:`participants._barrier.plan`) and
the custom handlers are Python; rewriting the barrier in Lua would give the
guarantees two implementations to keep equal, and handlers could not run inside
a script. The script is a constant text: values only travel as command arguments
(``KEYS``/``ARGV``), so no user string can ever be evaluated.

A batch is not one atomic unit here (``atomic_batch`` is false): every step (or
script call) commits on its own (so one item's rejection never touches another's).
When Redis becomes unreachable mid-batch, the finished steps stay done and the
retried batch re-reports them from the ledger.

Key parts are validated: the prefix (no whitespace, control or glob characters
``*?[]\\``, not ending in ``:``), participant names (1-64 of ``[A-Za-z0-9._-]``),
targets (identifiers; ``ledger`` is reserved) and keys (an integer, or a string
without whitespace, control or glob characters; ``9`` and ``"9"`` are one key).

Values are text. ``null`` removes the field (Redis hashes have no null), so a
record needs at least one non-null field; booleans are ``true``/``false``; numbers
their shortest decimal spelling. ``increment`` works on integers and decimals:
it parses the field's text, adds ``by`` in decimal arithmetic (``10.50`` + 0.1 is
``10.60``), checks ``[min, max]`` and writes the result; its compensation
subtracts ``by`` and, when that lands on the old value, writes back the old text
exactly. A field that is not a number is a business rejection.

Errors (:mod:`participants.redis._errors` classifies them): Redis unreachable or
loading, a read-only replica, out of memory, or a step that kept losing the WATCH race
are a :class:`~streams.TransientError`; bad credentials, or a ledger key holding
another type, are a :class:`~streams.ConfigurationError`; a record key holding a
non-hash fails the step (:class:`~streams.BusinessRejection`), and so does what Redis
answers about a step's own command, read or queued by a custom handler (``WRONGTYPE``,
a wrong command or argument, a script's error: the step's
:class:`~participants._refusals.StoreRefused`, or its decision parked and reported).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Final, NoReturn, cast
from urllib.parse import urlsplit

import redis
from redis import exceptions as redis_errors

from saga.participants._actions import Key, check_identifier
from saga.participants._barrier import LedgerEntry, finished_ms
from saga.participants._handlers import Handler, combine
from saga.participants._ledger import SEEN_FIELD, RedisLedgerKeys, entry_json, seen_marker
from saga.participants._refusals import Verdict
from saga.participants._storage import (
    Actions,
    LedgerStorage,
    Report,
    RequestSeen,
    Unit,
    WorkItem,
)
from saga.participants._store_errors import StoreErrors
from saga.participants.redis._actions import RedisActions, value_text
from saga.participants.redis._batch import Planner, RedisBatch
from saga.participants.redis._errors import step_refusal, verdict
from saga.participants.redis._session import (
    UNSAFE,
    RedisSession,
    key_text,
    record_key,
    string,
    strings,
    watch,
)
from saga.participants.redis._unit import TX_ID, RedisUnit, steps_of, tx_finished_ms
from saga.streams import ConfigurationError, InvalidRecord, TransientError
from saga.streams._faults import NO_FAULTS, Faults
from saga.streams._secrets import redact, redact_url

RESERVED_TARGETS: Final = frozenset({"ledger"})
PARTICIPANT_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
DEFAULT_PREFIX: Final = "saga"
DEFAULT_MAX_ATTEMPTS: Final = 25


class RedisStorage(LedgerStorage[RedisSession]):
    """A participant's Redis: hash records under ``<prefix>:<target>:`` and its ledger.

    ``url`` is a ``redis://`` (or ``rediss://``, ``unix://``) URL; ``targets`` are
    the key prefixes steps may touch (the allow-list). ``handlers`` as for
    :class:`~participants._sql.SqlStorage`; handlers receive a :class:`RedisSession`
    as ``native``. ``max_attempts`` bounds how often one item is run again after
    losing a WATCH race. ``scripts`` false keeps every step on the per-step path
    (see :mod:`participants._redis_batch`: for a Redis that refuses ``EVALSHA`` to
    this user, or a cluster whose keys would span hash slots). :meth:`execute` acts
    on every item in order, repeats included.
    """

    driver_errors = (redis_errors.RedisError,)
    atomic_batch = False

    def __init__(
        self,
        name: str,
        url: str,
        targets: Iterable[str],
        *,
        prefix: str = DEFAULT_PREFIX,
        handlers: Actions[Any] | Mapping[str, Handler] | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        timeout_s: float = 10.0,
        scripts: bool = True,
        faults: Faults = NO_FAULTS,
    ) -> None:
        super().__init__(faults=faults)
        if not isinstance(name, str) or not PARTICIPANT_NAME.fullmatch(name):
            raise ConfigurationError(
                f"participant name {name!r} must be 1-64 letters, digits, '.', '_' or '-'"
            )
        self.name = name
        self.targets = frozenset(targets)
        for target in sorted(self.targets):
            check_identifier(target, "target")
            if target in RESERVED_TARGETS:
                raise ConfigurationError(
                    f"target name {target!r} is reserved: the ledger lives under {prefix}:{target}:"
                )
        if (
            not isinstance(prefix, str)
            or not 0 < len(prefix) <= 64
            or UNSAFE.search(prefix)
            or prefix.endswith(":")
        ):
            raise ConfigurationError(
                f"key prefix {prefix!r} must be 1-64 characters without whitespace, control "
                "or glob characters (* ? [ ] \\), and not end with ':'"
            )
        self.prefix = prefix
        self.max_attempts = max_attempts
        self.where = _describe(url)
        try:
            self.client: redis.Redis = redis.Redis.from_url(
                url,
                decode_responses=True,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
            )
        except ValueError as exc:
            raise ConfigurationError(
                f"{redact_url(url)!r} is not a Redis URL ({_detail(exc)}); give one such as "
                "redis://host:6379/0"
            ) from exc
        self.keys = RedisLedgerKeys(prefix, name)
        self.in_flight_key = self.keys.in_flight
        self.finished_key = self.keys.finished
        self._finished_ready = False
        combined = combine(RedisActions(self.targets), handlers)
        # What Redis answers about an action's own command is that step's refusal.
        self.actions = StoreErrors(combined, step_refusal)
        planner = Planner(combined, self.keys, prefix, self.targets)
        self.batch_script = RedisBatch(self.client, planner) if scripts else None

    def ledger_key(self, tx_id: str) -> str:
        return self.keys.tx(tx_id)

    def record_key(self, target: str, key: Key) -> str:
        """The key of record ``target/key`` (for tools and tests)."""
        return record_key(self.prefix, target, key)

    # -- lifecycle

    def prepare(self) -> None:
        """Check that Redis answers (there is nothing to create)."""
        with self.boundary("reach Redis"):
            self.client.ping()

    def close(self) -> None:
        self.client.close()

    # -- work

    def _batch(self, items: Sequence[WorkItem], attempt: int) -> list[Report]:
        """The batch loop of :class:`LedgerStorage`, with the items between two runs of
        seen markers handed to :class:`participants._redis_batch.RedisBatch` (script
        calls for what it can plan, the per-step path for the rest, in batch order)."""
        script = self.batch_script
        if script is None or self.faults.unsafe("barrier-off"):
            return super()._batch(items, attempt)
        reports: list[Report] = []
        with self.open_batch(items, attempt) as batch:

            def slow(item: WorkItem) -> list[Report]:
                return self.run_one(batch, item)

            seen: list[RequestSeen] = []
            run: list[WorkItem] = []
            for item in items:
                if isinstance(item, RequestSeen):
                    if run:
                        reports.extend(script.run(run, slow))
                        run = []
                    seen.append(item)
                    continue
                if seen:  # before any item that may read those ledgers
                    self.mark_seen(batch, seen)
                    seen = []
                run.append(item)
            if run:
                reports.extend(script.run(run, slow))
            if seen:
                self.mark_seen(batch, seen)
        return reports

    @contextmanager
    def open_batch(self, items: Sequence[WorkItem], attempt: int) -> Iterator[None]:
        """Nothing is shared by a batch's items: each commits on its own."""
        yield None

    def open_unit(
        self, batch: None, item: WorkItem, previous: Unit[RedisSession] | None
    ) -> RedisUnit:
        return RedisUnit(self.client, self.keys, self.prefix, self.targets)

    def run_again(self, unit: Unit[RedisSession], exc: Exception) -> bool:
        """Someone changed what the step read (a WATCHed key): run it again."""
        return isinstance(exc, redis_errors.WatchError)

    def mark_seen(self, batch: None, items: Sequence[RequestSeen]) -> None:
        """Record the seen markers of a run of requests without a step here, in one pipeline.

        ``HSETNX``: a transaction that has a seen marker keeps it; one with step entries
        keeps its fingerprint (theirs comes first, see the module doc).
        """
        pipe = self.client.pipeline(transaction=False)
        for item in items:
            if not TX_ID.fullmatch(item.tx_id):
                raise InvalidRecord(f"transaction id {item.tx_id!r} breaks the wire contract")
            marker = seen_marker(
                item.tx_id,
                fingerprint=item.fingerprint,
                deadline_ms=item.deadline_ms,
                now_ms=item.now_ms,
            )
            pipe.hsetnx(self.keys.tx(item.tx_id), SEEN_FIELD, entry_json(marker))
            pipe.zadd(self.keys.finished, {item.tx_id: finished_ms(marker) or 0}, nx=True)
        pipe.execute()

    # -- reading the ledger

    def ledger(self, tx_id: str | None = None) -> list[LedgerEntry]:
        with self.boundary("read its ledger"):
            if tx_id is not None:
                names = [self.ledger_key(tx_id)]
            else:
                names = list(self.client.scan_iter(match=self.ledger_key("*"), count=500))
            found: list[LedgerEntry] = []
            for name in names:
                found.extend(steps_of(strings(self.client.hgetall(name))))
        return sorted(found, key=lambda entry: (entry.tx_id, entry.step))

    def in_flight_sequential(self) -> set[str]:
        with self.boundary("read its ledger"):
            members = self.client.smembers(self.in_flight_key)
        return {string(member) for member in members}

    # -- pruning

    def prune(self, horizon_ms: int, limit: int) -> int:
        """Remove the hashes of up to ``limit`` transactions finished at or before
        ``horizon_ms`` (candidates from the sorted set, checked under WATCH); return how
        many entries went."""
        removed = 0
        with self.boundary("prune its ledger"):
            self._cover_older_ledgers()
            found = self.client.zrangebyscore(
                self.finished_key, "-inf", horizon_ms, start=0, num=limit
            )
            candidates = cast(list[str], found)
            for tx_id in candidates:
                removed += self._prune_tx(tx_id, horizon_ms)
        return removed

    def _prune_tx(self, tx_id: str, horizon_ms: int) -> int:
        name = self.ledger_key(tx_id)
        with self.client.pipeline(transaction=True) as pipe:
            try:
                watch(pipe, (name,))
                fields = strings(pipe.hgetall(name))
                finished = tx_finished_ms(fields) if fields else horizon_ms
                pipe.multi()
                if finished is None:
                    pipe.zrem(self.finished_key, tx_id)  # a later write proposes it again
                elif finished > horizon_ms:
                    pipe.zadd(self.finished_key, {tx_id: finished})
                else:
                    pipe.delete(name)
                    pipe.zrem(self.finished_key, tx_id)
                    pipe.srem(self.in_flight_key, tx_id)
                pipe.execute()
            except redis_errors.WatchError:
                return 0  # written meanwhile: the next run looks again
        return len(fields) if finished is not None and finished <= horizon_ms else 0

    def _cover_older_ledgers(self) -> None:
        """Once per ledger: propose every transaction hash written before the sorted set
        existed (score 0: :meth:`_prune_tx` reads each and scores it properly)."""
        if self._finished_ready:
            return
        ready = self.keys.finished_ready
        if not self.client.exists(ready):
            head = self.ledger_key("")
            names: list[str] = []
            for key in self.client.scan_iter(match=self.ledger_key("*"), count=1000):
                names.append(string(key)[len(head) :])
                if len(names) >= 1000:
                    self.client.zadd(self.finished_key, dict.fromkeys(names, 0), nx=True)
                    names = []
            if names:
                self.client.zadd(self.finished_key, dict.fromkeys(names, 0), nx=True)
            self.client.set(ready, "1")
        self._finished_ready = True

    # -- errors

    def translate(self, exc: BaseException, what: str) -> NoReturn:
        """redis-py's errors in the saga error tree (see the module doc)."""
        prefix = f"participant {self.name!r} could not {what}"
        detail = _detail(exc)
        if isinstance(exc, redis_errors.AuthenticationError):
            raise ConfigurationError(
                f"{prefix}: authentication failure: {self.where} refused the credentials "
                f"({detail}); fix the user name or password in the storage URL"
            ) from exc
        if isinstance(exc, redis_errors.NoPermissionError):
            raise ConfigurationError(
                f"{prefix}: {self.where} refused a command ({detail}); grant the Redis user "
                "the commands and keys the participant needs"
            ) from exc
        if verdict(exc) is Verdict.TRANSIENT and not isinstance(exc, redis_errors.ResponseError):
            raise TransientError(
                f"{prefix}: {self.where} is unavailable ({detail}); retrying is safe"
            ) from exc
        if isinstance(exc, redis_errors.ResponseError) and verdict(exc) is Verdict.REFUSED:
            raise ConfigurationError(
                f"{prefix}: {self.where} rejected a command ({detail}); check that nothing "
                f"else writes under {self.prefix}: and that custom handlers queue valid commands"
            ) from exc
        raise TransientError(f"{prefix}: {self.where} failed ({detail}); retrying is safe") from exc


def _describe(url: str) -> str:
    """Where Redis is, for messages (never the password)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or "localhost"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "Redis"
    database = parts.path.lstrip("/") or "0"
    return f"Redis at {host}{port}/{database}"


def _detail(exc: BaseException) -> str:
    """The first line of redis-py's message, passwords hidden."""
    text = redact(str(exc)).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 240 else line[:237] + "..."


__all__ = [
    "RedisActions",
    "RedisSession",
    "RedisStorage",
    "RedisUnit",
    "key_text",
    "value_text",
]
