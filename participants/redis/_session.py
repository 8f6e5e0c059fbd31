"""The Redis adapter's native session, and how a record's key is spelt.

See :mod:`participants._redis` for the key layout and the WATCH/MULTI/EXEC rounds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, cast

from redis import exceptions as redis_errors
from redis.client import Pipeline

from saga.participants._actions import MAX_KEY_LENGTH, Key
from saga.streams import BusinessRejection

UNSAFE: Final = re.compile(r"[\s*?\[\]\\\x00-\x1f\x7f-\x9f]")
"""Characters a key part may not hold: whitespace, control and glob characters."""

Command = tuple[str | int | float | bytes, ...]


SIDE_PART: Final = "+isolation"
"""The part of a side hash's key after ``<prefix>:ledger:``: ``+`` is not allowed in a
participant name, so no participant's ledger keys (``<prefix>:ledger:<participant>:...``)
can be one."""


def record_key(prefix: str, target: str, key: Key) -> str:
    """The key of record ``target/key``: ``<prefix>:<target>:<key>`` (the key checked)."""
    return f"{prefix}:{target}:{key_text(key)}"


def side_key(prefix: str, target: str, key: Key) -> str:
    """The side hash of record ``target/key``: its holds, reservations and recorded bounds
    (:mod:`participants.redis._isolation`), ``<prefix>:ledger:+isolation:<target>:<key>``."""
    return f"{prefix}:ledger:{SIDE_PART}:{target}:{key_text(key)}"


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

    def __init__(self, pipe: Pipeline, prefix: str, targets: frozenset[str]) -> None:
        self._pipe = pipe
        self._prefix = prefix
        self._targets = targets
        self._queue: list[Command] = []

    @property
    def client(self) -> Pipeline:
        return self._pipe

    def key(self, target: str, key: Key) -> str:
        """The record key of ``target/key`` (``<prefix>:<target>:<key>``), checked."""
        if target not in self._targets:
            allowed = ", ".join(sorted(self._targets)) or "empty"
            raise BusinessRejection(
                f"target {target!r} is not in this participant's allow-list ({allowed})"
            )
        return record_key(self._prefix, target, key)

    def side_key(self, target: str, key: Key) -> str:
        """The side hash of ``target/key`` (see :func:`side_key`), checked."""
        self.key(target, key)
        return side_key(self._prefix, target, key)

    def watch(self, *keys: str) -> None:
        """WATCH ``keys``: a change to them before this step's EXEC makes the step run again."""
        watch(self._pipe, keys)

    def read(self, target: str, key: Key) -> dict[str, str] | None:
        """The record ``target/key`` (``None``: absent), watched (one round trip)."""
        name = self.key(target, key)
        try:
            record = watch_hgetall(self._pipe, name)
        except redis_errors.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            kind = string(self._pipe.type(name))
            raise BusinessRejection(
                f"{target}/{key} holds a Redis {kind}, not a hash record"
            ) from exc
        return record or None

    def read_with_side(self, target: str, key: Key) -> tuple[dict[str, str] | None, dict[str, str]]:
        """The record ``target/key`` (``None``: absent) and its side hash, both watched, in
        one round trip. A side hash of another type raises redis-py's ``ResponseError``."""
        name = self.key(target, key)
        side = side_key(self._prefix, target, key)
        record, rest = watch_hgetalls(self._pipe, (name, side))
        if isinstance(record, redis_errors.ResponseError):
            if "WRONGTYPE" not in str(record):
                raise record
            kind = string(self._pipe.type(name))
            raise BusinessRejection(
                f"{target}/{key} holds a Redis {kind}, not a hash record"
            ) from record
        if isinstance(rest, redis_errors.ResponseError):
            raise rest
        return record or None, rest

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
    if UNSAFE.search(text):
        raise BusinessRejection(
            f"key {key!r} may not contain whitespace, control characters or the glob "
            "characters * ? [ ] \\ in Redis"
        )
    return text


def watch(pipe: Pipeline, keys: Iterable[str]) -> None:
    cast(Any, pipe).watch(*keys)  # redis-py leaves Pipeline.watch unannotated


def watch_hgetall(pipe: Pipeline, name: str) -> dict[str, str]:
    """``WATCH name`` then ``HGETALL name``, sent together: one round trip, not two.

    The same as ``pipe.watch(name)`` followed by ``pipe.hgetall(name)``: the pipeline
    is left watching on its connection (its ``EXEC`` or ``reset`` ends the watch), and
    ``WATCH`` is processed before ``HGETALL`` reads, so the value read is the one the
    watch guards. A hash of the wrong type raises redis-py's ``ResponseError``
    (``WRONGTYPE``) with the connection in step; any other failure between the two
    replies drops the connection (dropping it also ends the watch), so no reply is
    left unread for the next command. The replies are parsed by hand: a ``HGETALL``
    reply is a flat list of field, value (RESP2) or a map (RESP3).
    """
    p = cast(Any, pipe)  # redis-py leaves the pipeline's connection state unannotated
    if p.explicit_transaction:
        raise redis_errors.RedisError("Cannot issue a WATCH after a MULTI")
    conn = p.connection
    if conn is None:
        conn = p.connection = p.connection_pool.get_connection()
    p.watching = True
    try:
        conn.send_packed_command(conn.pack_commands([("WATCH", name), ("HGETALL", name)]))
        conn.read_response()
    except BaseException:
        conn.disconnect()
        raise
    raw = conn.read_response()  # WRONGTYPE raises here, with both replies read
    if isinstance(raw, list):
        return {string(k): string(v) for k, v in zip(raw[::2], raw[1::2], strict=True)}
    return strings(raw)


def watch_hgetalls(
    pipe: Pipeline, names: Sequence[str]
) -> list[dict[str, str] | redis_errors.ResponseError]:
    """``WATCH`` every name, then ``HGETALL`` of each, sent together: one round trip.

    As :func:`watch_hgetall`, for several keys; a key's ``ResponseError`` (``WRONGTYPE``)
    is returned in its place, with every reply read, so the caller says what it means.
    """
    p = cast(Any, pipe)  # redis-py leaves the pipeline's connection state unannotated
    if p.explicit_transaction:
        raise redis_errors.RedisError("Cannot issue a WATCH after a MULTI")
    conn = p.connection
    if conn is None:
        conn = p.connection = p.connection_pool.get_connection()
    p.watching = True
    out: list[dict[str, str] | redis_errors.ResponseError] = []
    try:
        commands = [("WATCH", *names), *(("HGETALL", name) for name in names)]
        conn.send_packed_command(conn.pack_commands(commands))
        conn.read_response()
        for _ in names:
            try:
                raw = conn.read_response()
            except redis_errors.ResponseError as exc:
                out.append(exc)
                continue
            out.append(_hash_reply(raw))
    except BaseException:
        conn.disconnect()
        raise
    return out


def _hash_reply(raw: Any) -> dict[str, str]:
    if isinstance(raw, list):
        return {string(k): string(v) for k, v in zip(raw[::2], raw[1::2], strict=True)}
    return strings(raw)


def string(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def strings(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """A hash as text (the client decodes responses; this only satisfies the types)."""
    return {string(k): string(v) for k, v in raw.items()}
