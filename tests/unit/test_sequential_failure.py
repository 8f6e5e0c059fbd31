"""A sequential rollback stuck behind a failed compensation ends ``failed``, not ``rolling_back``.

In a sequential saga step ``i`` is compensated only after step ``i + 1``; when that
compensation failed (a ``none`` saga whose record changed since), the steps before it
wait for an operator. The saga must say so (``failed``), or nobody is told.
"""

from __future__ import annotations

import pytest

from saga.coordinator._sequential import blocked_by_failure
from saga.streams import Mode, SagaState, StepStatus
from tests.unit.test_machine import CREATED, abort, ev, feed, live, received, request

pytestmark = pytest.mark.unit

A, F, C = StepStatus.APPLIED, StepStatus.COMPENSATION_FAILED, StepStatus.COMPENSATED


def test_the_applied_steps_before_a_failed_compensation_are_blocked() -> None:
    assert blocked_by_failure([A, A, F]) == {0, 1}
    assert blocked_by_failure([A, F, C]) == {0}
    assert blocked_by_failure([A, C, F]) == set()  # step 1's successor failed, step 1 is done
    assert blocked_by_failure([A, A, C]) == set()
    assert blocked_by_failure([F, A]) == set()


@pytest.mark.parametrize("mode", [Mode.SEQUENTIAL, Mode.PARALLEL])
def test_a_failed_middle_compensation_makes_the_saga_failed(mode: Mode) -> None:
    saga, _ = feed(
        None,
        received(request(3, mode=mode)),
        ev(0, A, at=CREATED + 2),
        ev(1, A, at=CREATED + 3),
        abort("stop", at=CREATED + 4),
        ev(2, C, at=CREATED + 5),
        ev(1, F, at=CREATED + 6, reason="accounts/k changed since this step wrote it"),
    )
    state = live(saga).state
    if mode is Mode.SEQUENTIAL:
        # Step 0 waits for step 1, which will not be compensated until an operator acts.
        assert state is SagaState.FAILED
        assert "operator" in (live(saga).reason or "")
    else:
        # In parallel, step 0 is compensated on its own: the saga still rolls back.
        assert state is SagaState.ROLLING_BACK
