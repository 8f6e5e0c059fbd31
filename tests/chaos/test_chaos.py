"""The chaos profiles as tests: ``make chaos-short`` (CI) and ``make chaos`` (long).

Each runs :func:`tests.chaos.runner.run_profile` against the local services
(which it kills and restarts: they must be the ones ``infra/services.sh`` started,
see ``SAGA_INFRA_DIR``), prints the report table and writes the JSON report
(``CHAOS_REPORT``, default ``reports/chaos.json``). ``CHAOS_SEED`` replays a run.

They pass when every count is 0 (no saga lost, no step applied twice, no split
decision, no write by a null compensation, no step applied after its rollback,
money conserved and never negative, every poison record in the DLQ exactly once
and no valid record there, every saga finished, and ``saga reconcile`` agreeing),
when both negative controls were detected, and when every fault type of the
profile was injected (the long profile: at least 20,000 sagas and 20 kills of
each component). Nothing here asserts on timing.

The isolation tier (:mod:`tests.chaos.iso_runner`, report ``reports/chaos-isolation.json``
or ``CHAOS_ISOLATION_REPORT``) passes when every count of its ``read_committed`` system
is 0 and its negative control (the same workload at level ``none``) shows dirty reads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests._infra import Services
from tests.chaos.iso_runner import ISO_PROFILES, run_isolation
from tests.chaos.runner import COMPONENTS, DEFAULT_REPORT, PROFILES, run_profile


def _run(services: Services, infra_mode: str, name: str) -> dict[str, Any]:
    if infra_mode != "local":
        pytest.fail(
            f"the chaos suite kills and restarts the local services of infra/services.sh; "
            f"SAGA_INFRA={infra_mode} services cannot be killed that way",
            pytrace=False,
        )
    seed = int(os.environ["CHAOS_SEED"]) if os.environ.get("CHAOS_SEED") else None
    default = (
        DEFAULT_REPORT if name != "hostile" else DEFAULT_REPORT.with_name("chaos-hostile.json")
    )
    report_path = Path(os.environ.get("CHAOS_REPORT") or default)
    return run_profile(services, PROFILES[name], seed=seed, report_path=report_path)


def _check(report: dict[str, Any]) -> None:
    bad = {name: n for name, n in report["counts"].items() if n}
    assert report["violations"] == 0, (bad, report["examples"])
    if report["profile"] == "hostile":
        assert report["requirements"]["no_unexpected_exits"], report["unexpected_exits"]
        assert report["requirements"]["min_poison"], report["poison"]
        assert report["passed"]
        return
    for name, control in report["negative_controls"].items():
        assert control["detected"], f"negative control {name} was not detected: {control}"
    assert report["negative_controls_detected"]
    assert not report["missing_fault_types"], report["missing_fault_types"]
    assert report["requirements"]["min_sagas"], report["sagas"]
    assert report["requirements"]["min_kills"], report["kills"]
    assert report["passed"]


@pytest.mark.chaos
@pytest.mark.timeout(1800)
def test_short_profile(services: Services, infra_mode: str) -> None:
    """Every fault type at least once; every count 0; both negative controls caught."""
    _check(_run(services, infra_mode, "short"))


@pytest.mark.chaos
@pytest.mark.timeout(1800)
def test_hostile_profile(services: Services, infra_mode: str) -> None:
    """At least 1,000 hostile records of every kind (over 20) mixed into 1,000 valid sagas on
    the three stores, no faults: every process stays up, every valid saga ends as designed,
    every hostile record is in the DLQ exactly once, and ``saga reconcile`` agrees."""
    report = _run(services, infra_mode, "hostile")
    assert report["sagas"]["submitted"] >= 1000
    _check(report)


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
def test_long_profile(services: Services, infra_mode: str) -> None:
    """At least 20,000 sagas and 20 kills of each component; every count 0."""
    report = _run(services, infra_mode, "long")
    assert report["sagas"]["submitted"] >= 20_000
    assert all(report["kills"][c] >= 20 for c in COMPONENTS), report["kills"]
    _check(report)


@pytest.mark.chaos
@pytest.mark.timeout(1800)
def test_isolation_profile(services: Services, infra_mode: str) -> None:
    """At least 2,000 sagas on at most 20 hot records per store, 30 % or more rolled back,
    a coordinator and every store's participant killed, a reader sampling the stores:
    no dirty read, no broken bound, no lost update, money conserved, I1-I4 (every count
    0); the same workload at level ``none`` must show dirty reads."""
    if infra_mode != "local":
        pytest.fail("the isolation tier kills the local processes; use SAGA_INFRA=local",
                    pytrace=False)  # fmt: skip
    seed = int(os.environ["CHAOS_SEED"]) if os.environ.get("CHAOS_SEED") else None
    default = DEFAULT_REPORT.with_name("chaos-isolation.json")
    path = Path(os.environ.get("CHAOS_ISOLATION_REPORT") or default)
    report = run_isolation(services, ISO_PROFILES["short"], seed=seed, report_path=path)
    main = report["main"]
    assert report["violations"] == 0, ({k: v for k, v in report["counts"].items() if v},
                                       main["examples"])  # fmt: skip
    assert report["negative_control_detected"], report["negative_control"]["counts"]
    assert all(report["requirements"].values()), report["requirements"]
    assert report["passed"]
