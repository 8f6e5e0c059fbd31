"""The Redis storage: hash records and the step ledger, changed together in one MULTI/EXEC.

redis-py is imported here only. Keys (``prefix`` defaults to ``saga``)::

    <prefix>:<target>:<key>                       a record: a hash of field -> text
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
is finished (:func:`participants._barrier.finished_ms`) at or before the horizon;
the sorted set only proposes candidates (its scores may be stale), the hash read
under WATCH decides.

Atomicity: optimistic, with WATCH/MULTI/EXEC, and the barrier decided in Python.
A unit WATCHes the transaction's ledger hash and reads it, the action WATCHes and
reads the record it needs and *queues* its writes (nothing is written yet), and
:meth:`Unit.write` sends ``MULTI``, the queued writes, the ledger entry and the
in-flight set update, ``EXEC``. When another client changed a watched key in
between, ``EXEC`` does nothing and the item is run again from the start (up to
``max_attempts`` times, then a :class:`~streams.TransientError`). Each ledger
write ends one such round; a decision covering several steps runs one round per
step, and the next round checks that the ledger it read is unchanged.

Why not one Lua script per action: the barrier (:func:`participants._barrier.plan`)
and the custom handlers are Python; rewriting the barrier in Lua would give the
guarantees two implementations to keep equal, and handlers could not run inside
a script. WATCH gives the same all-or-nothing effect per step, keeps one barrier,
and no script text exists at all, so no user string can ever be evaluated: values
only travel as command arguments.

A batch is not one atomic unit here: every step commits on its own (so one
item's rejection never touches another's). When Redis becomes unreachable
mid-batch, the finished steps stay done and the retried batch re-reports them from
the ledger.

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

Errors: Redis unreachable or loading, a read-only replica, or a step that kept
losing the WATCH race are a :class:`~streams.TransientError`; bad credentials, a
ledger key holding another type, or a queued command Redis rejects are a
:class:`~streams.ConfigurationError`; a record key holding a non-hash fails the
step (:class:`~streams.BusinessRejection`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from decimal import Decimal, InvalidOperation
from typing import Any, Final, NoReturn, cast
from urllib.parse import urlsplit

import redis
from redis import exceptions as redis_errors
from redis.client import Pipeline

from participants._actions import (
    IDENTIFIER,
    MAX_KEY_LENGTH,
    BuiltinAction,
    BuiltinActions,
    Increment,
    Key,
    RecordOps,
)
from participants._barrier import LedgerEntry, LedgerStatus, finished_ms
from participants._handlers import Handler, combine
from participants._storage import (
    Actions,
    Report,
    RequestSeen,
    Storage,
    Unit,
    WorkItem,
    run_item,
)
from streams import (
    TX_ID_PATTERN,
    BusinessRejection,
    ConfigurationError,
    InvalidRecord,
    Mode,
    TransientError,
)
from streams._secrets import redact, redact_url

log = logging.getLogger("saga.participant.redis")

MARKER_STEP: Final = -1
MARKER_FIELD: Final = "rolled_back"
"""The ledger hash field of the transaction-level rollback marker."""
SEEN_STEP: Final = -2
SEEN_FIELD: Final = "seen"
"""The ledger hash field of the seen marker (a request without a step here)."""
RESERVED_TARGETS: Final = frozenset({"ledger"})
PARTICIPANT_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
DEFAULT_PREFIX: Final = "saga"
DEFAULT_MAX_ATTEMPTS: Final = 25

_TX_ID: Final = re.compile(TX_ID_PATTERN)
_UNSAFE: Final = re.compile(r"[\s*?\[\]\\\x00-\x1f\x7f-\x9f]")
_INTEGER_TEXT: Final = re.compile(r"[+-]?[0-9]+")
_NUMBER_TEXT: Final = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")

Command = tuple[str | int | float | bytes, ...]


# ---------------------------------------------------------------- native session


class RedisSession:
    """What actions get as ``native`` for one work item.

    Read through :attr:`client` (a pipeline in immediate mode, on the connection
    that will run ``EXEC``) after calling :meth:`watch` on every key whose value
    decides what you write — :meth:`read` does both for a record. Write only with
    :meth:`queue`: the commands run inside the step's ``MULTI``/``EXEC``, together
    with its ledger entry, and are dropped when the step is rejected. Never call
    ``multi``/``execute`` on :attr:`client`, and queue writes only to keys you
    watched and read, so that ``EXEC`` cannot fail half-way on a wrong type.
    """

    def __init__(self, unit: _RedisUnit) -> None:
        self._unit = unit
        self._queue: list[Command] = []

    @property
    def client(self) -> Pipeline:
        return self._unit.pipe

    def key(self, target: str, key: Key) -> str:
        """The record key of ``target/key`` (``<prefix>:<target>:<key>``), checked."""
        storage = self._unit.storage
        if target not in storage.targets:
            allowed = ", ".join(sorted(storage.targets)) or "empty"
            raise BusinessRejection(
                f"target {target!r} is not in this participant's allow-list ({allowed})"
            )
        return f"{storage.prefix}:{target}:{key_text(key)}"

    def watch(self, *keys: str) -> None:
        """WATCH ``keys``: a change to them before this step's EXEC makes the step run again."""
        _watch(self._unit.pipe, keys)

    def read(self, target: str, key: Key) -> dict[str, str] | None:
        """The record ``target/key`` (``None``: absent), watched."""
        name = self.key(target, key)
        self.watch(name)
        try:
            record = _strings(self._unit.pipe.hgetall(name))
        except redis_errors.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            kind = _string(self._unit.pipe.type(name))
            raise BusinessRejection(
                f"{target}/{key} holds a Redis {kind}, not a hash record"
            ) from exc
        return record or None

    def queue(self, *command: str | int | float | bytes) -> None:
        """Queue one Redis command (e.g. ``"HSET", key, "field", "value"``) for this step."""
        if not command:
            raise ValueError("queue() needs a command")
        for part in command:
            if isinstance(part, bool) or not isinstance(part, str | bytes | int | float):
                raise TypeError(
                    f"queue() takes strings, bytes and numbers, not {type(part).__name__} "
                    f"({part!r}); convert the value first"
                )
        self._queue.append(command)

    def take_queue(self) -> list[Command]:
        queued, self._queue = self._queue, []
        return queued


