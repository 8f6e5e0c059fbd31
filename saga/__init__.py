"""saga: all-or-nothing changes across several stores, without two-phase commit.

A Saga/OLEP coordinator on Apache Kafka. The names most programs need are here::

    from saga import SagaClient, Step

    with SagaClient("127.0.0.1:19092") as client:     # or SagaClient.from_env()
        tx = client.submit([Step("ledger", "increment", {...})], saga="credit")
        status = client.result(tx)                     # committed, rolled_back or failed

Beneath this package: :mod:`saga.coordinator` (state machine, service, clients),
:mod:`saga.participants` (runtime, storage adapters, custom handlers),
:mod:`saga.streams` (wire contract, Kafka layer, reconciliation job) and
:mod:`saga.tools` (demo and bench).
"""

from saga.coordinator import AsyncSagaClient, SagaClient
from saga.streams import (
    BusinessRejection,
    ConfigurationError,
    ConflictingRequest,
    KafkaSettings,
    Mode,
    Outcome,
    SagaError,
    SagaState,
    SagaStatus,
    SagaTimeout,
    Step,
    StepStatus,
    SubmitUncertain,
    TransientError,
)

__all__ = [
    "AsyncSagaClient",
    "BusinessRejection",
    "ConfigurationError",
    "ConflictingRequest",
    "KafkaSettings",
    "Mode",
    "Outcome",
    "SagaClient",
    "SagaError",
    "SagaState",
    "SagaStatus",
    "SagaTimeout",
    "Step",
    "StepStatus",
    "SubmitUncertain",
    "TransientError",
]
