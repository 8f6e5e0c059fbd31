"""Sequential rollbacks that cannot go on: steps stuck behind a failed compensation.

In a sequential saga a step is compensated only after its successor was (the deck's
reverse order). When a successor's compensation failed, the steps before it wait for
an event that will not come until an operator acts; the saga is then ``failed``
(an operator must act), not ``rolling_back`` for ever.
"""

from __future__ import annotations

from collections.abc import Sequence

from saga.streams import StepStatus


def blocked_by_failure(steps: Sequence[StepStatus]) -> frozenset[int]:
    """The applied steps whose compensation waits on a successor that failed to compensate.

    Step ``j`` is blocked when it is ``applied`` and the first step after it that is not
    ``applied`` ended ``compensation_failed``.
    """
    blocked: set[int] = set()
    behind_failure = False
    for index in range(len(steps) - 1, -1, -1):
        status = steps[index]
        if status is StepStatus.COMPENSATION_FAILED:
            behind_failure = True
        elif status is StepStatus.APPLIED:
            if behind_failure:
                blocked.add(index)
        else:
            behind_failure = False
    return frozenset(blocked)
