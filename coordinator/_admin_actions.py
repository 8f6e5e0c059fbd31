"""What an operator does through the log: abort a saga and hear whether it was honoured,
resolve a failed compensation by hand.

Both are records on the requests topic (``saga.abort``, ``saga.resolve``) naming who
acted; with keys they are signed (an abort by ``client`` or ``operator``, a resolve
by ``operator`` only). Each function checks the transaction's standing status first
(so an unknown or already decided transaction is answered without a record that
would only end on the DLQ), sends, then waits for the coordinator's answer on the
status topic. Used by the ``saga abort`` and ``saga resolve`` commands and the web
console; the reading side is :mod:`coordinator._admin`.
"""

from __future__ import annotations

import getpass
import socket
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from saga.coordinator._admin import history, standing
from saga.coordinator._admin_dlq import _log_of
from saga.streams import (
    ConfigurationError,
    KafkaSettings,
    SagaAbort,
    SagaResolve,
    SagaState,
    SagaStatus,
    StepStatus,
    encode,
)
from saga.streams._lifecycle import wall_clock_ms
from saga.streams._routing import type_headers
from saga.streams._signed_log import signing
from saga.streams._signing import Keyring
from saga.streams.log import Log

__all__ = ["ActionResult", "Verdict", "abort", "default_operator", "resolve"]

_POLL_S = 0.5
_MAX_BY_CHARS = 200
_DECIDED_ROLLBACK = (SagaState.ROLLING_BACK, SagaState.ROLLED_BACK, SagaState.FAILED)
_DECIDED_COMMIT = (SagaState.COMMITTING, SagaState.COMMITTED)


class Verdict(StrEnum):
    """How an operator action ended; :attr:`exit_code` is the command's exit code."""

    HONOURED = "honoured"
    ALREADY = "already"
    NOT_HONOURED = "not_honoured"
    TIMEOUT = "timeout"
    UNKNOWN = "unknown"
    REFUSED = "refused"

    @property
    def exit_code(self) -> int:
        return {"honoured": 0, "already": 0, "not_honoured": 3, "timeout": 4}.get(self.value, 2)


@dataclass(frozen=True)
class ActionResult:
    """The outcome of an operator action: a verdict, one sentence, the status seen last."""

    tx_id: str
    verdict: Verdict
    message: str
    status: SagaStatus | None
    sent: bool

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of this result."""
        return {
            "tx_id": self.tx_id,
            "verdict": self.verdict.value,
            "message": self.message,
            "state": self.status.state.value if self.status is not None else None,
            "reason": self.status.reason if self.status is not None else None,
            "sent": self.sent,
        }


def default_operator() -> str:
    """``$USER@hostname``: who acts, when the operator does not say."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name in a bare container
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:_MAX_BY_CHARS]


def _check_by(by: str) -> str:
    if not by or len(by) > _MAX_BY_CHARS:
        raise ConfigurationError(f"--by must be 1 to {_MAX_BY_CHARS} characters, such as ann@ops1")
    return by


def _send(log: Log, keys: Keyring | None, tx_id: str, record: SagaAbort | SagaResolve) -> None:
    with signing(log, keys).producer(client_id="saga.admin") as producer:
        topic = log.settings.topics.requests
        producer.produce(topic, tx_id, encode(record), type_headers(record))
        producer.flush(30)  # raises (one sentence) when Kafka does not take it


def _wait(
    log: Log, tx_id: str, keys: Keyring | None, wait_s: float, done: Any
) -> SagaStatus | None:
    """Poll the standing status until ``done(status)`` or ``wait_s`` passes; the last seen."""
    deadline = time.monotonic() + wait_s
    status = None
    while True:
        status = standing(log, tx_id, keys=keys, timeout=min(10.0, max(wait_s, 1.0)))
        if (status is not None and done(status)) or time.monotonic() >= deadline:
            return status
        time.sleep(_POLL_S)


def _decided(status: SagaStatus | None) -> bool:
    return status is not None and status.state is not SagaState.PENDING


