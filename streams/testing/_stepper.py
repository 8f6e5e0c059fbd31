"""Driving a service loop from a test: kill hooks and one poll at a time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Self

from saga.streams.kafka import partition_for
from saga.streams.testing._log import InMemoryLog
from saga.streams.testing._model import Killed, _Gate


class KillAt:
    """Fault hooks (:class:`streams._faults.Faults`) that kill at the ``nth`` pass of ``point``.

    The kill is :meth:`InMemoryLog.kill` of the calling thread, then :class:`Killed`
    raised out of the service. ``nth=None`` starts disarmed: :meth:`arm` chooses the
    pass later (e.g. the next one). ``switches`` are the unsafe test switches reported on.
    """

    def __init__(
        self,
        log: InMemoryLog,
        point: str,
        nth: int | None = 1,
        *,
        switches: Iterable[str] = (),
    ) -> None:
        self.log = log
        self.point = point
        self.nth = nth
        self.passes = 0
        self.switches = frozenset(switches)

    def arm(self, passes: int = 1) -> None:
        """Kill at the ``passes``-th pass from now (1: the next one)."""
        self.nth = self.passes + passes

    def hit(self, point: str) -> None:
        if point != self.point:
            return
        self.passes += 1
        if self.passes == self.nth:
            self.log.kill()
            raise Killed(f"killed at {point}")

    def unsafe(self, switch: str) -> bool:
        return switch in self.switches

    @property
    def fired(self) -> bool:
        return self.nth is not None and self.passes >= self.nth


class Stepper:
    """Runs a service loop (``run``) in a thread that stops at each poll of its group consumer.

    ``start()`` runs it to its first poll; ``step(n)`` lets it through ``n`` polls
    (each poll and what the service does with it) and returns once it waits at the
    next one, so the test and the service never run at once. An exception the
    service dies of is raised by the call that lets it happen; :class:`Killed` is
    not (see :attr:`killed`).
    """

    def __init__(
        self,
        log: InMemoryLog,
        run: Callable[[], object],
        *,
        stop: Callable[[], None] | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.log = log
        self._run = run
        self._stop = stop
        self.timeout = timeout
        self._gate = _Gate()
        self.error: BaseException | None = None
        self.killed = False
        self._reported = False
        self._thread = threading.Thread(target=self._main, name="stepper", daemon=True)

    def _main(self) -> None:
        self.log._gates[threading.get_ident()] = self._gate
        try:
            self._run()
        except Killed:
            self.killed = True
        except BaseException as exc:
            self.error = exc
        finally:
            # Thread ids are reused: the next thread with this one's id is alive.
            self.log._gates.pop(threading.get_ident(), None)
            self.log._dead_threads.discard(threading.get_ident())
            with self._gate.cond:
                self._gate.done = True
                self._gate.cond.notify_all()

    @property
    def running(self) -> bool:
        return not self._gate.done

    def _wait(self, parks: int) -> None:
        gate = self._gate
        if not gate.cond.wait_for(lambda: gate.done or gate.parks >= parks, self.timeout):
            raise TimeoutError(f"the service did not reach its next poll within {self.timeout}s")

    def _raise(self) -> None:
        if self.error is not None and not self._reported:
            self._reported = True
            raise self.error

    def start(self) -> Self:
        with self._gate.cond:
            self._thread.start()
            self._wait(1)
        self._raise()
        return self

    def step(self, polls: int = 1) -> None:
        for _ in range(polls):
            with self._gate.cond:
                if self._gate.done:
                    break
                target = self._gate.parks + 1
                self._gate.permits += 1
                self._gate.cond.notify_all()
                self._wait(target)
        self._raise()

    def _finish(self) -> None:
        with self._gate.cond:
            while not self._gate.done:
                target = self._gate.parks + 1
                self._gate.permits += 1
                self._gate.cond.notify_all()
                self._wait(target)
        self._thread.join(self.timeout)

    def stop(self) -> None:
        """Ask the service to stop, let it finish its loop and wait for its thread."""
        if self._stop is not None:
            self._stop()
        self._finish()
        self._raise()

    def kill(self) -> None:
        """Kill the service where it waits (:meth:`InMemoryLog.kill` of its thread)."""
        if self._thread.ident is not None and not self._gate.done:
            self.log.kill(self._thread.ident)
        self._finish()
        self._raise()


def key_on(partition: int, partitions: int, n: int = 0, *, prefix: str = "tx-") -> str:
    """The ``n``-th key ``<prefix><i>`` that goes to ``partition`` of ``partitions``.

    For tests that need a transaction on a chosen partition (keys are placed as
    Kafka places them: :func:`streams.kafka.partition_for`).
    """
    found = 0
    for i in range(1_000_000):
        key = f"{prefix}{i}"
        if partition_for(key, partitions) == partition:
            if found == n:
                return key
            found += 1
    raise ValueError(f"no key of the form {prefix}<i> on partition {partition} of {partitions}")
