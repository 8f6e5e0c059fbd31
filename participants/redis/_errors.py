"""How the Redis adapter reads redis-py's errors (see :mod:`participants._refusals`).

Transient: Redis unreachable, a lost or timed-out connection, Redis loading its data, a
read-only replica, out of memory, a script running too long (``BUSY``), a cluster
that is resharding or down. Configuration: the credentials, or a command the user
may not run. Refused: what Redis answers about one command itself (``WRONGTYPE`` on
a key holding another type, a wrong command or argument count, a value that is not a
number, a script's error), and a value redis-py cannot send. Redis has no statement
timeout: nothing here is a timeout.
"""

from __future__ import annotations

from typing import Final

from redis import exceptions as redis_errors

from saga.participants._refusals import StoreRefused, Verdict, refusal
from saga.streams._secrets import redact

_TRANSIENT_REPLIES: Final = (
    "OOM",
    "BUSY ",
    "LOADING",
    "MASTERDOWN",
    "READONLY",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "NOREPLICAS",
    "MOVED",
    "ASK",
)
_TRANSIENT_TYPES: Final = (
    redis_errors.ConnectionError,  # BusyLoadingError derives from it
    redis_errors.TimeoutError,
    redis_errors.ReadOnlyError,
    redis_errors.ClusterDownError,
    redis_errors.TryAgainError,
    redis_errors.MasterDownError,
    redis_errors.OutOfMemoryError,
    redis_errors.WatchError,  # a lost race: the item runs again
)
_CONFIGURATION_TYPES: Final = (
    redis_errors.AuthenticationError,
    redis_errors.AuthenticationWrongNumberOfArgsError,
    redis_errors.AuthorizationError,
    redis_errors.NoPermissionError,
)


def verdict(exc: BaseException) -> Verdict:
    """What redis-py's error ``exc`` means for the work (see the module doc)."""
    if isinstance(exc, _CONFIGURATION_TYPES):
        return Verdict.CONFIGURATION
    if isinstance(exc, _TRANSIENT_TYPES):
        return Verdict.TRANSIENT
    if isinstance(exc, redis_errors.ResponseError):
        if str(exc).startswith(_TRANSIENT_REPLIES):
            return Verdict.TRANSIENT
        return Verdict.REFUSED
    if isinstance(exc, redis_errors.DataError):
        return Verdict.REFUSED
    return Verdict.TRANSIENT


def detail(exc: BaseException) -> str:
    """The first line of redis-py's message, passwords hidden."""
    text = redact(str(exc)).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 240 else line[:237] + "..."


def step_refusal(exc: BaseException, what: str) -> StoreRefused | None:
    """The step's refusal for an error met doing ``what``, or ``None`` (not the step's)."""
    if not isinstance(exc, redis_errors.RedisError) or verdict(exc) is not Verdict.REFUSED:
        return None
    # Redis's reply starts with its code (WRONGTYPE, ERR, ...): no code to add.
    return refusal("Redis", what, detail(exc), None, Verdict.REFUSED)
