"""What the console does besides showing its view: operator actions and the other sources.

:class:`Operations` acts through the same functions as the ``saga`` admin commands:
:func:`coordinator._admin_actions.abort` and :func:`~coordinator._admin_actions.resolve`
(records on the requests topic naming who asked, signed with the operator key when
the console has one; each waits a few seconds for the coordinator's answer and says
whether the action was honoured) and :func:`coordinator._admin.redrive`; it reads a
saga's history with :func:`coordinator._admin.history`. Every action, refused ones
too, goes to the console's audit trail with the operator's name.

The participant registry belongs to another module: :func:`registry_participants`
is the one place that imports it, defensively, so an install without it still
serves the rest of the console.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import threading
import time
from dataclasses import asdict, is_dataclass
from typing import Any

from saga.coordinator._console._store import ViewStore
from saga.streams import MAX_REASON_CHARS, TX_ID_PATTERN, SagaError
from saga.streams._lifecycle import wall_clock_ms
from saga.streams._secrets import redact
from saga.streams._signing import Keyring
from saga.streams.kafka import KafkaSettings
from saga.streams.log import Log

log = logging.getLogger("saga.console")

OPERATOR_PATTERN = r"^[A-Za-z0-9._@+-]{1,64}$"
"""What an operator's name may be (it lands in records and in the audit trail)."""

MAX_NOTE_CHARS = 500
"""The longest reason or note an operator may type (the decision quotes it)."""

ACTION_WAIT_S = 10.0
"""How long an action waits for the coordinator's answer before saying it is not known yet."""

_REGISTRY_CACHE_S = 3.0


