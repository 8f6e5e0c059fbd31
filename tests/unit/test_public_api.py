"""The public names of ``coordinator``, ``streams``, ``streams.log``, ``streams.reconcile``
and ``streams.testing``, pinned.

A name in ``__all__`` is a promise to users: adding one is a decision, removing
or renaming one breaks their imports. Each list below is written out in full so
that such a change shows up in review as an edit of this file, not as a side
effect of a refactoring. (``participants`` and ``streams.kafka`` are pinned by
their own tests.)
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

PINNED: dict[str, list[str]] = {
    "coordinator": [
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
    ],
    "streams": [
        "MAX_NAME_CHARS",
        "MAX_NESTING",
        "MAX_REASON_CHARS",
        "MAX_RECORD_BYTES",
        "MAX_SAGA_CHARS",
        "MAX_STEPS",
        "RECORD_TYPES",
        "SCHEMA_NAMES",
        "TX_ID_PATTERN",
        "WIRE_VERSION",
        "BusinessRejection",
        "ConfigurationError",
        "ConflictingRequest",
        "Decision",
        "FatalKafkaError",
        "InvalidRecord",
        "Isolation",
        "KafkaSettings",
        "Keyring",
        "Mode",
        "Outcome",
        "ParticipantAnnouncement",
        "ParticipantInfo",
        "ParticipantRegistry",
        "ParticipantState",
        "Record",
        "SagaAbort",
        "SagaError",
        "SagaRequest",
        "SagaResolve",
        "SagaState",
        "SagaStatus",
        "SagaTimeout",
        "SignedLog",
        "Step",
        "StepEvent",
        "StepProgress",
        "StepStatus",
        "StepsCommitted",
        "StorageKind",
        "SubmitUncertain",
        "Topics",
        "TransientError",
        "decode",
        "decode_announcement",
        "decode_as",
        "decode_keyed",
        "encode",
        "read_registry",
        "schema",
        "step_events",
        "to_dict",
    ],
    "saga.streams.reconcile": [
        "CLASSES",
        "DEFAULT_GRACE_MS",
        "INVARIANTS",
        "BusinessCheck",
        "LedgerSource",
        "ReconcileConfig",
        "ReconcileError",
        "RunResult",
        "StoreSpec",
        "TableSource",
        "parse_check",
        "parse_duration_ms",
        "parse_ledger",
        "parse_table",
        "run",
    ],
    "saga.streams.log": [
        "KafkaLog",
        "Log",
        "LogConsumer",
        "LogProducer",
        "LogTransactionalProducer",
        "RebalanceCallback",
    ],
    "saga.streams.testing": [
        "InMemoryConsumer",
        "InMemoryLog",
        "InMemoryProducer",
        "InMemoryTransactionalProducer",
        "KillAt",
        "Killed",
        "ManualClock",
        "Stepper",
        "key_on",
    ],
}


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("package", sorted(PINNED))
def test_all_is_exactly_the_pinned_list(package: str) -> None:
    exported = list(_module(package).__all__)
    assert exported == PINNED[package], (
        f"{package}.__all__ changed: added {sorted(set(exported) - set(PINNED[package]))}, "
        f"removed {sorted(set(PINNED[package]) - set(exported))}; if this is intended, "
        "update the pinned list (and the package docstring, and the changelog)"
    )


@pytest.mark.parametrize("package", sorted(PINNED))
def test_all_is_sorted_and_without_duplicates(package: str) -> None:
    # ruff's RUF022 order: SCREAMING_CASE constants, then CamelCase, then the rest.
    names = PINNED[package]
    assert len(set(names)) == len(names)

    def group(name: str) -> int:
        if name.isupper():
            return 0
        return 1 if name[0].isupper() else 2

    assert names == sorted(names, key=lambda n: (group(n), n))


@pytest.mark.parametrize("package", sorted(PINNED))
def test_every_exported_name_exists_and_is_public(package: str) -> None:
    module = _module(package)
    for name in module.__all__:
        assert not name.startswith("_"), f"{package} exports the private name {name}"
        assert hasattr(module, name), f"{package}.__all__ names {name}, which it lacks"
        value = getattr(module, name)
        assert not isinstance(value, ModuleType), f"{package}.{name} is a module, not an API"


@pytest.mark.parametrize("package", sorted(PINNED))
def test_star_import_gives_the_pinned_names(package: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {package} import *", namespace)
    assert sorted(n for n in namespace if n != "__builtins__") == sorted(PINNED[package])
