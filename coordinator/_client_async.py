"""The asyncio client: :class:`AsyncSagaClient`, the twin of :class:`~coordinator.SagaClient`.

The blocking work runs in worker threads of the event loop's default executor; each
submit waits for its own record's delivery (:mod:`coordinator._delivery`), and
thousands of waits for results share the one status reader.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Self

from saga.coordinator._client import DEFAULT_DELIVERY_TIMEOUT_S, SagaClient, _still_running
from saga.coordinator._connect import Keys, client_keys, env_settings
from saga.coordinator._delivery import Delivered
from saga.coordinator._request import DEFAULT_TIMEOUT_S
from saga.streams import (
    Isolation,
    Mode,
    SagaError,
    SagaRequest,
    SagaStatus,
    Step,
    SubmitUncertain,
)
from saga.streams.kafka import KafkaSettings
from saga.streams.log import Log

__all__ = ["AsyncSagaClient"]


class AsyncSagaClient:
    """The asyncio twin of :class:`SagaClient`; the blocking work runs in a thread.

    Made as a :class:`SagaClient` is: ``AsyncSagaClient("127.0.0.1:19092")`` with the same
    keywords, or :meth:`from_env`.

    Submits raise as :meth:`SagaClient.submit` does: :class:`~streams.SubmitUncertain`
    (with ``.tx_id``) when Kafka did not confirm a request; submit again with that id.
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
        self._client = SagaClient(
            kafka,
            prefix=prefix,
            kafka_config=kafka_config,
            keys=keys,
            status_from_beginning=status_from_beginning,
            log=log,
            delivery_timeout=delivery_timeout,
        )
        self._waiters: dict[str, list[asyncio.Future[SagaStatus]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client._listen(self._on_status, self._waits_for, self._on_rejection)

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
        """As :meth:`SagaClient.from_env`: configured as the ``saga`` command is."""
        env = os.environ if environ is None else environ
        settings = env_settings(env, prefix=prefix, kafka_config=kafka_config)
        return cls(settings, keys=client_keys(keys, env), **options)

    @property
    def settings(self) -> KafkaSettings:
        return self._client.settings

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
        """As :meth:`SagaClient.submit`: returns the ``tx_id`` once Kafka has the request."""
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
        """Send pre-built requests, then wait for all their deliveries; returns their ids.

        Raises:
            SubmitUncertain: some were not confirmed; ``.tx_id`` names the first of them
                and ``.tx_ids`` all (the others were delivered). Send those again, with
                the same ids.
        """

        def send_all() -> list[str]:
            sent: list[tuple[str, Future[Delivered]]] = [
                (r.tx_id, self._client.send(r, wait_delivery=False)) for r in requests
            ]
            uncertain: list[SubmitUncertain] = []
            for tx_id, future in sent:
                try:
                    self._client._wait(future, tx_id)
                except SubmitUncertain as exc:
                    uncertain.append(exc)
            if uncertain:
                first = uncertain[0]
                raise SubmitUncertain(
                    first.tx_id,
                    f"{len(uncertain)} of {len(sent)} requests, see .tx_ids: {first.reason}",
                    tx_ids=tuple(e.tx_id for e in uncertain),
                )
            return [tx_id for tx_id, _ in sent]

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
        await asyncio.to_thread(lambda: self._client._view)  # started, off the event loop
        fut: asyncio.Future[SagaStatus] = self._loop.create_future()
        self._waiters.setdefault(tx_id, []).append(fut)
        # Final before we started waiting? (A transaction not followed yet is read: a thread.)
        current = await asyncio.to_thread(self._client.status, tx_id)
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
