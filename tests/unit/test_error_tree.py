"""The error tree drawn in streams._errors is the one the classes form.

The drawing is read from the module's docstring, so the picture and the code
cannot drift apart: each drawn class has exactly the drawn parent and the drawn
``retryable``, and every public subclass of ``SagaError`` anywhere in coordinator,
participants and streams is drawn.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import pytest

import saga.streams
import saga.streams._errors
from saga.participants._refusals import StoreRefused
from saga.streams._errors import SagaError
from saga.streams.kafka import TransactionAborted
from saga.streams.reconcile import ReconcileError

# name -> (parent, retryable), as drawn.
EXPECTED: dict[str, tuple[str, bool]] = {
    "BusinessRejection": ("SagaError", False),
    "ConfigurationError": ("SagaError", False),
    "ConflictingRequest": ("SagaError", False),
    "FatalKafkaError": ("SagaError", False),
    "InvalidRecord": ("SagaError", False),
    "ReconcileError": ("ConfigurationError", False),
    "SagaTimeout": ("SagaError", True),
    "StoreRefused": ("BusinessRejection", False),
    "SubmitUncertain": ("TransientError", True),
    "TransactionAborted": ("TransientError", True),
    "TransientError": ("SagaError", True),
}

CLASSES: dict[str, type[SagaError]] = {
    "SagaError": SagaError,
    "BusinessRejection": saga.streams.BusinessRejection,
    "ConfigurationError": saga.streams.ConfigurationError,
    "ConflictingRequest": saga.streams.ConflictingRequest,
    "FatalKafkaError": saga.streams.FatalKafkaError,
    "InvalidRecord": saga.streams.InvalidRecord,
    "ReconcileError": ReconcileError,
    "SagaTimeout": saga.streams.SagaTimeout,
    "StoreRefused": StoreRefused,
    "SubmitUncertain": saga.streams.SubmitUncertain,
    "TransactionAborted": TransactionAborted,
    "TransientError": saga.streams.TransientError,
}

_DRAWN = re.compile(r"^(?P<lead>[ │]*)[├└]── (?P<name>\w+)\s+(?P<retry>yes|no)\b")


def _drawing() -> dict[str, tuple[str, bool]]:
    """The tree in the docstring of streams._errors, as name -> (parent, retryable)."""
    doc = saga.streams._errors.__doc__ or ""
    drawn: dict[str, tuple[str, bool]] = {}
    parents = ["SagaError"]  # parents[depth] is the class at that depth
    for line in doc.splitlines():
        match = _DRAWN.match(line.removeprefix("    "))
        if match is None:
            continue
        depth = len(match["lead"]) // 4 + 1
        name = match["name"]
        drawn[name] = (parents[depth - 1], match["retry"] == "yes")
        del parents[depth:]
        parents.append(name)
    return drawn


def test_the_drawing_is_the_expected_tree() -> None:
    assert _drawing() == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_class_has_its_drawn_parent_and_retryability(name: str) -> None:
    parent, retryable = EXPECTED[name]
    cls = CLASSES[name]
    assert cls.__name__ == name
    assert cls.__bases__ == (CLASSES[parent],)
    assert issubclass(cls, SagaError)
    assert cls.retryable is retryable


def test_the_root_is_an_exception_and_not_retryable() -> None:
    assert SagaError.__bases__ == (Exception,)
    assert SagaError.retryable is False


def _all_subclasses(cls: type[BaseException]) -> set[type[BaseException]]:
    found: set[type[BaseException]] = set()
    pending = [cls]
    while pending:
        for sub in pending.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                pending.append(sub)
    return found


def test_every_public_saga_error_is_drawn() -> None:
    project = ("coordinator", "participants", "streams")
    for package in project:
        root = importlib.import_module(f"saga.{package}")
        for info in pkgutil.walk_packages(root.__path__, f"saga.{package}."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    public = {
        cls.__name__
        for cls in _all_subclasses(SagaError)
        if cls.__module__.removeprefix("saga.").split(".")[0] in project
        and not cls.__name__.startswith("_")
    }
    assert public == set(EXPECTED)
