"""The Redis adapter's native session, and how a record's key is spelt.

See :mod:`participants._redis` for the key layout and the WATCH/MULTI/EXEC rounds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Final, cast

from redis import exceptions as redis_errors
from redis.client import Pipeline

from participants._actions import MAX_KEY_LENGTH, Key
from streams import BusinessRejection

UNSAFE: Final = re.compile(r"[\s*?\[\]\\\x00-\x1f\x7f-\x9f]")
"""Characters a key part may not hold: whitespace, control and glob characters."""

Command = tuple[str | int | float | bytes, ...]


def record_key(prefix: str, target: str, key: Key) -> str:
    """The key of record ``target/key``: ``<prefix>:<target>:<key>`` (the key checked)."""
    return f"{prefix}:{target}:{key_text(key)}"


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

    def watch(self, *keys: str) -> None:
        """WATCH ``keys``: a change to them before this step's EXEC makes the step run again."""
        watch(self._pipe, keys)

    def read(self, target: str, key: Key) -> dict[str, str] | None:
        """The record ``target/key`` (``None``: absent), watched."""
        name = self.key(target, key)
        self.watch(name)
        try:
            record = strings(self._pipe.hgetall(name))
        except redis_errors.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            kind = string(self._pipe.type(name))
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
    if UNSAFE.search(text):
        raise BusinessRejection(
            f"key {key!r} may not contain whitespace, control characters or the glob "
            "characters * ? [ ] \\ in Redis"
        )
    return text


def watch(pipe: Pipeline, keys: Iterable[str]) -> None:
    cast(Any, pipe).watch(*keys)  # redis-py leaves Pipeline.watch unannotated


def string(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def strings(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """A hash as text (the client decodes responses; this only satisfies the types)."""
    return {string(k): string(v) for k, v in raw.items()}