class ActionRefused(Exception):
    """An action the console will not send; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


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


def registry_participants(
    source: Log | KafkaSettings, keys: Keyring | None
) -> list[dict[str, Any]] | None:
    """The participants that announced themselves, or None without a registry module.

    The one place that knows the registry's API (``streams._registry.read_registry``,
    whose answers have ``participants()`` with ``to_json()``): wire a new registry here.
    A registry topic that cannot be read yet shows as an empty list.
    """
    try:
        module = importlib.import_module("saga.streams._registry")
    except ImportError:
        return None
    read = getattr(module, "read_registry", None)
    if not callable(read):
        return None
    try:
        registry = read(source, 5.0, keys=keys)
    except SagaError as exc:
        log.info("the participant registry cannot be read: %s", exc)
        return []
    return [dict(_plain(p.to_json())) for p in registry.participants()]


class Operations:
    """The console's actions and slower reads; thread-safe.

    ``source`` is the log the admin functions use (a :class:`~streams.kafka.KafkaSettings`
    makes a Kafka log per call). ``signing_keys`` signs actions (the operator key);
    ``verify_keys`` checks what is read. ``actions_disabled`` says why every action is
    refused (read-only, or no operator key).
    """

    def __init__(
        self,
        source: Log | KafkaSettings,
        store: ViewStore,
        *,
        verify_keys: Keyring | None,
        signing_keys: Keyring | None,
        actions_disabled: str | None = None,
        wait_s: float = ACTION_WAIT_S,
    ) -> None:
        self._source = source
        self._store = store
        self._verify_keys = verify_keys
        self._signing_keys = signing_keys
        self._wait_s = wait_s
        self.actions_disabled = actions_disabled
        """Why actions are off (e.g. no operator key), or None."""
        self._lock = threading.Lock()
        self._registry: tuple[float, list[dict[str, Any]] | None] | None = None

    # ------------------------------------------------------------------ reading

    def history(self, tx_id: str, timeout: float) -> list[Any]:
        """Every record of ``tx_id`` from every topic, oldest first (``saga history``)."""
        from saga.coordinator._admin import history

        _check_tx_id(tx_id)
        entries = history(self._source, tx_id, timeout=timeout, keys=self._verify_keys)
        return list(_plain(entries))

    def participants(self) -> list[dict[str, Any]] | None:
        """The registry's participants (read at most every few seconds), or None."""
        with self._lock:
            if self._registry is not None and time.monotonic() - self._registry[0] < (
                _REGISTRY_CACHE_S
            ):
                return self._registry[1]
        found = registry_participants(self._source, self._verify_keys)
        with self._lock:
            self._registry = (time.monotonic(), found)
        return found

    def capabilities(self) -> dict[str, bool]:
        """Which actions this console may take (the page shows only those)."""
        on = self.actions_disabled is None
        registry = importlib.util.find_spec("saga.streams._registry") is not None
        return {"abort": on, "resolve": on, "redrive": on, "participants": registry}

    # ------------------------------------------------------------------ acting

    def _check_allowed(self) -> None:
        if self.actions_disabled is not None:
            raise ActionRefused(self.actions_disabled, 403)

    def abort(self, tx_id: str, reason: str, operator: str) -> dict[str, Any]:
        """Abort ``tx_id`` as ``saga abort`` does; the answer says whether it was honoured.

        The ``saga.abort`` record names ``<operator> (saga console)``, and so does the
        coordinator's decision (``aborted by operator alice (saga console): ...``).
        """
        from saga.coordinator._admin_actions import Verdict, abort

        self._check_allowed()
        _check_tx_id(tx_id)
        note = _check_note(reason, "reason")
        try:
            result = abort(
                self._source,
                tx_id,
                reason=note,
                by=_by(operator),
                wait_s=self._wait_s,
                keys=self._signing_keys,
            )
        except SagaError as exc:
            self._audit(operator, "abort", tx_id, note, f"failed: {exc}")
            raise ActionRefused(f"the abort could not be sent: {redact(str(exc))}", 502) from None
        self._audit(operator, "abort", tx_id, note, _outcome(result))
        if result.verdict in (Verdict.UNKNOWN, Verdict.REFUSED, Verdict.NOT_HONOURED):
            raise ActionRefused(result.message, 404 if result.verdict is Verdict.UNKNOWN else 409)
        return result.to_json()

    def resolve(self, tx_id: str, step: int, note: str, operator: str) -> dict[str, Any]:
        """Record that step ``step``'s failed compensation was handled by hand."""
        from saga.coordinator._admin_actions import Verdict, resolve

        self._check_allowed()
        _check_tx_id(tx_id)
        text = _check_note(note, "note")
        if not text:
            raise ActionRefused("the note must say what was done by hand, e.g. 'refunded #42'")
        detail = f"step {step}: {text}"
        try:
            result = resolve(
                self._source,
                tx_id,
                step,
                note=text,
                by=_by(operator),
                wait_s=self._wait_s,
                keys=self._signing_keys,
            )
        except SagaError as exc:
            self._audit(operator, "resolve", tx_id, detail, f"failed: {exc}")
            raise ActionRefused(redact(str(exc)), 502) from None
        self._audit(operator, "resolve", tx_id, detail, _outcome(result))
        if result.verdict in (Verdict.UNKNOWN, Verdict.REFUSED):
            raise ActionRefused(result.message, 409)
        return result.to_json()

    def redrive(self, partition: int, offset: int, operator: str) -> dict[str, Any]:
        """Send the dead letter at ``partition:offset`` back to its source topic."""
        from saga.coordinator._admin import dead_letter, redrive

        self._check_allowed()
        where = f"dlq {partition}:{offset}"
        letter = dead_letter(self._source, partition, offset)
        if letter is None:
            self._audit(operator, "redrive", None, where, "refused: no dead letter there")
            raise ActionRefused(f"there is no dead letter at {partition}:{offset}", 404)
        shown = letter.to_json()["tx_id"]
        tx_id = shown if isinstance(shown, str) else None
        try:
            topic, new_partition, new_offset = redrive(self._source, letter, by=_by(operator))
        except SagaError as exc:
            self._audit(operator, "redrive", tx_id, where, f"refused: {exc}")
            raise ActionRefused(redact(str(exc)), 409) from None
        copy = f"{topic}/{new_partition}@{new_offset}"
        self._audit(operator, "redrive", tx_id, where, f"sent to {copy}")
        return {"redriven": where, "to": copy}

    def _audit(
        self, operator: str, action: str, tx_id: str | None, detail: str, outcome: str
    ) -> None:
        self._store.record_action(
            wall_clock_ms(), operator, action, tx_id, detail, redact(outcome)[:500]
        )
        log.warning("operator %s: %s %s (%s): %s", operator, action, tx_id or "", detail, outcome)


def _outcome(result: Any) -> str:
    """An action's line in the audit trail: its verdict and the state it left."""
    state = result.status.state.value if result.status is not None else "no status"
    return f"{result.verdict.value} (state {state})"


def _by(operator: str) -> str:
    """Who acted, as the records say it: the operator, through the console."""
    return f"{operator} (saga console)"


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