def key_text(key: Any) -> str:
    """A step's key as the last part of a Redis key, or a business rejection."""
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise BusinessRejection(f"key {key!r} must be a string or an integer")
    text = str(key)
    if not text or len(text) > MAX_KEY_LENGTH:
        raise BusinessRejection(f"key {key!r} must be 1-{MAX_KEY_LENGTH} characters long")
    if _UNSAFE.search(text):
        raise BusinessRejection(
            f"key {key!r} may not contain whitespace, control characters or the glob "
            "characters * ? [ ] \\ in Redis"
        )
    return text


def _watch(pipe: Pipeline, keys: Iterable[str]) -> None:
    cast(Any, pipe).watch(*keys)  # redis-py leaves Pipeline.watch unannotated


def _string(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _strings(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """A hash as text (the client decodes responses; this only satisfies the types)."""
    return {_string(k): _string(v) for k, v in raw.items()}


def _session(native: Any) -> RedisSession:
    if not isinstance(native, RedisSession):
        raise TypeError(f"Redis actions need a RedisSession as native, not {type(native).__name__}")
    return native


# ---------------------------------------------------------------- built-in actions


class RedisActions(BuiltinActions):
    """The built-in actions on hash records (``native`` must be a :class:`RedisSession`).

    Before-images: ``put`` and ``delete`` keep the whole old hash (``put`` of a new
    key: ``None``), ``update`` the old text of each field it sets (``None``: the
    field was absent), ``increment`` the old text of its field. Compensations
    restore exactly that: ``put`` rewrites the whole hash.
    """

    def record(self, native: Any, action: BuiltinAction) -> RecordOps:
        return _Record(_session(native), action.target, action.key)


class _Record:
    """One hash record, addressed by the step's target and key."""

    def __init__(self, session: RedisSession, target: str, key: Key) -> None:
        self.session = session
        self.target = target
        self.key = key
        self.name = session.key(target, key)
        self.where = f"{target}/{key}"

    def _read(self) -> dict[str, str] | None:
        return self.session.read(self.target, self.key)

    def _existing(self) -> dict[str, str]:
        record = self._read()
        if record is None:
            raise BusinessRejection(f"{self.where} does not exist")
        return record

    def _write(self, current: Mapping[str, str], values: Mapping[str, str | None]) -> None:
        """Queue the change of ``values`` (``None``: remove the field) on ``current``."""
        after = {k: v for k, v in {**current, **values}.items() if v is not None}
        if not after:
            raise BusinessRejection(
                f"{self.where} would have no fields left; a Redis record needs at least one "
                "field that is not null"
            )
        kept = [
            item for name, value in values.items() if value is not None for item in (name, value)
        ]
        removed = [name for name, value in values.items() if value is None and name in current]
        if kept:
            self.session.queue("HSET", self.name, *kept)
        if removed:
            self.session.queue("HDEL", self.name, *removed)

    def _replace(self, image: Mapping[str, str]) -> None:
        self.session.queue("DEL", self.name)
        self.session.queue("HSET", self.name, *[item for pair in image.items() for item in pair])

    # -- actions

    def insert(self, fields: Mapping[str, Any]) -> None:
        values = _texts(fields)
        if self._read() is not None:
            raise BusinessRejection(f"{self.where} already exists")
        self._write({}, values)

    def put(self, fields: Mapping[str, Any]) -> dict[str, str] | None:
        values = _texts(fields)
        current = self._read()
        self._write(current or {}, values)
        return current

    def update(self, fields: Mapping[str, Any]) -> dict[str, str | None]:
        values = _texts(fields)
        current = self._existing()
        self._write(current, values)
        return {name: current.get(name) for name in values}

    def delete(self) -> dict[str, str]:
        current = self._existing()
        self.session.queue("DEL", self.name)
        return current

    def increment(self, action: Increment) -> dict[str, str]:
        current = self._existing()
        old = self._number(current, action.field)
        result = _add(old, action.by)
        value = _decimal(result)
        if action.min is not None and value < _decimal_of(action.min):
            raise BusinessRejection(
                f"{self.where} {action.field} would be {result}, below the minimum "
                f"{_show_number(action.min)}"
            )
        if action.max is not None and value > _decimal_of(action.max):
            raise BusinessRejection(
                f"{self.where} {action.field} would be {result}, above the maximum "
                f"{_show_number(action.max)}"
            )
        self.session.queue("HSET", self.name, action.field, result)
        return {action.field: old}

    # -- compensations

    def remove(self) -> None:
        # Already gone is fine: the compensation wants the key absent.
        self.session.queue("DEL", self.name)

    def restore_put(self, before: Any) -> None:
        if before is None:
            self.remove()
            return
        self._replace(_image(before, f"the before-image of {self.where} is missing"))

    def restore_fields(self, before: Any) -> None:
        if not isinstance(before, Mapping):
            raise BusinessRejection(
                f"the before-image of {self.where} is missing; the update cannot be undone"
            )
        current = self._read()
        if current is None:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its update cannot be undone"
            )
        values = {str(k): None if v is None else str(v) for k, v in before.items()}
        self._write(current, values)

    def reinsert(self, before: Any) -> None:
        image = _image(before, f"the before-image of {self.where} is missing")
        if self._read() is not None:
            raise BusinessRejection(
                f"{self.where} exists again, so the deleted record cannot be restored"
            )
        self._replace(image)

    def increment_back(self, action: Increment, before: Any) -> None:
        current = self._read()
        if current is None:
            raise BusinessRejection(
                f"{self.where} no longer exists, so its increment of {action.field} "
                "cannot be undone"
            )
        now = self._number(current, action.field)
        result = _add(now, -action.by)
        old = before.get(action.field) if isinstance(before, Mapping) else None
        if (
            isinstance(old, str)
            and _NUMBER_TEXT.fullmatch(old)
            and _decimal(old) == _decimal(result)
        ):
            result = old  # the old spelling exactly ("10.50", "100" rather than "100.0")
        self.session.queue("HSET", self.name, action.field, result)

    def _number(self, record: Mapping[str, str], name: str) -> str:
        text = record.get(name)
        if text is None:
            raise BusinessRejection(f"{self.where} has no value in {name}")
        if not _NUMBER_TEXT.fullmatch(text):
            raise BusinessRejection(f"{self.where} {name} is not a number ({text[:40]!r})")
        return text


# ---------------------------------------------------------------- values


def value_text(value: Any) -> str | None:
    """A JSON scalar as hash-field text; ``None`` for null (the field is removed)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _texts(fields: Mapping[str, Any]) -> dict[str, str | None]:
    return {name: value_text(value) for name, value in fields.items()}


def _decimal(text: str) -> Decimal:
    return Decimal(text)


def _decimal_of(number: int | float) -> Decimal:
    return Decimal(repr(number)) if isinstance(number, float) else Decimal(number)


def _add(text: str, by: int | float) -> str:
    """``text + by`` as text: integers stay integers, otherwise exact decimal arithmetic."""
    if _INTEGER_TEXT.fullmatch(text) and isinstance(by, int):
        return str(int(text) + by)
    try:
        total = Decimal(text) + _decimal_of(by)
    except InvalidOperation as exc:  # pragma: no cover - the pattern admits only numbers
        raise BusinessRejection(f"{text!r} is not a number") from exc
    return format(total, "f")


def _show_number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def _image(image: Any, missing: str) -> dict[str, str]:
    if not isinstance(image, Mapping) or not image:
        raise BusinessRejection(missing)
    return {str(k): str(v) for k, v in image.items()}


# ---------------------------------------------------------------- ledger entries


def _entry_text(entry: LedgerEntry) -> str:
    return json.dumps(
        {
            "tx_id": entry.tx_id,
            "step": entry.step,
            "status": str(entry.status),
            "action": entry.action,
            "args": _plain(entry.args),
            "mode": str(entry.mode),
            "n_steps": entry.n_steps,
            "deadline_ms": entry.deadline_ms,
            "effect": entry.effect,
            "before": _plain(entry.before),
            "reason": entry.reason,
            "rollback_pending": entry.rollback_pending,
            "successor_compensated": entry.successor_compensated,
            "updated_ms": entry.updated_ms,
            "fingerprint": entry.fingerprint,
        },
        separators=(",", ":"),
    )


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _entry_of(text: str) -> LedgerEntry:
    row = json.loads(text)
    return LedgerEntry(
        tx_id=row["tx_id"],
        step=row["step"],
        status=LedgerStatus(row["status"]),
        action=row["action"],
        args=row["args"],
        mode=Mode(row["mode"]),
        n_steps=row["n_steps"],
        deadline_ms=row["deadline_ms"],
        effect=row["effect"],
        before=row["before"],
        reason=row["reason"],
        rollback_pending=row["rollback_pending"],
        successor_compensated=row["successor_compensated"],
        updated_ms=row["updated_ms"],
        fingerprint=row.get("fingerprint"),
    )


def _seen_marker(item: RequestSeen) -> LedgerEntry:
    return LedgerEntry(
        tx_id=item.tx_id,
        step=SEEN_STEP,
        status=LedgerStatus.SEEN,
        deadline_ms=item.deadline_ms,
        updated_ms=item.now_ms,
        fingerprint=item.fingerprint,
    )


def _tx_finished_ms(fields: Mapping[str, str]) -> int | None:
    """When every entry and marker of a transaction's hash finished (``None``: not yet)."""
    latest: int | None = None
    for text in fields.values():
        finished = finished_ms(_entry_of(text))
        if finished is None:
            return None
        latest = finished if latest is None else max(latest, finished)
    return latest


def _known_fingerprint(fields: Mapping[str, str]) -> str | None:
    steps = _steps(fields)
    if steps:
        return next((e.fingerprint for e in steps if e.fingerprint), None)
    seen = fields.get(SEEN_FIELD)
    return None if seen is None else _entry_of(seen).fingerprint


def _may_wait(entry: LedgerEntry) -> bool:
    """Whether a step of a sequential saga may still need a neighbour's event."""
    if entry.mode is not Mode.SEQUENTIAL:
        return False
    if entry.status is LedgerStatus.WAITING:
        return True
    # Applied or failed and not decided: its rollback may wait for its successor's
    # compensation, and the predecessor's event, read again after a crash, reports it again.
    return entry.status in (LedgerStatus.APPLIED, LedgerStatus.FAILED)


def _steps(fields: Mapping[str, str]) -> list[LedgerEntry]:
    found = [_entry_of(text) for name, text in fields.items() if name.isdigit()]
    return sorted(found, key=lambda entry: entry.step)


# ---------------------------------------------------------------- the unit


class _RedisUnit(Unit):
    """One work item's rounds of WATCH ... MULTI ... EXEC (see the module doc).

    ``_ledgers`` is this unit's view of each transaction's ledger hash: what it
    read, plus what it wrote. A round that reads a ledger again after an EXEC
    compares it with this view, so a change made by someone else between two
    rounds makes the item run again, like a change during a round does.
    """

    def __init__(self, storage: RedisStorage) -> None:
        self.storage = storage
        self.pipe: Pipeline = storage.client.pipeline(transaction=True)
        self.native = RedisSession(self)
        self._ledgers: dict[str, dict[str, str]] = {}
        self._watched: set[str] = set()

    def close(self) -> None:
        self.pipe.reset()

    def _ledger(self, tx_id: str) -> dict[str, str]:
        if not isinstance(tx_id, str) or not _TX_ID.fullmatch(tx_id):
            raise InvalidRecord(f"transaction id {tx_id!r} breaks the wire contract")
        if tx_id not in self._watched:
            name = self.storage.ledger_key(tx_id)
            _watch(self.pipe, (name,))
            fresh = _strings(self.pipe.hgetall(name))
            if tx_id in self._ledgers and fresh != self._ledgers[tx_id]:
                raise redis_errors.WatchError(f"the ledger of {tx_id} changed between two steps")
            self._ledgers[tx_id] = fresh
            self._watched.add(tx_id)
        return self._ledgers[tx_id]

    def entry(self, tx_id: str, step: int) -> LedgerEntry | None:
        text = self._ledger(tx_id).get(str(step))
        return None if text is None else _entry_of(text)

    def entries(self, tx_id: str) -> list[LedgerEntry]:
        return _steps(self._ledger(tx_id))

    def tx_rolled_back(self, tx_id: str) -> bool:
        return MARKER_FIELD in self._ledger(tx_id)

    def mark_tx_rolled_back(self, tx_id: str, now_ms: int) -> None:
        marker = LedgerEntry(
            tx_id=tx_id,
            step=MARKER_STEP,
            status=LedgerStatus.COMPENSATED,
            reason="rolled back before this participant saw the request",
            updated_ms=now_ms,
        )
        self.write(marker)

    def known_fingerprint(self, tx_id: str) -> str | None:
        return _known_fingerprint(self._ledger(tx_id))

    def mark_tx_seen(self, item: RequestSeen) -> None:
        self.write(_seen_marker(item))

    def write(self, entry: LedgerEntry) -> None:
        fields = self._ledger(entry.tx_id)
        name = self.storage.ledger_key(entry.tx_id)
        field = {MARKER_STEP: MARKER_FIELD, SEEN_STEP: SEEN_FIELD}.get(entry.step, str(entry.step))
        text = _entry_text(entry)
        after = {**fields, field: text}
        self.pipe.multi()
        for command in self.native.take_queue():
            cast(Any, self.pipe).execute_command(*command)
        self.pipe.hset(name, field, text)
        if any(_may_wait(step) for step in _steps(after)):
            self.pipe.sadd(self.storage.in_flight_key, entry.tx_id)
        else:
            self.pipe.srem(self.storage.in_flight_key, entry.tx_id)
        finished = _tx_finished_ms(after)
        if finished is None:
            self.pipe.zrem(self.storage.finished_key, entry.tx_id)
        else:
            self.pipe.zadd(self.storage.finished_key, {entry.tx_id: finished})
        self.pipe.execute()  # raises WatchError when a watched key changed: run again
        self._ledgers[entry.tx_id] = after
        self._watched.clear()

    def rollback_effect(self) -> None:
        self.native.take_queue()


# ---------------------------------------------------------------- the storage


class RedisStorage(Storage):
    """A participant's Redis: hash records under ``<prefix>:<target>:`` and its ledger.

    ``url`` is a ``redis://`` (or ``rediss://``, ``unix://``) URL; ``targets`` are
    the key prefixes steps may touch (the allow-list). ``handlers`` as for
    :class:`~participants._sql.SqlStorage`; handlers receive a :class:`RedisSession`
    as ``native``. ``max_attempts`` bounds how often one item is run again after
    losing a WATCH race. :meth:`execute` acts on every item in order, repeats
    included.
    """

    def __init__(
        self,
        name: str,
        url: str,
        targets: Iterable[str],
        *,
        prefix: str = DEFAULT_PREFIX,
        handlers: Actions | Mapping[str, Handler] | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        timeout_s: float = 10.0,
    ) -> None:
        if not isinstance(name, str) or not PARTICIPANT_NAME.fullmatch(name):
            raise ConfigurationError(
                f"participant name {name!r} must be 1-64 letters, digits, '.', '_' or '-'"
            )
        self.name = name
        self.targets = frozenset(targets)
        for target in sorted(self.targets):
            if not isinstance(target, str) or not IDENTIFIER.fullmatch(target):
                raise ConfigurationError(
                    f"target name {target!r} is not a plain name (1-63 letters, digits or _, "
                    "not starting with a digit)"
                )
            if target in RESERVED_TARGETS:
                raise ConfigurationError(
                    f"target name {target!r} is reserved: the ledger lives under {prefix}:{target}:"
                )
        if (
            not isinstance(prefix, str)
            or not 0 < len(prefix) <= 64
            or _UNSAFE.search(prefix)
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
        self.in_flight_key = f"{prefix}:ledger:{name}:in_flight"
        self.finished_key = f"{prefix}:ledger:{name}:finished"
        self._finished_ready = False
        builtin = RedisActions(self.targets)
        self.actions: Actions = combine(builtin, handlers)

    def ledger_key(self, tx_id: str) -> str:
        return f"{self.prefix}:ledger:{self.name}:tx:{tx_id}"

    def record_key(self, target: str, key: Key) -> str:
        """The key of record ``target/key`` (for tools and tests)."""
        return f"{self.prefix}:{target}:{key_text(key)}"

    # -- lifecycle

    def setup(self) -> None:
        """Check that Redis answers (there is nothing to create)."""
        with self._boundary("reach Redis"):
            self.client.ping()

    def close(self) -> None:
        self.client.close()

    # -- work

    def execute(self, items: Sequence[WorkItem]) -> list[Report]:
        """Run the batch item by item, each step's change atomic with its ledger entry.

        Raises :class:`TransientError` when Redis is unavailable or an item kept
        losing the WATCH race: the items before took effect, the rest did not, and
        retrying the batch is safe because the finished items re-report.
        """
        reports: list[Report] = []
        seen: list[RequestSeen] = []
        with self._boundary("run a batch"):
            for item in items:
                if isinstance(item, RequestSeen):
                    seen.append(item)
                    continue
                self._mark_seen(seen)  # before any item that may read those ledgers
                seen = []
                reports.extend(self._run(item))
            self._mark_seen(seen)
        return reports

    def _mark_seen(self, items: Sequence[RequestSeen]) -> None:
        """Record the seen markers of a run of requests without a step here, in one pipeline.

        ``HSETNX``: a transaction that has a seen marker keeps it; one with step entries
        keeps its fingerprint (theirs comes first, see the module doc).
        """
        if not items:
            return
        pipe = self.client.pipeline(transaction=False)
        for item in items:
            marker = _seen_marker(item)
            if not _TX_ID.fullmatch(item.tx_id):
                raise InvalidRecord(f"transaction id {item.tx_id!r} breaks the wire contract")
            pipe.hsetnx(self.ledger_key(item.tx_id), SEEN_FIELD, _entry_text(marker))
            pipe.zadd(self.finished_key, {item.tx_id: finished_ms(marker) or 0}, nx=True)
        pipe.execute()

    def _run(self, item: WorkItem) -> list[Report]:
        for _ in range(self.max_attempts):
            unit = _RedisUnit(self)
            try:
                return run_item(unit, self.actions, item)
            except redis_errors.WatchError:
                continue  # someone changed what this step read: run it again
            except BusinessRejection as exc:
                # Only a custom confirm gets here (run_item turns the others into
                # events): the step stays applied and a replayed decision retries it.
                log.error(
                    "participant %r: confirming %s was rejected and is left for a replayed "
                    "decision: %s",
                    self.name,
                    item.tx_id,
                    exc.reason,
                )
                return []
            finally:
                unit.close()
        raise TransientError(
            f"participant {self.name!r}: {item.tx_id} kept conflicting with other writers on "
            f"{self.where} ({self.max_attempts} attempts); retrying the batch is safe"
        )

    # -- reading the ledger

    def ledger(self, tx_id: str | None = None) -> list[LedgerEntry]:
        with self._boundary("read its ledger"):
            if tx_id is not None:
                names = [self.ledger_key(tx_id)]
            else:
                names = list(self.client.scan_iter(match=self.ledger_key("*"), count=500))
            found: list[LedgerEntry] = []
            for name in names:
                found.extend(_steps(_strings(self.client.hgetall(name))))
        return sorted(found, key=lambda entry: (entry.tx_id, entry.step))

    def in_flight_sequential(self) -> set[str]:
        with self._boundary("read its ledger"):
            members = self.client.smembers(self.in_flight_key)
        return {_string(member) for member in members}

    # -- pruning

    def prune(self, horizon_ms: int, limit: int) -> int:
        """Remove the hashes of up to ``limit`` transactions finished at or before
        ``horizon_ms`` (candidates from the sorted set, checked under WATCH); return how
        many entries went."""
        removed = 0
        with self._boundary("prune its ledger"):
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
                _watch(pipe, (name,))
                fields = _strings(pipe.hgetall(name))
                finished = _tx_finished_ms(fields) if fields else horizon_ms
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
        ready = f"{self.finished_key}_ready"
        if not self.client.exists(ready):
            head = self.ledger_key("")
            names: list[str] = []
            for key in self.client.scan_iter(match=self.ledger_key("*"), count=1000):
                names.append(_string(key)[len(head) :])
                if len(names) >= 1000:
                    self.client.zadd(self.finished_key, dict.fromkeys(names, 0), nx=True)
                    names = []
            if names:
                self.client.zadd(self.finished_key, dict.fromkeys(names, 0), nx=True)
            self.client.set(ready, "1")
        self._finished_ready = True

    # -- errors

    @contextmanager
    def _boundary(self, what: str) -> Iterator[None]:
        """Translate redis-py's errors into the saga error tree (see the module doc)."""
        try:
            yield
        except redis_errors.RedisError as exc:
            self._translate(exc, what)

    def _translate(self, exc: redis_errors.RedisError, what: str) -> NoReturn:
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
        if isinstance(
            exc,
            redis_errors.ConnectionError
            | redis_errors.TimeoutError
            | redis_errors.BusyLoadingError
            | redis_errors.ReadOnlyError,
        ):
            raise TransientError(
                f"{prefix}: {self.where} is unavailable ({detail}); retrying is safe"
            ) from exc
        if isinstance(exc, redis_errors.ResponseError) and not detail.startswith("OOM"):
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


__all__ = ["RedisActions", "RedisSession", "RedisStorage", "key_text", "value_text"]
