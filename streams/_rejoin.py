"""When a static group member fenced by its own instance id may rejoin in-process.

Kafka fences a static member (``group.instance.id``) with ``FENCED_INSTANCE_ID``
when another member joined with the same id. That is either a **real duplicate**
(a second live process with the id: the older must stop, or two processes own
one partition) or a **self-fence**: librdkafka issue #3437, where a broker fault
outlasting the session makes the member rejoin while the group coordinator
moves, the broker gives the id a new member id, and the member's own request
with the old one is fenced. The error is the same; nothing in it tells the two
apart, and the group's description does not either (a duplicate has the same
client id and, on one machine, the same host).

What does tell them apart is what happens after a rejoin. A self-fenced member
that rejoins with its id is alone with it again. A real duplicate is fenced back
by the rejoin, rejoins itself (its first fence), and so fences this member again
within a few seconds: two fences within :data:`REJOIN_WINDOW_S` mean a live
duplicate, and the member stops (raises) as before. The duplicate started later
was fenced only once and goes on, so the newer of the two keeps the id, as
without rejoining. Exactly-once never rested on this: the transactional producers
fence each other by epoch, and offsets sent with a stale member's generation are
refused.

The cost: a member self-fenced twice within the window (two broker faults in a
row) still stops, and its supervisor restarts it, as before this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

log = logging.getLogger("saga.kafka")

REJOIN_WINDOW_S: Final = 30.0
"""A second instance fence this soon after a rejoin means a live duplicate. A duplicate
fences back within a heartbeat and a join (seconds); broker faults that self-fence one
member come further apart on the chaos profiles (see README, Running on a cluster)."""

FENCED_TEXT: Final = "fenced by other consumer with same group.instance.id"
"""librdkafka's text for ``FENCED_INSTANCE_ID`` (its fatal event carries the generic
``_FATAL`` code with this text)."""


def is_instance_fence(code_name: str | None, text: str) -> bool:
    """Whether a consumer error is the broker fencing this static member's instance id."""
    return code_name == "FENCED_INSTANCE_ID" or FENCED_TEXT in text.lower()


class RejoinPolicy:
    """Decides, per consumer, whether an instance fence is ridden through by rejoining.

    :meth:`allow` is asked at each fence; true means: rejoin now with the same
    instance id (it also notes the time). False means a fence came within
    :data:`REJOIN_WINDOW_S` of the last rejoin: a live duplicate; stop.
    """

    def __init__(
        self,
        instance_id: str,
        *,
        window_s: float = REJOIN_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instance_id = instance_id
        self.window_s = window_s
        self._clock = clock
        self._last: float | None = None
        self.rejoins = 0

    def allow(self, reason: str) -> bool:
        """Whether to rejoin after the fence ``reason``; logs the decision."""
        now = self._clock()
        if self._last is not None and now - self._last < self.window_s:
            log.error(
                "fenced again %.1fs after rejoining with instance id %s: another live "
                "process has this id; stopping (%s)",
                now - self._last,
                self.instance_id,
                reason,
            )
            return False
        self._last = now
        self.rejoins += 1
        log.warning(
            "the broker fenced instance id %s (%s); no rejoin in the last %gs, so this is "
            "taken for librdkafka's self-fence after a broker fault: rejoining the group "
            "with the same id",
            self.instance_id,
            reason,
            self.window_s,
        )
        return True
