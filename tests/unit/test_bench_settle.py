"""saga bench waits before each saga phase until the services fall near idle, within a bound."""

from __future__ import annotations

import pytest

from saga.tools.bench.proc import settle

pytestmark = pytest.mark.unit


class _Services:
    """Fake services: ``cores[i]`` cores used during the i-th second of waiting."""

    def __init__(self, cores: list[float]) -> None:
        self.cores = cores
        self.t = 0.0
        self.used = 0.0

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        second = min(int(self.t), len(self.cores) - 1)
        self.used += self.cores[second] * s
        self.t += s

    def cpu_s(self, pid: int) -> float:
        return self.used / 2  # two pids share it


def _settle(services: _Services, timeout_s: float) -> tuple[float, float | None]:
    return settle(
        {"kafka": 1, "postgres": 2, "redis": None},
        idle_cores=0.15,
        timeout_s=timeout_s,
        clock=services.clock,
        sleep=services.sleep,
        cpu_s=services.cpu_s,
    )


def test_it_waits_until_two_quiet_seconds_in_a_row() -> None:
    busy = _Services([0.9, 0.7, 0.1, 0.5, 0.05, 0.1, 0.9])
    assert _settle(busy, 60) == (6.0, 0.1)


def test_quiet_services_cost_two_seconds() -> None:
    assert _settle(_Services([0.02]), 60) == (2.0, 0.02)


def test_the_wait_is_bounded() -> None:
    assert _settle(_Services([0.8]), 5) == (5.0, 0.8)


def test_nothing_to_measure_or_no_bound_waits_not_at_all() -> None:
    assert settle({"kafka": None}, idle_cores=0.15, timeout_s=60) == (0.0, None)
    assert settle({"kafka": 1}, idle_cores=0.15, timeout_s=0) == (0.0, None)
