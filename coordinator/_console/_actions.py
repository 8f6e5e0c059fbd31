"""What the console does besides showing its view: operator actions and the other sources.

:class:`Operations` sends an abort through the client library (the same path as
``saga abort``; with an operator key it signs as ``operator``), records every action
with who asked for it in the audit trail, and reaches the admin module
(:mod:`coordinator._admin`: a saga's history, resolve, DLQ redrive) and the
participant registry when they are installed. Each of those is imported in one small
function below, so an install without them still serves the rest of the console.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import asdict, is_dataclass
from typing import Any

from coordinator._console._store import ViewStore
from streams import MAX_REASON_CHARS, TX_ID_PATTERN, SagaError, SagaState
from streams._lifecycle import wall_clock_ms
from streams._secrets import redact
from streams._signing import Keyring
from streams.kafka import KafkaSettings
from streams.log import Log

log = logging.getLogger("saga.console")

OPERATOR_PATTERN = r"^[A-Za-z0-9._@+-]{1,64}$"
"""What an operator's name may be (it lands in records and in the audit trail)."""

MAX_NOTE_CHARS = 500
"""The longest reason or note an operator may type (the decision quotes it)."""


class ActionRefused(Exception):
    """An action the console will not send; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _admin(name: str) -> Callable[..., Any] | None:
    """``coordinator._admin.<name>`` when the admin module is installed and has it."""
    try:
        module = importlib.import_module("coordinator._admin")
    except ImportError:
        return None
    found = getattr(module, name, None)
    return found if callable(found) else None


def _plain(value: Any) -> Any:
    """``value`` made JSON-ready: dataclasses as dicts, bytes as text, enums as values."""
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def registry_participants(settings: KafkaSettings, keys: Keyring | None) -> list[Any] | None:
    """The participants that announced themselves, or None without a registry module.

    The one place that knows the registry's API (``coordinator._registry``): wire a
    new registry here.
    """
    try:
        module = importlib.import_module("coordinator._registry")
    except ImportError:
        return None
    read = getattr(module, "participants", None) or getattr(module, "read_registry", None)
    if not callable(read):
        return None
    found = read(settings, keys=keys) if keys is not None else read(settings)
    return list(_plain(found.values() if isinstance(found, dict) else found))


class Operations:
    """The console's actions; thread-safe. ``signing_keys`` signs (an operator key).

    ``log`` makes the abort's client (default: a Kafka client of ``settings``).
    """

    def __init__(
        self,
        settings: KafkaSettings,
        store: ViewStore,
        *,
        verify_keys: Keyring | None,
        signing_keys: Keyring | None,
        actions_disabled: str | None = None,
        log: Log | None = None,
    ) -> None:
        self._settings = settings
        self._log = log
        self._store = store
        self._verify_keys = verify_keys
        self._signing_keys = signing_keys
        self.actions_disabled = actions_disabled
        """Why actions are off (e.g. no operator key), or None."""
        self._client: Any = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ reading

    def history(self, tx_id: str, timeout: float) -> list[Any] | None:
        """Every record of ``tx_id`` from every topic, or None without the admin module."""
        history = _admin("history")
        if history is None:
            return None
        return list(_plain(history(self._settings, tx_id, timeout=timeout)))

    def participants(self) -> list[Any] | None:
        return registry_participants(self._settings, self._verify_keys)

    def capabilities(self) -> dict[str, bool]:
        """Which actions this install can do (the UI shows only those)."""
        on = self.actions_disabled is None
        return {
            "abort": on,
            "resolve": on and _admin("resolve") is not None,
            "redrive": on and _admin("redrive") is not None,
            "history": _admin("history") is not None,
        }

    # ------------------------------------------------------------------ acting

    def _check_allowed(self) -> None:
        if self.actions_disabled is not None:
            raise ActionRefused(self.actions_disabled, 403)

    def abort(self, tx_id: str, reason: str, operator: str) -> dict[str, Any]:
        """Send an abort of ``tx_id``; recorded in the audit trail with ``operator``.

        Refused (:class:`ActionRefused`) for a transaction the view shows decided: the
        coordinator would ignore it. The coordinator's decision quotes the reason,
        which names the operator, so the log itself says who aborted.
        """
        self._check_allowed()
        _check_tx_id(tx_id)
        note = _check_note(reason, "reason")
        row = self._store.saga(tx_id)
        if row is not None and row["state"] != SagaState.PENDING.value:
            self._audit(operator, "abort", tx_id, note, f"refused: already {row['state']}")
            raise ActionRefused(
                f"transaction {tx_id} is already {row['state']}: only a pending saga can be "
                "aborted",
                409,
            )
        sent_reason = (
            f"{note} (by {operator} via saga console)"
            if note
            else (f"by {operator} via saga console")
        )
        try:
            self._abort_client().abort(tx_id, sent_reason)
        except SagaError as exc:
            self._audit(operator, "abort", tx_id, note, f"failed: {exc}")
            raise ActionRefused(f"the abort could not be sent: {redact(str(exc))}", 502) from None
        self._audit(operator, "abort", tx_id, note, "sent")
        return {"tx_id": tx_id, "sent": True, "reason": sent_reason}

    def resolve(self, tx_id: str, step: int, note: str, operator: str) -> dict[str, Any]:
        """Record that a failed compensation was handled by hand (the admin module's resolve)."""
        self._check_allowed()
        _check_tx_id(tx_id)
        text = _check_note(note, "note")
        resolve = _admin("resolve")
        if resolve is None:
            raise ActionRefused("this install has no resolve (coordinator._admin is missing)", 501)
        try:
            done = resolve(
                self._settings,
                tx_id,
                step=step,
                note=text,
                operator=operator,
                keys=self._signing_keys,
            )
        except SagaError as exc:
            self._audit(operator, "resolve", tx_id, f"step {step}: {text}", f"failed: {exc}")
            raise ActionRefused(redact(str(exc)), 502) from None
        self._audit(operator, "resolve", tx_id, f"step {step}: {text}", "sent")
        return {"tx_id": tx_id, "result": _plain(done)}

    def redrive(self, partition: int, offset: int, operator: str) -> dict[str, Any]:
        """Send a dead letter back to its source topic (the admin module's redrive)."""
        self._check_allowed()
        redrive = _admin("redrive")
        if redrive is None:
            raise ActionRefused("this install has no redrive (coordinator._admin is missing)", 501)
        where = f"dlq {partition}@{offset}"
        try:
            done = redrive(
                self._settings,
                partition=partition,
                offset=offset,
                operator=operator,
                keys=self._signing_keys,
            )
        except SagaError as exc:
            self._audit(operator, "redrive", None, where, f"failed: {exc}")
            raise ActionRefused(redact(str(exc)), 502) from None
        self._audit(operator, "redrive", None, where, "sent")
        return {"result": _plain(done)}

    def _abort_client(self) -> Any:
        # One client for the console's life: it costs a producer and a status reader.
        with self._lock:
            if self._client is None:
                from coordinator._client import SagaClient

                self._client = SagaClient(
                    self._settings,
                    status_from_beginning=False,
                    keys=self._signing_keys,
                    log=self._log,
                )
            return self._client

    def _audit(
        self, operator: str, action: str, tx_id: str | None, detail: str, outcome: str
    ) -> None:
        self._store.record_action(
            wall_clock_ms(), operator, action, tx_id, detail, redact(outcome)[:500]
        )
        log.warning("operator %s: %s %s (%s): %s", operator, action, tx_id or "", detail, outcome)

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _check_tx_id(tx_id: str) -> None:
    if not re.fullmatch(TX_ID_PATTERN, tx_id):
        raise ActionRefused(f"{tx_id[:140]!r} is not a transaction id (pattern {TX_ID_PATTERN})")


def _check_note(text: Any, what: str) -> str:
    if not isinstance(text, str):
        raise ActionRefused(f"the {what} must be text")
    stripped: str = text.strip()
    if len(stripped) > min(MAX_NOTE_CHARS, MAX_REASON_CHARS):
        raise ActionRefused(f"the {what} is too long: at most {MAX_NOTE_CHARS} characters")
    return stripped
