"""What a client says at submit time about participants that never announced themselves.

A request naming a participant that has not announced itself on the participant
registry is still sent (the coordinator waits for the participant up to its grace,
:mod:`coordinator._known`), but a name that was *never* announced is most often a
typo: the client says so, with the nearest announced name (``difflib``), e.g.
"participant 'ledgr' has never announced itself on saga.participants; did you mean
'ledger'?". :class:`Announced` follows the registry for one client, started on first
use; a registry that cannot be read (Kafka unreachable, no such topic, no right to
read it) gives no hint, and never stops a submit.
"""

from __future__ import annotations

import difflib
import logging
import threading
import time
from collections.abc import Iterable
from typing import Final

from saga.streams import SagaError
from saga.streams._registry import ParticipantRegistry
from saga.streams._signing import Keyring
from saga.streams.log import Log

__all__ = ["Announced", "hints_for"]

log = logging.getLogger("saga.client")

_CATCH_UP_S: Final = 2.0  # the first read of the registry, at most
_REFRESH_EVERY_S: Final = 1.0  # an unknown name reads the registry again, at most this often
_RETRY_AFTER_S: Final = 30.0  # a registry that could not be read is tried again after


def hints_for(names: Iterable[str], known: frozenset[str], topic: str) -> list[tuple[str, str]]:
    """``(name, sentence)`` for each name in ``names`` outside ``known``, the sentence
    naming the nearest known name."""
    hints = []
    for name in sorted(set(names) - known):
        near = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hint = f"participant {name!r} has never announced itself on {topic}"
        if near:
            hint += f"; did you mean {near[0]!r}?"
        else:
            hint += (
                "; the coordinator waits for it for a while, then rolls the saga back "
                "(`saga participants` lists those that did)"
            )
        hints.append((name, hint))
    return hints


class Announced:
    """The participant names announced on the registry, as one client sees them."""

    def __init__(self, source: Log, keys: Keyring | None) -> None:
        self._source = source
        self._keys = keys
        self._lock = threading.Lock()
        self._registry: ParticipantRegistry | None = None
        self._failed_at: float | None = None
        self._refreshed_at = 0.0

    def hints(self, names: Iterable[str]) -> list[tuple[str, str]]:
        """``(name, sentence)`` for the names of ``names`` never announced (none when the
        registry cannot be read)."""
        wanted = set(names)
        with self._lock:
            registry = self._started()
            if registry is None:
                return []
            try:
                registry.poll(0)
                known = registry.names()
                now = time.monotonic()
                if not wanted <= known and now - self._refreshed_at >= _REFRESH_EVERY_S:
                    self._refreshed_at = now
                    registry.refresh(_CATCH_UP_S)
                    known = registry.names()
            except SagaError as exc:
                log.info("cannot read the participant registry for hints: %s", exc)
                return []
            return hints_for(wanted, known, registry.topic)

    def _started(self) -> ParticipantRegistry | None:
        if self._registry is not None:
            return self._registry
        if self._failed_at is not None and time.monotonic() - self._failed_at < _RETRY_AFTER_S:
            return None
        registry = ParticipantRegistry(
            self._source, keys=self._keys, client_id="saga.client.registry"
        )
        try:
            registry.start()
            registry.catch_up(_CATCH_UP_S)
        except SagaError as exc:
            log.info("cannot read the participant registry for hints: %s", exc)
            registry.close()
            self._failed_at = time.monotonic()
            return None
        self._registry = registry
        self._refreshed_at = time.monotonic()
        return registry

    def close(self) -> None:
        with self._lock:
            if self._registry is not None:
                self._registry.close()
                self._registry = None
