"""``saga.resolve`` in the pure state machine: an operator closes a failed compensation.

A resolve is honoured only for a saga in ``failed`` and a step whose compensation
failed; the step becomes ``resolved`` and, once no failed step is left, the saga is
``rolled_back`` with a reason naming who resolved it. Anything else is ``Ignored``
(the service sends it to the DLQ with that reason).
"""

from __future__ import annotations

import pytest

from saga.coordinator._machine import ResolveRequested, Saga, decide, tx_of
from saga.streams import SagaResolve, SagaState, SagaStatus, StepStatus, decode, encode
from tests.unit.test_machine import (
    CREATED,
    TX,
    abort,
    decisions,
    ev,
    feed,
    ignored,
    live,
    started,
    statuses,
)

pytestmark = pytest.mark.unit


def resolve(
    step: int, by: str = "ann@host", tx: str = TX, at: int = CREATED + 900
) -> ResolveRequested:
    return ResolveRequested(SagaResolve(tx, step, "refunded by hand", by, at))


def failed_saga(failing: tuple[int, ...] = (0,), n: int = 2) -> Saga:
    """A saga of ``n`` steps, step 0 applied, aborted; ``failing`` compensations failed."""
    saga, _ = feed(started(n), ev(0, StepStatus.APPLIED), abort("stop"))
    for i in range(n):
        status = StepStatus.COMPENSATION_FAILED if i in failing else StepStatus.COMPENSATED
        saga, _ = feed(saga, ev(i, status, at=CREATED + 50))
    assert live(saga).state is SagaState.FAILED
    return live(saga)


def test_resolving_the_failed_step_rolls_the_saga_back() -> None:
    saga, out = decide(failed_saga(), resolve(0))

    assert decisions(out) == []  # the decision stands: it was a rollback
    (status,) = statuses(out)
    assert status.state is SagaState.ROLLED_BACK
    assert [s.status for s in status.steps] == [StepStatus.RESOLVED, StepStatus.COMPENSATED]
    assert (
        status.reason
        == "aborted by operator: stop; failed compensation resolved by hand by ann@host"
    )
    assert status.updated_ms == CREATED + 900
    assert decode(encode(status)) == status  # "resolved" is on the wire
    assert (
        Saga.from_status(status) == live(saga)
        or Saga.from_status(status).state is SagaState.ROLLED_BACK
    )


def test_the_saga_stays_failed_until_every_failed_step_is_resolved() -> None:
    saga, out = decide(failed_saga((0, 1)), resolve(1))
    assert live(saga).state is SagaState.FAILED
    assert live(saga).steps == (StepStatus.COMPENSATION_FAILED, StepStatus.RESOLVED)
    assert (live(saga).reason or "").endswith(
        "compensation of step(s) [0] failed: an operator must act"
    )
    assert len(statuses(out)) == 1

    saga, out = decide(saga, resolve(0, by="bob"))
    assert live(saga).state is SagaState.ROLLED_BACK
    assert (live(saga).reason or "").endswith("by hand by bob")
    assert "operator must act" not in (live(saga).reason or "")


@pytest.mark.parametrize(
    ("saga_of", "step", "why"),
    [
        (lambda: None, 0, "knows no such saga"),
        (lambda: started(2), 0, "it is pending, not failed"),
        (failed_saga, 1, "step 1 has no failed compensation"),
        (failed_saga, 7, "step 7 has no failed compensation"),
    ],
)
def test_a_resolve_of_anything_else_is_ignored_with_a_reason(
    saga_of: object, step: int, why: str
) -> None:
    before = saga_of()  # type: ignore[operator]
    saga, out = decide(before, resolve(step))
    assert saga == before
    (note,) = ignored(out)
    assert why in note.reason and note.tx_id == TX
    assert statuses(out) == [] and decisions(out) == []


def test_a_second_resolve_of_the_same_step_is_ignored() -> None:
    saga, _ = decide(failed_saga(), resolve(0))
    again, out = decide(saga, resolve(0))
    assert again == saga
    assert "rolled_back, not failed" in ignored(out)[0].reason


def test_a_retried_compensation_after_a_resolve_changes_nothing() -> None:
    saga, _ = decide(failed_saga(), resolve(0))
    after, out = decide(saga, ev(0, StepStatus.COMPENSATED, at=CREATED + 999))
    assert after == saga and out == []


def test_tx_of_names_the_resolved_transaction() -> None:
    assert tx_of(resolve(0, tx="other")) == "other"
    assert isinstance(failed_saga().status(), SagaStatus)
