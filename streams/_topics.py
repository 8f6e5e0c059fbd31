"""Topic layout (docs/architecture.md §3): six topics whose names share one configurable prefix."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from saga.streams._errors import ConfigurationError

__all__ = ["Topics"]

# Kafka allows [A-Za-z0-9._-] in topic names, up to 249 characters; capping the
# prefix at 100 leaves room for the longest suffix and for test-run suffixes.
_PREFIX: Final = re.compile(r"[A-Za-z0-9._-]{1,100}")


@dataclass(frozen=True, slots=True)
class Topics:
    """The names of the topics of one deployment.

    ``Topics()`` gives ``saga.requests``, ``saga.events``, ``saga.decisions``,
    ``saga.status``, ``saga.dlq`` and ``saga.participants``; ``Topics("test-42")`` gives
    ``test-42.requests`` and so on, which lets several deployments (or test
    runs) share one cluster.

    Raises:
        ConfigurationError: ``prefix`` is not 1 to 100 characters of
            A-Z, a-z, 0-9, '.', '_' and '-'.
    """

    prefix: str = "saga"

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or _PREFIX.fullmatch(self.prefix) is None:
            raise ConfigurationError(
                f"topic prefix {self.prefix!r} is not allowed: use 1 to 100 characters "
                "of A-Z, a-z, 0-9, '.', '_' and '-'"
            )

    @property
    def requests(self) -> str:
        """Requests and operator aborts (``saga.request``, ``saga.abort``)."""
        return f"{self.prefix}.requests"

    @property
    def events(self) -> str:
        """Participants' step events (``saga.step``)."""
        return f"{self.prefix}.events"

    @property
    def decisions(self) -> str:
        """The coordinator's decisions (``saga.decision``)."""
        return f"{self.prefix}.decisions"

    @property
    def status(self) -> str:
        """Latest state per transaction (``saga.status``); compacted."""
        return f"{self.prefix}.status"

    @property
    def dlq(self) -> str:
        """Dead letters: rejected records' bytes, with headers naming the error."""
        return f"{self.prefix}.dlq"

    @property
    def participants(self) -> str:
        """The participant registry (``saga.participant``, key ``<name>/<instance>``); compacted."""
        return f"{self.prefix}.participants"

    @property
    def all(self) -> tuple[str, ...]:
        """Every topic, in the order above."""
        return (
            self.requests,
            self.events,
            self.decisions,
            self.status,
            self.dlq,
            self.participants,
        )

    @property
    def compacted(self) -> tuple[str, ...]:
        """The topics that need ``cleanup.policy=compact``: status and the participant registry."""
        return (self.status, self.participants)
