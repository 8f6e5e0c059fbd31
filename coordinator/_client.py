"""The client library: submit sagas, follow their status, abort them.

``SagaClient`` (threads) and ``AsyncSagaClient`` (asyncio) share one design:
requests go to the requests topic through an idempotent producer, and one
background reader follows the compacted status topic for every transaction the
client cares about, so thousands of in-flight sagas cost one consumer, not one
per call.

    with SagaClient(KafkaSettings.from_sources(None, None, None, os.environ)) as client:
        tx = client.submit([Step("ledger", "increment", {...}), ...], saga="transfer")
        final = client.result(tx, timeout=10)      # SagaStatus, state committed/rolled_back/failed

With ``keys`` (a :class:`~streams._signing.Keyring`, e.g. ``Keyring.load(folder,
"client")``) the client signs its requests and aborts, and believes a status record
or a dead letter of the coordinator only when the coordinator signed it, verified
lazily: only the records of sagas it is asked about or waits for.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from saga.coordinator._status_view import StatusView
from saga.streams import (
    ConflictingRequest,
    InvalidRecord,
    Isolation,
    Mode,
    SagaAbort,
    SagaError,
    SagaRequest,
    SagaStatus,
    SagaTimeout,
    Step,
    decode,
    encode,
)
from saga.streams._lifecycle import wall_clock_ms
from saga.streams._otel import Spans
from saga.streams._routing import request_headers, type_headers
from saga.streams._signed_log import signing
from saga.streams._signing import Keyring
from saga.streams.kafka import KafkaLog, KafkaSettings
from saga.streams.log import Log

log = logging.getLogger("saga.client")

DEFAULT_TIMEOUT_S = 30.0
# A deadline further away than this is a typo, not a plan (and must fit in 64 bits).
MAX_TIMEOUT_S = 1_000_000_000


def _as_step(step: Step | Mapping[str, Any]) -> Step:
    if isinstance(step, Step):
        return step
    try:
        return Step(
            participant=step["participant"], action=step["action"], args=dict(step.get("args", {}))
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise InvalidRecord(
            f"a step must be an object with 'participant', 'action' and 'args', got {step!r}"
        ) from exc


def _timeout_ms(timeout: Any) -> int:
    """``timeout`` seconds in milliseconds; a readable :class:`InvalidRecord` unless it is a
    finite positive number of at most :data:`MAX_TIMEOUT_S`."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidRecord(
            f"timeout must be a number of seconds, got {type(timeout).__name__} {timeout!r}"
        )
    if not math.isfinite(timeout) or timeout <= 0:
        raise InvalidRecord(f"timeout must be a positive finite number of seconds, got {timeout!r}")
    if timeout > MAX_TIMEOUT_S:
        raise InvalidRecord(
            f"timeout must be at most {MAX_TIMEOUT_S:,} seconds (about 31 years), got {timeout!r}"
        )
    return int(timeout * 1000)


def _still_running(tx_id: str, timeout: float, current: SagaStatus | None) -> SagaTimeout:
    state = current.state.value if current is not None else "not seen by the coordinator yet"
    return SagaTimeout(
        f"transaction {tx_id} is still running after {timeout:g} s (state: {state}); "
        "call result() again later or check `saga status`"
    )


def build_request(
    steps: Sequence[Step | Mapping[str, Any]],
    *,
    saga: str = "saga",
    mode: Mode | str = Mode.PARALLEL,
    isolation: Isolation | str = Isolation.READ_COMMITTED,
    timeout: float = DEFAULT_TIMEOUT_S,
    tx_id: str | None = None,
    meta: Mapping[str, Any] | None = None,
    now_ms: int | None = None,
) -> SagaRequest:
    """The request :meth:`SagaClient.submit` would send, checked against the wire contract.

    Needs no Kafka, so a command line can check its input before it connects.
    Raises :class:`InvalidRecord` with a readable reason for bad input.
    """
    try:
        mode = Mode(mode)
    except ValueError as exc:
        raise InvalidRecord(f"mode must be 'parallel' or 'sequential', got {mode!r}") from exc
    try:
        isolation = Isolation(isolation)
    except ValueError as exc:
        raise InvalidRecord(
            f"isolation must be 'read_committed' or 'none', got {isolation!r}"
        ) from exc
    created = wall_clock_ms() if now_ms is None else now_ms
    deadline_ms = created + _timeout_ms(timeout)
    if meta is not None and not isinstance(meta, Mapping):
        raise InvalidRecord(
            f"meta must be an object of names to values (or absent), got {type(meta).__name__}"
        )
    if isinstance(steps, str | bytes | Mapping) or not isinstance(steps, Iterable):
        raise InvalidRecord(
            "steps must be a list of {participant, action, args} objects, got "
            f"{type(steps).__name__}"
        )
    request = SagaRequest(
        tx_id=tx_id if tx_id is not None else uuid.uuid4().hex,
        saga=saga,
        mode=mode,
        steps=tuple(_as_step(s) for s in steps),
        deadline_ms=deadline_ms,
        created_ms=created,
        meta=meta,
        isolation=isolation,
    )
    # Round-trip through the codec: the one place that enforces the contract.
    checked = decode(encode(request))
    assert isinstance(checked, SagaRequest)
    return checked