def abort(
    log_or_settings: Log | KafkaSettings,
    tx_id: str,
    *,
    reason: str = "",
    by: str | None = None,
    wait_s: float = 10.0,
    keys: Keyring | None = None,
) -> ActionResult:
    """Abort ``tx_id`` and wait up to ``wait_s`` seconds to say whether it was honoured.

    Verdicts: ``honoured`` (rolled back by this abort, or rolling back), ``already``
    (it was rolled back before: a second abort says so and sends nothing),
    ``not_honoured`` (committed, or committing), ``unknown`` (no request or status
    of it in the log: nothing is sent), ``timeout`` (no decision within ``wait_s``).
    """
    log = _log_of(log_or_settings)
    who = _check_by(by or default_operator())
    before = standing(log, tx_id, keys=keys)
    if before is None and not any(e.kind == "saga.request" for e in history(log, tx_id)):
        return ActionResult(
            tx_id,
            Verdict.UNKNOWN,
            f"unknown transaction {tx_id}: no request or status of it is in the log; "
            "check the id and the --prefix",
            None,
            False,
        )
    if _decided(before):
        return _judge_decided(tx_id, before, sent=False)
    _send(log, keys, tx_id, SagaAbort(tx_id=tx_id, reason=reason, at_ms=wall_clock_ms(), by=who))
    after = _wait(log, tx_id, keys, wait_s, _decided)
    if not _decided(after):
        return ActionResult(
            tx_id,
            Verdict.TIMEOUT,
            f"abort of {tx_id} sent, but it is not decided yet after {wait_s:g} s; is the "
            f"coordinator running? `saga status {tx_id}` tells later",
            after,
            True,
        )
    return _judge_decided(tx_id, after, sent=True)


def _judge_decided(tx_id: str, status: SagaStatus | None, *, sent: bool) -> ActionResult:
    assert status is not None
    why = f" ({status.reason})" if status.reason else ""
    if status.state in _DECIDED_COMMIT:
        return ActionResult(
            tx_id,
            Verdict.NOT_HONOURED,
            f"{tx_id} is already {status.state.value} — not honoured{why}",
            status,
            sent,
        )
    if not sent:
        return ActionResult(
            tx_id,
            Verdict.ALREADY,
            f"{tx_id} is already rolled back or rolling back (state {status.state.value}){why}",
            status,
            sent,
        )
    return ActionResult(
        tx_id,
        Verdict.HONOURED,
        f"{tx_id} rolled back (state {status.state.value}){why}",
        status,
        sent,
    )


def resolve(
    log_or_settings: Log | KafkaSettings,
    tx_id: str,
    step: int,
    *,
    note: str,
    by: str | None = None,
    wait_s: float = 10.0,
    keys: Keyring | None = None,
) -> ActionResult:
    """Record that step ``step`` of the failed ``tx_id`` was handled by hand; wait for it.

    Refused before sending (verdict ``unknown`` or ``refused``, one sentence) when the
    transaction has no status, is not ``failed``, or step ``step`` has no failed
    compensation. Otherwise sends ``saga.resolve`` and waits up to ``wait_s`` for the
    coordinator to mark the step ``resolved`` (``honoured``; the state is then
    ``rolled_back``, or still ``failed`` while other failed steps remain), else
    ``timeout``.
    """
    log = _log_of(log_or_settings)
    who = _check_by(by or default_operator())
    if not note.strip():
        raise ConfigurationError("--note must say what was done by hand, such as 'refunded #42'")
    before = standing(log, tx_id, keys=keys)
    if before is None:
        return ActionResult(
            tx_id,
            Verdict.UNKNOWN,
            f"unknown transaction {tx_id}: it has no status; check the id and the --prefix",
            None,
            False,
        )
    failed = [i for i, s in enumerate(before.steps) if s.status is StepStatus.COMPENSATION_FAILED]
    if before.state is not SagaState.FAILED or step not in failed:
        problem = (
            f"it is {before.state.value}, not failed"
            if before.state is not SagaState.FAILED
            else f"step {step} has no failed compensation (those that do: {failed})"
        )
        return ActionResult(
            tx_id, Verdict.REFUSED, f"nothing to resolve in {tx_id}: {problem}", before, False
        )
    record = SagaResolve(tx_id=tx_id, step=step, note=note, by=who, at_ms=wall_clock_ms())
    _send(log, keys, tx_id, record)

    def resolved(status: SagaStatus) -> bool:
        return step < len(status.steps) and status.steps[step].status is StepStatus.RESOLVED

    after = _wait(log, tx_id, keys, wait_s, resolved)
    if after is None or not resolved(after):
        return ActionResult(
            tx_id,
            Verdict.TIMEOUT,
            f"resolve of {tx_id} step {step} sent, but the coordinator has not taken it "
            f"after {wait_s:g} s; is it running? `saga history {tx_id}` tells later",
            after,
            True,
        )
    return ActionResult(
        tx_id,
        Verdict.HONOURED,
        f"{tx_id} step {step} resolved by hand by {who}; the saga is {after.state.value}",
        after,
        True,
    )
