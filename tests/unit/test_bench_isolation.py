"""`saga bench --isolation` and the hot phase: options, phase order, workload, report.

No services: the command's options are parsed with the run replaced, the phases are
ordered, the workload's requests inspected, and a report is built from phase results
made here and rendered within 80 columns.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
from click.testing import CliRunner
from rich.console import Console

from saga.streams import ConfigurationError, Isolation
from saga.streams.kafka import KafkaSettings
from saga.tools.bench.config import (
    DEFAULT_LAYOUT,
    HOT_RECORDS,
    LAYOUTS,
    BenchConfig,
    Layout,
    account,
    is_signed,
    phase_level,
)
from saga.tools.bench.phases import SagaPhaseResult
from saga.tools.bench.report import build_report, print_summary, signing_figures
from saga.tools.bench.run import phase_order
from saga.tools.bench.workload import Workload

pytestmark = pytest.mark.unit

SETTINGS = KafkaSettings("127.0.0.1:1", "p")


def _cfg(**kw: Any) -> BenchConfig:
    return BenchConfig(SETTINGS, "", "", "", **kw)


def test_the_command_passes_isolation_and_the_hot_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    from saga.tools import bench
    from saga.tools.cli import bench as command

    seen: list[BenchConfig] = []
    monkeypatch.setattr(bench, "run_bench", lambda cfg, console: seen.append(cfg) or 0)
    urls = ["--postgres-url", "pg", "--mongo-url", "mg", "--redis-url", "rd"]
    args = ["--bootstrap", "127.0.0.1:1", *urls]
    result = CliRunner().invoke(command, [*args, "--isolation", "both", "--hot-duration", "5"])
    assert result.exit_code == 0, result.output
    assert seen[0].isolation == "both" and seen[0].hot_duration == 5
    assert "hot" in seen[0].phases  # in the default phases
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 0 and seen[1].isolation == "read_committed"
    result = CliRunner().invoke(command, [*args, "--isolation", "serializable"])
    assert result.exit_code == 2 and "--isolation" in result.output


def test_a_wrong_isolation_says_what_to_write() -> None:
    with pytest.raises(ConfigurationError, match="--isolation 'dirty'"):
        _cfg(isolation="dirty")
    with pytest.raises(ConfigurationError, match="keep main or latency"):
        _cfg(isolation="both", phases=("rollback", "hot"))
    _cfg(isolation="both", phases=("latency",))  # one compared phase is enough


def test_phase_order_and_levels() -> None:
    both = _cfg(isolation="both", signing="both")
    names = [name for _, name, _ in phase_order(both)]
    assert names == [
        "main", "main-signed", "main-none", "latency", "latency-none", "rollback", "hot",
    ]  # fmt: skip
    # The level-none run of a phase repeats its workload (same seed index and kind).
    assert [(i, kind) for i, name, kind in phase_order(both) if name == "main-none"] == [
        (0, "main")
    ]
    assert [phase_level(both, n) for n in names] == [
        "read_committed", "read_committed", "none", "read_committed", "none",
        "read_committed", "read_committed",
    ]  # fmt: skip
    none = _cfg(isolation="none", phases=("main", "hot"))
    assert [name for _, name, _ in phase_order(none)] == ["main", "hot"]
    assert phase_level(none, "hot") == "none"


def test_the_workload_asks_for_its_level_on_hot_records() -> None:
    hot = Workload(accounts=10_000, fail_share=0.0, seed=1, tx_prefix="t", timeout_s=60,
                   isolation="none", hot=HOT_RECORDS)  # fmt: skip
    keys = set()
    for _ in range(300):
        request, _, _ = hot.next()
        assert request.isolation is Isolation.NONE
        keys |= {s.args["key"] for s in request.steps}
    assert keys == {account(i) for i in range(HOT_RECORDS)}
    uniform, _, _ = Workload(accounts=10_000, fail_share=0.0, seed=1, tx_prefix="t",
                             timeout_s=60).next()  # fmt: skip
    assert uniform.isolation is Isolation.READ_COMMITTED


def _phase(
    name: str, layout: Layout, rate: float, cpu: dict[str, float], **kw: Any
) -> SagaPhaseResult:
    open_loop = name.startswith("latency")
    r = SagaPhaseResult(
        name=name, mode="open" if open_loop else "closed", fail_share=0.0, warmup_s=1,
        duration_s=10, offered_rate=400 if open_loop else None,
        window=None if open_loop else 100, layout=layout.name, stores=dict(layout.stores),
        **kw,
    )  # fmt: skip
    r.sagas_per_s = rate
    r.completed_in_window = r.sent_in_window = int(rate * 10)
    r.cpu_s_per_saga = {k: v / 1000 for k, v in cpu.items()}
    r.cpu_cores_used = dict.fromkeys(cpu, 0.1)
    p99 = 90.0 if name.endswith("-none") else 120.0
    r.decision_latency_ms = r.completion_latency_ms = {
        "p50": 40.0, "p95": 80.0, "p99": p99, "max": 200.0, "n": 1,
    }  # fmt: skip
    return r


def test_report_puts_the_levels_side_by_side_with_the_hot_phase() -> None:
    pg = LAYOUTS["pg-wallet"]
    cfg = _cfg(isolation="both", layouts=(DEFAULT_LAYOUT, pg))
    cpu_rc = {"coordinator": 0.4, "bank#0 (sql)": 0.3, "postgres": 0.2}
    cpu_none = {"coordinator": 0.4, "bank#0 (sql)": 0.2, "postgres": 0.1}
    by_layout = {}
    for layout, rc, none, hot in ((DEFAULT_LAYOUT, 400, 500, 150), (pg, 1500, 1800, 1000)):
        by_layout[layout.name] = {
            "main": _phase("main", layout, rc, cpu_rc),
            "main-none": _phase("main-none", layout, none, cpu_none, isolation="none"),
            "latency": _phase("latency", layout, 399, cpu_rc),
            "latency-none": _phase("latency-none", layout, 400, cpu_none, isolation="none"),
            "hot": _phase("hot", layout, hot, cpu_rc, hot_records=HOT_RECORDS),
        }
    report = build_report(cfg, by_layout, {}, None, 0.0, (0.0, 0.0, 0.0))
    default = report["layouts"]["default"]
    iso = default["isolation"]
    assert iso["throughput_ratio"] == default["isolation_ratio"] == 0.8
    assert iso["cpu_ms_per_saga_total"] == {"read_committed": 0.9, "none": 0.7}
    assert iso["cpu_ms_per_saga"]["none"] == {"coordinator": 0.4, "bank": 0.2, "postgres": 0.1}
    assert iso["open_loop"]["none"]["p99_ms"] == 90.0
    assert iso["open_loop"]["read_committed"]["p99_ms"] == 120.0
    assert default["hot"]["ratio_to_main"] == default["hot_ratio"] == 0.375
    checks = {(c["layout"], c["target"]): c["ok"] for c in report["targets"]}
    assert checks[("default", "#28 default: rc / none sagas/s")] is True  # 0.8 >= 0.7
    assert checks[("default", "#28 default: hot records / main")] is False  # 0.375 < 0.5
    assert checks[("pg-wallet", "#28 wallet on PostgreSQL: hot / main")] is True
    assert report["parameters"]["isolation"] == "both"

    out = io.StringIO()
    print_summary(Console(file=out, width=80), report)
    text = out.getvalue()
    assert "read_committed (rc) and none side by side" in text
    assert "0.800 x" in text and "0.375 x" in text and "120 ms" in text and "90 ms" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_one_level_reports_the_hot_phase_alone() -> None:
    cfg = _cfg(isolation="none", phases=("main", "hot"))
    phases = {
        "main": _phase("main", DEFAULT_LAYOUT, 400, {"coordinator": 0.4}, isolation="none"),
        "hot": _phase("hot", DEFAULT_LAYOUT, 300, {"coordinator": 0.5}, isolation="none",
                      hot_records=HOT_RECORDS),
    }  # fmt: skip
    report = build_report(cfg, {"default": phases}, {}, None, 0.0, (0.0, 0.0, 0.0))
    assert report["isolation"] == {"mode": "none"} and report["isolation_ratio"] is None
    assert report["hot"]["ratio_to_main"] == 0.75 and report["hot"]["isolation"] == "none"
    out = io.StringIO()
    print_summary(Console(file=out, width=80), report)
    assert "hot (10 records) sagas/s" in out.getvalue()


def test_signing_rounds_alternate_and_pool() -> None:
    cfg = _cfg(signing="both", signing_rounds=3, phases=("main",))
    assert [name for _, name, _ in phase_order(cfg)] == [
        "main", "main-signed", "main-signed-r2", "main-r2", "main-r3", "main-signed-r3",
    ]  # fmt: skip
    assert [is_signed(cfg, n) for _, n, _ in phase_order(cfg)] == [
        False, True, True, False, False, True,
    ]  # fmt: skip
    # Every round repeats the main phase's workload, unsigned or signed.
    assert {(i, kind) for i, _, kind in phase_order(cfg)} == {(0, "main")}
    with pytest.raises(ConfigurationError, match="--signing both"):
        _cfg(signing="on", signing_rounds=2)
    layout = LAYOUTS["default"]
    cpu = {"coordinator": 1.0, "kafka": 2.0}  # ms per saga
    phases = {
        "main": _phase("main", layout, 100.0, cpu),
        "main-signed": _phase("main-signed", layout, 50.0, cpu),
        "main-signed-r2": _phase("main-signed-r2", layout, 100.0, {**cpu, "coordinator": 2.0}),
        "main-r2": _phase("main-r2", layout, 100.0, cpu),
        "main-r3": _phase("main-r3", layout, 100.0, cpu),
        # round 3's signed run is missing (a phase that did not run): that round is left out
    }
    figures = signing_figures(cfg, phases)
    assert figures is not None
    assert [r["throughput_ratio"] for r in figures["rounds"]] == [0.5, 1.0]
    # Pooled: 1,500 signed sagas in 20 s against 2,000 unsigned in 20 s.
    assert figures["sagas_per_s"] == {"off": 100.0, "on": 75.0}
    assert figures["throughput_ratio"] == 0.75
    # CPU weighs each round by its sagas: (1 ms x 500 + 2 ms x 1,000) / 1,500.
    assert figures["cpu_ms_per_saga"]["on"]["coordinator"] == round(2500 / 1500, 3)
    assert figures["cpu_ms_per_saga"]["off"]["coordinator"] == 1.0
    one = signing_figures(_cfg(signing="both", phases=("main",)), phases)
    assert one is not None and one["throughput_ratio"] == 0.5 and len(one["rounds"]) == 1
    text = io.StringIO()
    report = build_report(cfg, {"default": phases}, {}, None, 0.0, (0.0, 0.0, 0.0))
    print_summary(Console(file=text, width=80), report)
    assert "0.500, 1.000" in text.getvalue()
