"""The coordinator side of saga: the state machine, the service and the client library.

Public API::

    SagaClient, AsyncSagaClient   submit sagas, wait for results, abort
    Delivered                     where Kafka wrote a request (SagaClient.send's future)
    StatusView                    follow the status topic
    CoordinatorService            the coordinator process (``saga coordinator run``)
    CoordinatorStats              what a running service counted
    decide, Saga                  the pure state machine
    RequestReceived, StepReported,
    AbortRequested, Tick          its inputs
    Ignored                       its note for an input that changes nothing

See docs/architecture.md for how these fit together.
"""

from saga.coordinator._client import Delivered, SagaClient
from saga.coordinator._client_async import AsyncSagaClient
from saga.coordinator._machine import (
    AbortRequested,
    Ignored,
    RequestReceived,
    Saga,
    StepReported,
    Tick,
    decide,
)
from saga.coordinator._service import CoordinatorService, CoordinatorStats
from saga.coordinator._status_view import StatusView

__all__ = [
    "AbortRequested",
    "AsyncSagaClient",
    "CoordinatorService",
    "CoordinatorStats",
    "Delivered",
    "Ignored",
    "RequestReceived",
    "Saga",
    "SagaClient",
    "StatusView",
    "StepReported",
    "Tick",
    "decide",
]
