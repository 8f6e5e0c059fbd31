"""Errors of the MongoDB storage: which server errors are transient or configuration
errors, the message shown, and the unit's internal signals (see *Errors* in
:mod:`saga.participants.mongo`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from pymongo import errors as mongo_errors

from saga.streams import TransientError
from saga.streams._secrets import redact

_TRANSIENT_CODES: Final = frozenset(
    {
        50,  # MaxTimeMSExpired
        91,  # ShutdownInProgress
        112,  # WriteConflict
        189,  # PrimarySteppedDown
        244,  # TransactionAborted
        251,  # NoSuchTransaction
        262,  # ExceededTimeLimit
        10107,  # NotWritablePrimary
        11600,  # InterruptedAtShutdown
        11602,  # InterruptedDueToReplStateChange
        13435,  # NotPrimaryNoSecondaryOk
        13436,  # NotPrimaryOrSecondary
    }
)
_AUTHENTICATION_FAILED: Final = 18
_CONFIGURATION_CODES: Final = frozenset(
    {
        13,  # Unauthorized
        18,  # AuthenticationFailed
        20,  # IllegalOperation (e.g. transactions on a standalone server)
        115,  # CommandNotSupported
        238,  # NotImplemented (FerretDB)
    }
)
_DUPLICATE_KEY: Final = 11000


class _Conflict(TransientError):
    """Another worker changed the same ledger record or document at the same time."""


class _Refused(Exception):
    """The server refused a staged write for its content; the step must fail instead."""

    def __init__(self, target: str, key: Any, reason: str) -> None:
        super().__init__(reason)
        self.target = target
        self.key = key
        self.reason = reason


class _Speculation(Exception):
    """The transaction a request was run for as new is known to the ledger: run it again."""


class _Stale(Exception):
    """An optimistic write missed (the document is not as this process last knew it): run
    the step again, reading."""


def _is_transient(exc: mongo_errors.PyMongoError) -> bool:
    if isinstance(exc, mongo_errors.ConnectionFailure):
        return True
    if exc.has_error_label("TransientTransactionError") or exc.has_error_label(
        "RetryableWriteError"
    ):
        return True
    code = getattr(exc, "code", None)
    return code in _TRANSIENT_CODES


def _detail(exc: BaseException) -> str:
    """The first line of the server's or driver's message, passwords hidden."""
    details = getattr(exc, "details", None)
    text = str(details.get("errmsg")) if isinstance(details, Mapping) else str(exc)
    text = redact(text)
    text = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."