_SENT_KEPT = 100_000
"""How many of its requests' fingerprints a client remembers (the latest)."""


class SagaClient:
    """Submit sagas and follow them; safe to share between threads.

    ``keys`` (``Keyring.load(folder, "client")``, or ``"operator"``) signs the
    requests and aborts it sends and makes it believe only what the coordinator
    signed (see :class:`StatusView`); ``log`` makes its Kafka clients (default: a
    :class:`~streams.kafka.KafkaLog` of ``settings``; tests pass an in-memory log).
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        status_from_beginning: bool = True,
        keys: Keyring | None = None,
        log: Log | None = None,
    ) -> None:
        self.settings = settings
        self.topics = settings.topics
        source: Log = log if log is not None else KafkaLog(settings)
        self._producer = signing(source, keys).producer(client_id="saga.client")
        self._spans = Spans("saga.client")  # starts each saga's trace (W3C traceparent)
        self._view = StatusView(
            settings, from_beginning=status_from_beginning, keys=keys, log=source
        )
        # tx_id -> fingerprint of the requests this client sent, the latest _SENT_KEPT:
        # a client that runs for months must not hold every saga it ever sent.
        self._submitted: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def __enter__(self) -> SagaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ building

    def build(
        self,
        steps: Sequence[Step | Mapping[str, Any]],
        *,
        saga: str = "saga",
        mode: Mode | str = Mode.PARALLEL,
        isolation: Isolation | str = Isolation.READ_COMMITTED,
        timeout: float = DEFAULT_TIMEOUT_S,
        tx_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
        now_ms: int | None = None,
    ) -> SagaRequest:
        """The request ``submit`` would send, checked against the wire contract.

        Raises :class:`InvalidRecord` with a readable reason for bad input.
        """
        return build_request(
            steps,
            saga=saga,
            mode=mode,
            isolation=isolation,
            timeout=timeout,
            tx_id=tx_id,
            meta=meta,
            now_ms=now_ms,
        )

    # ------------------------------------------------------------ calls

    def submit(
        self,
        steps: Sequence[Step | Mapping[str, Any]],
        *,
        saga: str = "saga",
        mode: Mode | str = Mode.PARALLEL,
        isolation: Isolation | str = Isolation.READ_COMMITTED,
        timeout: float = DEFAULT_TIMEOUT_S,
        tx_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
        wait_delivery: bool = True,
    ) -> str:
        """Append a saga request to the log; returns its ``tx_id``.

        Resubmitting a ``tx_id`` with the same steps, saga name, mode and meta
        is harmless and leads to the same outcome; with a different payload it
        raises :class:`ConflictingRequest`. With ``wait_delivery`` (default) the
        call returns once Kafka has the request.
        """
        request = self.build(
            steps,
            saga=saga,
            mode=mode,
            isolation=isolation,
            timeout=timeout,
            tx_id=tx_id,
            meta=meta,
        )
        self.send(request, wait_delivery=wait_delivery)
        return request.tx_id

    def send(self, request: SagaRequest, *, wait_delivery: bool = True) -> None:
        """Append a request built by :meth:`build` (for callers that batch their sends)."""
        fingerprint = request.fingerprint()
        with self._lock:
            known = self._submitted.get(request.tx_id)
            status = self._view.get(request.tx_id)
            if status is not None and status.fingerprint is not None:
                known = status.fingerprint
            if known is not None and known != fingerprint:
                raise ConflictingRequest(
                    f"transaction {request.tx_id} was already submitted with a different "
                    "payload: use a new tx_id for a different transaction"
                )
            self._submitted[request.tx_id] = fingerprint
            self._submitted.move_to_end(request.tx_id)
            while len(self._submitted) > _SENT_KEPT:
                self._submitted.popitem(last=False)
        headers = self._trace("saga.client.submit", request.tx_id, {"saga.name": request.saga})
        headers += request_headers(request)  # lets a participant skip it undecoded
        self._producer.produce(self.topics.requests, request.tx_id, encode(request), headers)
        if wait_delivery:
            self._producer.flush(30)

    def flush(self, timeout: float = 30) -> None:
        self._producer.flush(timeout)

    def status(self, tx_id: str) -> SagaStatus | None:
        """The latest published status of ``tx_id`` (``None``: not seen yet)."""
        return self._view.get(tx_id)

    def _check_rejected(self, tx_id: str) -> None:
        with self._lock:
            fingerprint = self._submitted.get(tx_id)
        self._view.check_rejected(tx_id, fingerprint)

    def result(self, tx_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> SagaStatus:
        """Wait for the final status (committed, rolled_back or failed).

        Raises :class:`SagaTimeout` when the saga is still running after ``timeout``;
        for a request this client sent that the coordinator rejected,
        :class:`ConflictingRequest` (its tx_id was used for another payload) or
        :class:`InvalidRecord` (any other reason, e.g. expired), within a second or two.
        """
        with self._lock:
            fingerprint = self._submitted.get(tx_id)
        status = self._view.wait_final(tx_id, timeout, fingerprint)
        if status is None:
            raise _still_running(tx_id, timeout, self._view.get(tx_id))
        return status

    def abort(self, tx_id: str, reason: str = "") -> None:
        """Ask for a rollback; honoured only while the transaction has no decision."""
        record = SagaAbort(tx_id=tx_id, reason=reason, at_ms=wall_clock_ms())
        headers = self._trace("saga.client.abort", tx_id, {}) + type_headers(record)
        self._producer.produce(self.topics.requests, tx_id, encode(record), headers)
        self._producer.flush(30)

    def _trace(self, span: str, tx_id: str, attributes: dict[str, str]) -> list[tuple[str, bytes]]:
        """Headers that start the record's trace: under the caller's OpenTelemetry span, if any."""
        context = self._spans.record(
            span,
            self._spans.current(),
            attributes={"saga.tx_id": tx_id, **attributes},
            kind="PRODUCER",
        )
        return context.headers()

    def wait_caught_up(self, timeout: float = 30) -> bool:
        """Whether the status reader has read what existed when the client started."""
        return self._view.wait_caught_up(timeout)

    def statuses(self) -> dict[str, SagaStatus]:
        return self._view.snapshot()

    def close(self) -> None:
        self._view.close()
        self._producer.flush(10)
        self._producer.close()


class AsyncSagaClient:
    """The asyncio twin of :class:`SagaClient`; the blocking work runs in a thread."""

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        status_from_beginning: bool = True,
        keys: Keyring | None = None,
        log: Log | None = None,
    ) -> None:
        self._client = SagaClient(
            settings, status_from_beginning=status_from_beginning, keys=keys, log=log
        )
        self._waiters: dict[str, list[asyncio.Future[SagaStatus]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client._view.listen(self._on_status, wants=self._waits_for)
        self._client._view.listen_rejections(self._on_rejection)

    def _on_rejection(self, tx_id: str) -> None:
        # Reader thread: the event loop checks whether it was this client's request.
        if self._loop is not None and tx_id in self._waiters:
            self._loop.call_soon_threadsafe(self._reject, tx_id)

    def _reject(self, tx_id: str) -> None:
        try:
            self._client._check_rejected(tx_id)
        except SagaError as exc:
            for fut in self._waiters.pop(tx_id, []):
                if not fut.done():
                    fut.set_exception(exc)

    def _waits_for(self, tx_id: str) -> bool:
        return tx_id in self._waiters

    def _on_status(self, status: SagaStatus) -> None:
        # Reader thread: hand final states to the event loop, which owns the futures.
        if status.state.final and self._loop is not None and status.tx_id in self._waiters:
            self._loop.call_soon_threadsafe(self._resolve, status)

    def _resolve(self, status: SagaStatus) -> None:
        for fut in self._waiters.pop(status.tx_id, []):
            if not fut.done():
                fut.set_result(status)

    async def __aenter__(self) -> AsyncSagaClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(
        self,
        steps: Sequence[Step | Mapping[str, Any]],
        *,
        saga: str = "saga",
        mode: Mode | str = Mode.PARALLEL,
        isolation: Isolation | str = Isolation.READ_COMMITTED,
        timeout: float = DEFAULT_TIMEOUT_S,
        tx_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        return await asyncio.to_thread(
            self._client.submit,
            steps,
            saga=saga,
            mode=mode,
            isolation=isolation,
            timeout=timeout,
            tx_id=tx_id,
            meta=meta,
        )

    async def submit_many(self, requests: Iterable[SagaRequest]) -> list[str]:
        """Send pre-built requests with one flush at the end."""

        def send_all() -> list[str]:
            ids = []
            for r in requests:
                self._client.send(r, wait_delivery=False)
                ids.append(r.tx_id)
            self._client.flush()
            return ids

        return await asyncio.to_thread(send_all)

    def build(self, steps: Sequence[Step | Mapping[str, Any]], **kwargs: Any) -> SagaRequest:
        return self._client.build(steps, **kwargs)

    def status(self, tx_id: str) -> SagaStatus | None:
        return self._client.status(tx_id)

    async def result(self, tx_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> SagaStatus:
        """Wait for the final status; thousands of waits share the one status reader.

        Raises as :meth:`SagaClient.result` does, including for a request of this
        client's that the coordinator rejected.
        """
        self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[SagaStatus] = self._loop.create_future()
        self._waiters.setdefault(tx_id, []).append(fut)
        current = self._client.status(tx_id)  # final before we started waiting?
        if current is not None and current.state.final:
            self._resolve(current)
        self._reject(tx_id)  # or rejected before we started waiting?
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            waiting = self._waiters.get(tx_id, [])
            if fut in waiting:
                waiting.remove(fut)
            if not waiting:
                self._waiters.pop(tx_id, None)
            raise _still_running(tx_id, timeout, self._client.status(tx_id)) from None

    async def abort(self, tx_id: str, reason: str = "") -> None:
        await asyncio.to_thread(self._client.abort, tx_id, reason)

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)
