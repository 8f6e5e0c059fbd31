"""Errors of the MongoDB storage: which server errors are transient or configuration
errors, the message shown, and the unit's internal signals (see *Errors* in
:mod:`saga.participants.mongo`).

:func:`verdict` classifies an error for :mod:`participants._refusals`: a lost
connection, a primary stepping down or not writable, a write conflict and the
server's retryable labels are transient; an operation over its ``maxTimeMS`` is a
timeout; the credentials are configuration (as are, outside an action, a missing
privilege or an unsupported command); any other answer of the server about one
operation (a write error on one document: a validation failure, a duplicate key; a
document too large or not encodable) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from bson import errors as bson_errors
from pymongo import errors as mongo_errors

from saga.participants._refusals import StoreRefused, Verdict, refusal
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
_TIMEOUT_CODES: Final = frozenset({50, 262})  # MaxTimeMSExpired, ExceededTimeLimit


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
    text = str(exc)
    if isinstance(details, Mapping):
        errors = details.get("writeErrors") or [details]  # a bulk write's: its first
        first = errors[0] if isinstance(errors[0], Mapping) else {}
        text = str(first.get("errmsg") or text)
    text = redact(text)
    text = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return text if len(text) <= 240 else text[:237] + "..."


def verdict(exc: BaseException) -> Verdict:
    """What the driver's error ``exc`` means for the work (see the module doc)."""
    if isinstance(exc, bson_errors.InvalidDocument):
        return Verdict.REFUSED
    if not isinstance(exc, mongo_errors.PyMongoError):
        return Verdict.TRANSIENT
    code = getattr(exc, "code", None)
    if isinstance(exc, mongo_errors.ExecutionTimeout) or code in _TIMEOUT_CODES:
        return Verdict.TIMEOUT
    if _is_transient(exc):
        return Verdict.TRANSIENT
    if code in _CONFIGURATION_CODES or isinstance(exc, mongo_errors.ConfigurationError):
        return Verdict.CONFIGURATION
    if isinstance(exc, mongo_errors.OperationFailure | mongo_errors.DocumentTooLarge):
        return Verdict.REFUSED  # WriteError, DuplicateKeyError, BulkWriteError among them
    return Verdict.TRANSIENT


def step_refusal(exc: BaseException, what: str, store: str = "MongoDB") -> StoreRefused | None:
    """The step's refusal for a driver error met doing ``what`` (an action, built-in or a
    custom handler's), or ``None`` when it is not the step's. A missing privilege or an
    unsupported command is the step's here (its own operation); the credentials are not."""
    judged = verdict(exc)
    code = getattr(exc, "code", None)
    if judged is Verdict.CONFIGURATION and code != _AUTHENTICATION_FAILED:
        judged = Verdict.REFUSED
    if judged not in (Verdict.REFUSED, Verdict.TIMEOUT):
        return None
    return refusal(store, what, _detail(exc), None if code is None else str(code), judged)
