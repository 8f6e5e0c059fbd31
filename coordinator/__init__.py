"""The coordinator side of saga: the state machine, the service and the client library.

Public API::

    SagaClient, AsyncSagaClient   submit sagas, wait for results, abort
    StatusView                    follow the status topic
    CoordinatorService            the coordinator process (``saga coordinator run``)
    decide, Saga                  the pure state machine
"""

from coordinator._client import AsyncSagaClient, SagaClient, StatusView
from coordinator._machine import (
    AbortRequested,
    Ignored,
    RequestReceived,
    Saga,
    StepReported,
    Tick,
    decide,
)
from coordinator._service import CoordinatorService, CoordinatorStats

__all__ = [
    "AbortRequested",
    "AsyncSagaClient",
    "CoordinatorService",
    "CoordinatorStats",
    "Ignored",
    "RequestReceived",
    "Saga",
    "SagaClient",
    "StatusView",
    "StepReported",
    "Tick",
    "decide",
]
