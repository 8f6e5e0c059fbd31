"""The client library: submit sagas, follow their status, abort them.

``SagaClient`` (threads) and ``AsyncSagaClient`` (asyncio, :mod:`coordinator._client_async`)
share one design: requests go to the requests topic through an idempotent producer,
each with a future of its own delivery (:mod:`coordinator._delivery`), and one
background reader follows the compacted status topic for every transaction the client
cares about, so thousands of in-flight sagas cost one consumer, not one per call.

    with SagaClient("127.0.0.1:19092") as client:        # or SagaClient.from_env()
        tx = client.submit([Step("ledger", "increment", {...}), ...], saga="transfer")
        final = client.result(tx, timeout=10)      # SagaStatus, state committed/rolled_back/failed

Where Kafka is: :mod:`coordinator._connect` (bootstrap servers, keywords for the prefix,
a Kafka config file and the keys, or the ``saga`` command's variables).

Retrying a submit: the ``tx_id`` is fixed before anything is sent, and every submit
error carries it (``error.tx_id``). When Kafka did not confirm the delivery the error
is :class:`~streams.SubmitUncertain` (a :class:`~streams.TransientError`): the request
may or may not be in the log. Submit the same steps again **with that tx_id**::

    try:
        tx = client.submit(steps, saga="transfer")
    except SubmitUncertain as exc:
        tx = client.submit(steps, saga="transfer", tx_id=exc.tx_id)  # one saga, whatever came

Two requests with one ``tx_id`` and the same steps, saga name, mode and isolation are
one saga; a retry with a new ``tx_id`` could run the transaction twice.

With ``keys`` (a key folder, or a :class:`~streams._signing.Keyring`, e.g.
``Keyring.load(folder, "operator")``) the client signs its requests and aborts, and
believes a status record or a dead letter of the coordinator only when the coordinator
signed it, verified lazily: only the records of sagas it is asked about or waits for.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Self

from saga.coordinator._connect import Keys, client_keys, client_settings, env_settings
from saga.coordinator._delivery import Delivered, delivery_future, submit_error, wait_delivered
from saga.coordinator._hints import Announced
from saga.coordinator._request import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, build_request
from saga.coordinator._status_view import StatusView
from saga.streams import (
    ConflictingRequest,
    Isolation,
    Mode,
    SagaAbort,
    SagaError,
    SagaRequest,
    SagaStatus,
    SagaTimeout,
    Step,
    encode,
)
from saga.streams._lifecycle import wall_clock_ms
from saga.streams._otel import Spans
from saga.streams._routing import request_headers, type_headers
from saga.streams._signed_log import signing
from saga.streams.kafka import KafkaLog, KafkaSettings
from saga.streams.log import Log

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_TIMEOUT_S",
    "Delivered",
    "SagaClient",
    "build_request",
]

log = logging.getLogger("saga.client")

DEFAULT_DELIVERY_TIMEOUT_S = 30.0
_SENT_KEPT = 100_000
"""How many of its requests' fingerprints a client remembers (the latest)."""

StatusListener = tuple[Callable[[SagaStatus], None], Callable[[str], bool] | None]


def _still_running(tx_id: str, timeout: float, current: SagaStatus | None) -> SagaTimeout:
    state = current.state.value if current is not None else "not seen by the coordinator yet"
    return SagaTimeout(
        f"transaction {tx_id} is still running after {timeout:g} s (state: {state}); "
        "call result() again later or check `saga status`"
    )


