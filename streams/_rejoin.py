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

What does tell them apart is what happens after a rejoin. A real duplicate is
fenced back by the rejoin, rejoins itself, and fences this member again within
seconds, again and again: :data:`FENCES_TO_STOP` fences in a row, each within
:data:`REJOIN_WINDOW_S` of the rejoin before it, mean a live duplicate, and the
member stops (raises) as before. Of two live processes the one fenced first (the
older, fenced by the newer's start) gets there first; the newer goes on. A
self-fence can repeat while the group coordinator settles (the three-broker chaos
profile saw a second one 9-21 s after a rejoin), but not that many times in a row.
Exactly-once never rested on this: the transactional producers fence each other by
epoch, and offsets sent with a stale member's generation are refused.

The cost: a member self-fenced that many times in a row still stops, and its
supervisor restarts it, as before this module; a duplicate runs on for the few
seconds of the exchange.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

log = logging.getLogger("saga.kafka")

REJOIN_WINDOW_S: Final = 30.0
"""A fence this soon after a rejoin continues the streak; a later one starts a new one."""

FENCES_TO_STOP: Final = 4
"""Fences in a row that stop the member: a duplicate fences back every few seconds."""

FENCED_TEXT: Final = "fenced by other consumer with same group.instance.id"
"""librdkafka's text for ``FENCED_INSTANCE_ID`` (its fatal event carries the generic
``_FATAL`` code with this text)."""


def is_instance_fence(code_name: str | None, text: str) -> bool:
    """Whether a consumer error is the broker fencing this static member's instance id."""
    return code_name == "FENCED_INSTANCE_ID" or FENCED_TEXT in text.lower()


class RejoinPolicy:
    """Decides, per consumer, whether an instance fence is ridden through by rejoining.

    :meth:`allow` is asked at each fence; true means: rejoin now with the same
    instance id. False means this fence ends a streak of :data:`FENCES_TO_STOP`,
    each within :data:`REJOIN_WINDOW_S` of the rejoin before it: a live duplicate;
    stop.
    """

    def __init__(
        self,
        instance_id: str,
        *,
        window_s: float = REJOIN_WINDOW_S,
        fences_to_stop: int = FENCES_TO_STOP,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instance_id = instance_id
        self.window_s = window_s
        self.fences_to_stop = fences_to_stop
        self._clock = clock
        self._last: float | None = None
        self._streak = 0
        self.rejoins = 0

    def allow(self, reason: str) -> bool:
        """Whether to rejoin after the fence ``reason``; logs the decision."""
        now = self._clock()
        quick = self._last is not None and now - self._last < self.window_s
        self._streak = self._streak + 1 if quick else 1
        if self._streak >= self.fences_to_stop:
            log.error(
                "fenced %d times in a row, each within %gs of rejoining, with instance id "
                "%s: another live process has this id; stopping (%s)",
                self._streak,
                self.window_s,
                self.instance_id,
                reason,
            )
            return False
        self._last = now
        self.rejoins += 1
        log.warning(
            "the broker fenced instance id %s (%s), %d time(s) in a row: taken for "
            "librdkafka's self-fence after a broker fault, rejoining the group with the "
            "same id",
            self.instance_id,
            reason,
            self._streak,
        )
        return True
