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
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from streams import (
    ConfigurationError,
    ConflictingRequest,
    InvalidRecord,
    Mode,
    SagaAbort,
    SagaError,
    SagaRequest,
    SagaStatus,
    SagaTimeout,
    Step,
    decode,
    decode_as,
    encode,
)
from streams._codec import decode_keyed
from streams._lifecycle import wall_clock_ms
from streams._signed_log import signing
from streams._signing import COORDINATOR, Keyring
from streams.kafka import KafkaLog, KafkaSettings, Message
from streams.log import Log

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
    )
    # Round-trip through the codec: the one place that enforces the contract.
    checked = decode(encode(request))
    assert isinstance(checked, SagaRequest)
    return checked


_COORDINATOR_ONLY = frozenset({COORDINATOR})
_CANDIDATES_KEPT = 64
"""How many unverified status records a view keeps per transaction (the latest)."""


class StatusView:
    """Follows the status topic in a background thread; the latest record per transaction.

    ``from_beginning`` reads the whole (compacted) topic first, so ``get`` knows
    transactions submitted by anyone before the view started; otherwise only
    what is published from now on is seen.

    With ``keys``, only status records, tombstones and dead letters the coordinator
    signed are believed: the records of a transaction are kept as read and verified,
    newest first, when the transaction is asked about (:meth:`get`,
    :meth:`wait_final`, :meth:`snapshot`, a listener that wants it); a forged one is
    logged and dropped. ``log`` makes the consumer (default: a
    :class:`~streams.kafka.KafkaLog` of ``settings``).
    """

    def __init__(
        self,
        settings: KafkaSettings,
        *,
        from_beginning: bool = True,
        keys: Keyring | None = None,
        log: Log | None = None,
    ) -> None:
        self._settings = settings
        self._keys = keys
        self._topic = settings.topics.status
        self._latest: dict[str, SagaStatus] = {}
        # With keys: records read but not verified yet, per tx_id (oldest first), newer
        # than what _latest holds for it.
        self._unverified: dict[str, list[Message]] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._error: BaseException | None = None
        self._listeners: list[
            tuple[Callable[[SagaStatus], None], Callable[[str], bool] | None]
        ] = []
        self._rejection_listeners: list[Callable[[str], None]] = []
        source: Log = log if log is not None else KafkaLog(settings)
        self._consumer = source.consumer(None, client_id="saga.client.status")
        # Requests the coordinator rejected (dead letters from now on), by tx_id: a
        # conflicting or expired request is answered by nothing on the status topic.
        self._dlq = settings.topics.dlq
        self._requests = settings.topics.requests
        self._rejected: OrderedDict[str, list[tuple[str, bytes | None, Message]]] = OrderedDict()
        partitions = self._consumer.list_partitions(self._topic)
        self._ends: dict[int, int] = {}
        start: list[tuple[str, int, int]] = []
        for p in range(partitions):
            low, high = self._consumer.watermarks(self._topic, p)
            if from_beginning:
                start.append((self._topic, p, low))
                if high > low:
                    self._ends[p] = high
            else:
                start.append((self._topic, p, high))
        try:
            for p in range(self._consumer.list_partitions(self._dlq)):
                start.append((self._dlq, p, self._consumer.watermarks(self._dlq, p)[1]))
        except ConfigurationError as exc:  # no DLQ topic, or not allowed to read it
            logging.getLogger("saga.client").info(
                "not following rejected requests (%s): result() waits instead", exc
            )
        self._consumer.assign(start)
        if not self._ends:
            self._caught_up.set()
        self._thread = threading.Thread(target=self._run, name="saga-status", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self._consumer.poll_batch(2000, 0.1)
                if batch:
                    with self._cond:
                        if self._keys is None:
                            self._take(batch)
                        else:
                            self._keep(batch)
                        self._cond.notify_all()
                if not self._caught_up.is_set():
                    self._check_caught_up()
        except BaseException as exc:  # surfaced to callers; the thread must not die silently
            self._error = exc
            with self._cond:
                self._cond.notify_all()
        finally:
            self._consumer.close()

    def _take(self, batch: list[Message]) -> None:
        """Believe ``batch`` as it is (no keys); with the lock held."""
        for m in batch:
            if m.topic == self._dlq:
                self._note_rejection(m)
                continue
            if m.value is None:
                # A tombstone: the coordinator forgot the saga (retention).
                if m.key is not None:
                    self._latest.pop(m.key.decode("utf-8", "replace"), None)
                continue
            try:
                status = decode_as(m.value, SagaStatus)
            except InvalidRecord:
                continue
            assert isinstance(status, SagaStatus)
            self._latest[status.tx_id] = status
            for listener, wants in self._listeners:
                if wants is None or wants(status.tx_id):
                    listener(status)

    def _keep(self, batch: list[Message]) -> None:
        """Keep ``batch`` to verify when asked (keys); with the lock held."""
        touched: dict[str, None] = {}
        for m in batch:
            if m.topic == self._dlq:
                self._note_rejection(m)
                continue
            if m.key is None:
                continue
            tx_id = m.key.decode("utf-8", "replace")
            kept = self._unverified.setdefault(tx_id, [])
            kept.append(m)
            if len(kept) > _CANDIDATES_KEPT:
                del kept[0]
            touched[tx_id] = None
        if not self._listeners:
            return
        for tx_id in touched:
            wanted = [f for f, wants in self._listeners if wants is None or wants(tx_id)]
            if wanted and tx_id in self._unverified:
                status = self._resolve(tx_id)
                if status is not None:
                    for listener in wanted:
                        listener(status)

    def _resolve(self, tx_id: str) -> SagaStatus | None:
        """Verify ``tx_id``'s unverified records, newest first; with the lock held."""
        kept = self._unverified.pop(tx_id, None)
        if kept and self._keys is not None:
            for m in reversed(kept):
                status: SagaStatus | None = None
                if m.value is not None:
                    try:
                        decoded = decode_keyed(m.key, m.value, SagaStatus)
                    except InvalidRecord:
                        continue
                    assert isinstance(decoded, SagaStatus)
                    status = decoded
                reason = self._keys.check(m.topic, m.key, m.value, m.headers, _COORDINATOR_ONLY)
                if reason is not None:
                    log.warning(
                        "not believing the status record of %s at %s/%d@%d: %s",
                        tx_id,
                        m.topic,
                        m.partition,
                        m.offset,
                        reason,
                    )
                    continue
                if status is None:  # a tombstone: the coordinator forgot the saga
                    self._latest.pop(tx_id, None)
                else:
                    self._latest[tx_id] = status
                break
        return self._latest.get(tx_id)

    def _note_rejection(self, m: Message) -> None:
        if m.header("saga.source.topic") != self._requests.encode() or m.key is None:
            return
        reason = (m.header("saga.error") or b"rejected").decode("utf-8", "replace")
        tx_id = m.key.decode("utf-8", "replace")
        kept = self._rejected.setdefault(tx_id, [])
        if self._keys is None:
            kept.clear()  # believed as it is: the latest wins
        kept.append((reason, m.value, m))
        if len(kept) > _CANDIDATES_KEPT:
            del kept[0]
        self._rejected.move_to_end(tx_id)
        while len(self._rejected) > _REJECTIONS_KEPT:
            self._rejected.popitem(last=False)
        for listener in self._rejection_listeners:
            listener(tx_id)

    def _raise_if_rejected(self, tx_id: str, fingerprint: str) -> None:
        """Raise for a believed dead letter of the request ``fingerprint``; lock held."""
        kept = self._rejected.get(tx_id)
        if not kept:
            return
        for entry in reversed(list(kept)):
            reason, value, m = entry
            if not _is_ours(fingerprint, value):
                continue
            if self._keys is not None:
                why = self._keys.check(m.topic, m.key, m.value, m.headers, _COORDINATOR_ONLY)
                if why is not None:
                    log.warning(
                        "not believing the dead letter of %s at %s/%d@%d: %s",
                        tx_id,
                        m.topic,
                        m.partition,
                        m.offset,
                        why,
                    )
                    kept.remove(entry)
                    continue
            _raise_rejected(tx_id, reason)

    def _check_caught_up(self) -> None:
        positions = self._consumer.position([(self._topic, p) for p in self._ends])
        if all(pos is not None and pos >= self._ends[p] for (_, p), pos in positions.items()):
            self._caught_up.set()

    def wait_caught_up(self, timeout: float) -> bool:
        return self._caught_up.wait(timeout)

    def listen(
        self,
        listener: Callable[[SagaStatus], None],
        wants: Callable[[str], bool] | None = None,
    ) -> None:
        """Call ``listener`` (in the reader thread, quickly) with every new status.

        ``wants(tx_id)``, when given, says which transactions the listener cares
        about: with keys, only their records are verified for it.
        """
        with self._cond:
            self._listeners.append((listener, wants))

    def listen_rejections(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(tx_id)`` (in the reader thread) when a request is dead-lettered."""
        with self._cond:
            self._rejection_listeners.append(listener)

    def check_rejected(self, tx_id: str, fingerprint: str | None) -> None:
        """Raise as :meth:`wait_final` does if the request with ``fingerprint`` was rejected."""
        if fingerprint is None:
            return
        with self._cond:
            self._raise_if_rejected(tx_id, fingerprint)

    def get(self, tx_id: str) -> SagaStatus | None:
        with self._cond:
            return self._resolve(tx_id)

    def snapshot(self) -> dict[str, SagaStatus]:
        """Every transaction's latest status (with keys, every one is verified now)."""
        with self._cond:
            for tx_id in list(self._unverified):
                self._resolve(tx_id)
            return dict(self._latest)

    def wait_final(
        self, tx_id: str, timeout: float, fingerprint: str | None = None
    ) -> SagaStatus | None:
        """The final status of ``tx_id``, or ``None`` if it is not final within ``timeout``.

        With ``fingerprint`` (of the request this process sent), a dead letter of that
        very request ends the wait at once: :class:`ConflictingRequest` when the
        transaction id was already used for another payload, :class:`InvalidRecord`
        with the coordinator's reason otherwise.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                status = self._resolve(tx_id)
                if status is not None and status.state.final:
                    return status
                if fingerprint is not None:
                    self._raise_if_rejected(tx_id, fingerprint)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


_REJECTIONS_KEPT = 10_000
"""How many rejected requests a status view remembers (the latest)."""
_SENT_KEPT = 100_000
"""How many of its requests' fingerprints a client remembers (the latest)."""


def _is_ours(fingerprint: str, value: bytes | None) -> bool:
    """Whether a dead letter's ``value`` is the request with ``fingerprint``."""
    try:
        rejected = decode_as(value, SagaRequest)
    except InvalidRecord:
        return False
    return isinstance(rejected, SagaRequest) and rejected.fingerprint() == fingerprint


def _raise_rejected(tx_id: str, reason: str) -> None:
    """Raise for the coordinator's dead letter of this client's request."""
    if "different payload" in reason:
        raise ConflictingRequest(
            f"transaction {tx_id} was already submitted with a different payload, so the "
            "coordinator rejected this request: use a new tx_id for a different transaction"
        )
    raise InvalidRecord(f"the coordinator rejected transaction {tx_id}'s request: {reason}")


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
        timeout: float = DEFAULT_TIMEOUT_S,
        tx_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
        now_ms: int | None = None,
    ) -> SagaRequest:
        """The request ``submit`` would send, checked against the wire contract.

        Raises :class:`InvalidRecord` with a readable reason for bad input.
        """
        return build_request(
            steps, saga=saga, mode=mode, timeout=timeout, tx_id=tx_id, meta=meta, now_ms=now_ms
        )

    # ------------------------------------------------------------ calls

    def submit(
        self,
        steps: Sequence[Step | Mapping[str, Any]],
        *,
        saga: str = "saga",
        mode: Mode | str = Mode.PARALLEL,
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
        request = self.build(steps, saga=saga, mode=mode, timeout=timeout, tx_id=tx_id, meta=meta)
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
        self._producer.produce(self.topics.requests, request.tx_id, encode(request))
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
        self._producer.produce(self.topics.requests, tx_id, encode(record))
        self._producer.flush(30)

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
        timeout: float = DEFAULT_TIMEOUT_S,
        tx_id: str | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> str:
        return await asyncio.to_thread(
            self._client.submit,
            steps,
            saga=saga,
            mode=mode,
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