class SagaClient:
    """Submit sagas and follow them; safe to share between threads.

    ``kafka``: the Kafka bootstrap servers (``SagaClient("127.0.0.1:19092")``), with
    ``prefix`` (the topics' prefix, default ``saga``) and ``kafka_config`` (a file of
    ``key=value`` librdkafka settings: SASL, TLS); or ready-made
    :class:`~streams.kafka.KafkaSettings`. :meth:`from_env` reads the ``saga``
    command's variables instead. ``keys`` (a key folder made by ``saga keys create``,
    whose ``client`` key signs; or a :class:`~streams._signing.Keyring`, e.g.
    ``Keyring.load(folder, "operator")``) signs the requests and aborts it sends and
    makes it believe only what the coordinator signed (see :class:`StatusView`);
    ``log`` makes its Kafka clients (default: a :class:`~streams.kafka.KafkaLog` of the
    settings; tests pass an in-memory log).
    ``delivery_timeout``: how long a submit waits for Kafka to confirm its request
    before it raises :class:`~streams.SubmitUncertain`.

    Making a client contacts nobody: the status reader starts with the first call that
    needs it (a submit, which then follows the coordinator's rejections of what it
    sends, or a status or result). A submit while Kafka is unreachable still sends its
    request (it is queued) and says what became of it.
    """

    def __init__(
        self,
        kafka: KafkaSettings | str | None = None,
        *,
        prefix: str | None = None,
        kafka_config: str | os.PathLike[str] | None = None,
        keys: Keys = None,
        status_from_beginning: bool = True,
        log: Log | None = None,
        delivery_timeout: float = DEFAULT_DELIVERY_TIMEOUT_S,
    ) -> None:
        settings = client_settings(kafka, prefix=prefix, kafka_config=kafka_config)
        keys = client_keys(keys)
        self.settings = settings
        self.topics = settings.topics
        self.delivery_timeout = delivery_timeout
        self._source: Log = log if log is not None else KafkaLog(settings)
        self._keys = keys
        self._from_beginning = status_from_beginning
        self._producer = signing(self._source, keys).producer(client_id="saga.client")
        self._spans = Spans("saga.client")  # starts each saga's trace (W3C traceparent)
        self._view_: StatusView | None = None
        self._view_lock = threading.Lock()
        self._listeners: list[StatusListener] = []
        self._rejection_listeners: list[Callable[[str], None]] = []
        # tx_id -> fingerprint of the requests this client sent, the latest _SENT_KEPT:
        # a client that runs for months must not hold every saga it ever sent.
        self._submitted: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._announced = Announced(self._source, keys)
        self._hinted: OrderedDict[str, None] = OrderedDict()  # names warned about

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        prefix: str | None = None,
        kafka_config: str | os.PathLike[str] | None = None,
        keys: Keys = None,
        **options: Any,
    ) -> Self:
        """A client configured as the ``saga`` command is: ``SAGA_KAFKA_BOOTSTRAP``,
        ``SAGA_TOPIC_PREFIX``, ``SAGA_KAFKA_<NAME>`` settings and ``SAGA_KEYS_DIR`` from
        ``environ`` (default: ``os.environ``); a keyword wins over its variable.
        ``options`` are the constructor's other keywords.

        Raises:
            ConfigurationError: no ``SAGA_KAFKA_BOOTSTRAP`` (nor keyword), or a bad setting.
        """
        env = os.environ if environ is None else environ
        settings = env_settings(env, prefix=prefix, kafka_config=kafka_config)
        return cls(settings, keys=client_keys(keys, env), **options)

    def __enter__(self) -> SagaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the status reader

    @property
    def _view(self) -> StatusView:
        """The status reader, started on first use (raises while Kafka does not answer)."""
        with self._view_lock:
            if self._view_ is None:
                view = StatusView(
                    self.settings,
                    from_beginning=self._from_beginning,
                    keys=self._keys,
                    log=self._source,
                    timeout=min(10.0, self.delivery_timeout),
                )
                for listener, wants in self._listeners:
                    view.listen(listener, wants=wants)
                for rejected in self._rejection_listeners:
                    view.listen_rejections(rejected)
                self._view_ = view
            return self._view_

    def _view_if_up(self) -> StatusView | None:
        """The status reader, started now if Kafka answers; None if it does not (yet)."""
        try:
            return self._view
        except SagaError as exc:
            if not exc.retryable:
                raise
            log.info("status reader not started yet: %s", exc)
            return None

    def _listen(
        self,
        on_status: Callable[[SagaStatus], None],
        wants: Callable[[str], bool] | None,
        on_rejection: Callable[[str], None],
    ) -> None:
        """Hand new statuses and rejections to these listeners (in the reader thread)."""
        with self._view_lock:
            self._listeners.append((on_status, wants))
            self._rejection_listeners.append(on_rejection)
            if self._view_ is not None:
                self._view_.listen(on_status, wants=wants)
                self._view_.listen_rejections(on_rejection)

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
        """The request ``submit`` would send, its ``tx_id`` fixed, checked against the contract.

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

        Resubmitting a ``tx_id`` with the same steps, saga name, mode and isolation is
        harmless and leads to the same outcome; with a different payload it raises
        :class:`ConflictingRequest`. With ``wait_delivery`` (default) the call returns
        once Kafka has the request. A participant name that never announced itself on
        the participant registry is logged as a warning (``saga.client``), once per
        name, with the nearest announced name (:meth:`unannounced`); the request is
        sent all the same.

        Raises:
            SubmitUncertain: Kafka did not confirm the request within
                ``delivery_timeout`` (or gave up on it for a reason worth a retry): it
                may or may not be in the log. Submit again with ``tx_id=error.tx_id``,
                never with a new id (see the module docstring).
            SagaError: the request was refused for good; ``error.tx_id`` names it.
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
        view = self._view_if_up()
        if view is not None:  # Kafka answers: the registry can be read quickly
            for name, hint in self._hints(request):
                with self._lock:
                    if name in self._hinted:
                        continue
                    self._hinted[name] = None
                    if len(self._hinted) > _SENT_KEPT:
                        self._hinted.popitem(last=False)
                log.warning("%s", hint, extra={"tx_id": request.tx_id})
        self._send(request, wait_delivery, view)
        return request.tx_id

    def unannounced(self, request: SagaRequest | Sequence[Step | Mapping[str, Any]]) -> list[str]:
        """A sentence for each participant the request (or steps) names that never
        announced itself on the participant registry, with the nearest announced name
        ("participant 'ledgr' has never announced itself on saga.participants; did you
        mean 'ledger'?"); empty when all did, or when the registry cannot be read.

        Such a request may still be sent: the coordinator waits a while for a participant
        that has not announced itself yet (it may be starting), then rolls the saga back.
        """
        if self._view_if_up() is None:
            return []
        if not isinstance(request, SagaRequest):
            request = self.build(request)
        return [hint for _, hint in self._hints(request)]

    def _hints(self, request: SagaRequest) -> list[tuple[str, str]]:
        return self._announced.hints(step.participant for step in request.steps)

    def send(self, request: SagaRequest, *, wait_delivery: bool = True) -> Future[Delivered]:
        """Append a request built by :meth:`build`; returns the future of its delivery.

        The future resolves to :class:`Delivered` (where Kafka wrote it) or to the error
        :meth:`submit` raises for it: each caller gets its own record's fate, never
        another's. With ``wait_delivery`` the call waits for it (as :meth:`submit`);
        without, callers that batch their sends wait on the futures themselves (and a
        :meth:`flush` serves their delivery reports).
        """
        return self._send(request, wait_delivery, self._view_if_up())

    def _send(
        self, request: SagaRequest, wait_delivery: bool, view: StatusView | None
    ) -> Future[Delivered]:
        # ``view`` started before sending: it follows the coordinator's rejections.
        fingerprint = request.fingerprint()
        with self._lock:
            known = self._submitted.get(request.tx_id)
            status = view.follow(request.tx_id) if view is not None else None  # reads nothing
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
        future = self._produce(request.tx_id, encode(request), headers)
        if wait_delivery:
            self._wait(future, request.tx_id)
        return future

    def _produce(
        self, tx_id: str, value: bytes, headers: list[tuple[str, bytes]]
    ) -> Future[Delivered]:
        future, on_delivery = delivery_future(tx_id)
        try:
            self._producer.produce(self.topics.requests, tx_id, value, headers, on_delivery)
        except SagaError as exc:
            raise submit_error(tx_id, exc) from exc
        return future

    def _wait(self, future: Future[Delivered], tx_id: str) -> Delivered:
        return wait_delivered(
            self._producer, future, tx_id, self.delivery_timeout, self.settings.bootstrap
        )

    def flush(self, timeout: float = 30) -> None:
        """Wait until every request sent is delivered (or ``timeout`` passed); each
        request's own future (:meth:`send`) says what became of it."""
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
        """Ask for a rollback; honoured only while the transaction has no decision.

        Raises as :meth:`submit` does when Kafka does not confirm the abort (sending it
        again is harmless).
        """
        record = SagaAbort(tx_id=tx_id, reason=reason, at_ms=wall_clock_ms())
        headers = self._trace("saga.client.abort", tx_id, {}) + type_headers(record)
        self._wait(self._produce(tx_id, encode(record), headers), tx_id)

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
        """Whether the status reader has read what existed when it started."""
        return self._view.wait_caught_up(timeout)

    def statuses(self) -> dict[str, SagaStatus]:
        return self._view.snapshot()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._view_lock:
            if self._view_ is not None:
                self._view_.close()
        self._announced.close()
        self._producer.close(10)  # delivers what it can; never raises
