"""A participant worker fenced by its own instance id rejoins in-process and goes on.

librdkafka's self-fence (issue #3437; streams._rejoin): the worker's consumer loses its
partitions (the runtime's ``on_lost``), rejoins with the same id, reads on from the
committed offsets, and the ledger makes what it reads again harmless.
"""

from __future__ import annotations

import pytest

from saga.streams import Mode, Outcome, StepStatus
from saga.streams.testing import InMemoryConsumer, InMemoryLog, ManualClock
from tests.unit.test_participant_runtime_unit import (  # noqa: F401 (fixtures)
    Runtimes,
    balance,
    database,
    decide,
    log,
    move,
    reported,
    runtimes,
    shop_step,
    sqlite_storage,
    submit,
    tx_on,
)

pytestmark = pytest.mark.unit


def test_a_worker_fenced_by_its_own_id_rejoins_and_applies_each_step_once(
    log: InMemoryLog,  # noqa: F811
    clock: ManualClock,
    runtimes: Runtimes,  # noqa: F811
    database: str,  # noqa: F811
) -> None:
    runtime, stepper = runtimes.start(sqlite_storage(database), worker_id="w1")
    first = tx_on(0)
    submit(log, clock, first, [move(), shop_step()], Mode.PARALLEL)
    stepper.step()
    assert reported(log, first) == [(0, StepStatus.APPLIED)]
    consumer = runtime._consumer
    assert isinstance(consumer, InMemoryConsumer)
    assert consumer.group_instance_id is not None
    log._leave(consumer)  # the broker dropped the member...
    consumer.replaced = True  # ...and fenced its id, with no other process holding it
    second = tx_on(1)
    submit(log, clock, second, [move(), shop_step()], Mode.PARALLEL)
    # a rollback, not a commit: a built-in step at `none` (submit's default) has nothing
    # to confirm, so only a rollback shows the decision read after the rejoin acted on, once
    decide(log, clock, first, Outcome.ROLLBACK)
    stepper.step(4)
    assert stepper.running, "the worker exited"
    assert consumer.rejoins == 1
    assert reported(log, first) == [(0, StepStatus.APPLIED), (0, StepStatus.COMPENSATED)]
    assert reported(log, second) == [(0, StepStatus.APPLIED)]
    assert balance(database) == 105
