"""`saga bench --layout` and `--profile`: parsing, the report's shape and the py-spy summary.

No services: the layouts are parsed, a report is built from phase results made
here and rendered, and a collapsed-stack file written here is summarised.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from saga.streams import ConfigurationError
from saga.streams.kafka import KafkaSettings
from saga.tools.bench.config import (
    DEFAULT_LAYOUT,
    LAYOUTS,
    BenchConfig,
    Layout,
    parse_layout,
)
from saga.tools.bench.cpu import role
from saga.tools.bench.phases import SagaPhaseResult
from saga.tools.bench.profile import summarise
from saga.tools.bench.report import build_report, print_summary


def test_named_layouts_and_specs() -> None:
    assert parse_layout("default") is DEFAULT_LAYOUT
    pg = parse_layout("pg-wallet")
    assert pg.kind("wallet") == "sql" and pg.kind("bank") == "sql" and pg.kind("rewards") == "redis"
    # A spec equal to a named layout is that layout; aliases name the same store.
    assert parse_layout("bank=postgres,wallet=pg,rewards=redis") is LAYOUTS["pg-wallet"]
    assert parse_layout("wallet=mongo") is DEFAULT_LAYOUT  # the others keep their store


def test_custom_layout_is_named_by_its_stores() -> None:
    layout = parse_layout("bank=redis, wallet=ferretdb, rewards=postgresql")
    assert layout.name == "redis-ferret-pg"
    assert layout.kind("bank") == "redis" and layout.kind("rewards") == "sql"
    assert layout.spec == "bank=redis,wallet=ferretdb,rewards=postgres"


@pytest.mark.parametrize("text", ["fast", "wallet=oracle", "shop=postgres", "bank=postgres,wallet"])
def test_a_wrong_layout_says_what_to_write(text: str) -> None:
    with pytest.raises(ConfigurationError, match="--layout"):
        parse_layout(text)


def test_each_layout_once() -> None:
    settings = KafkaSettings("127.0.0.1:1", "p")
    with pytest.raises(ConfigurationError, match="each --layout once"):
        BenchConfig(settings, "", "", "", layouts=(DEFAULT_LAYOUT, DEFAULT_LAYOUT))
    with pytest.raises(ConfigurationError, match="--profile"):
        BenchConfig(settings, "", "", "", phases=("direct",), profile=Path("x"))


def _phase(name: str, layout: Layout, rate: float, cpu: dict[str, float]) -> SagaPhaseResult:
    r = SagaPhaseResult(
        name=name, mode="closed", fail_share=0.2 if name == "rollback" else 0.0,
        warmup_s=1, duration_s=10, offered_rate=None, window=100,
        layout=layout.name, stores=dict(layout.stores),
    )  # fmt: skip
    r.sagas_per_s = rate
    r.completed_in_window = int(rate * 10)
    r.cpu_s_per_saga = {k: v / 1000 for k, v in cpu.items()}
    r.cpu_cores_used = dict.fromkeys(cpu, 0.1)
    r.decision_latency_ms = r.completion_latency_ms = {
        "p50": 1.0, "p95": 2.0, "p99": 3.0, "max": 4.0, "n": 1,
    }  # fmt: skip
    return r


def test_report_keeps_every_layout_and_the_first_at_the_top() -> None:
    settings = KafkaSettings("127.0.0.1:1", "p")
    pg = LAYOUTS["pg-wallet"]
    cfg = BenchConfig(settings, "", "", "", layouts=(DEFAULT_LAYOUT, pg))
    cpu_default = {"coordinator": 0.5, "wallet#0 (mongo)": 1.0, "ferretdb": 3.0}
    cpu_pg = {"coordinator": 0.4, "wallet#0 (sql)": 0.6, "ferretdb": 0.0}
    by_layout = {
        "default": {
            "main": _phase("main", DEFAULT_LAYOUT, 200, cpu_default),
            "rollback": _phase("rollback", DEFAULT_LAYOUT, 100, cpu_default),
        },
        "pg-wallet": {"main": _phase("main", pg, 800, cpu_pg)},
    }
    report = build_report(cfg, by_layout, {}, None, 0.0, (0.0, 0.0, 0.0))
    assert report["sagas_per_s"] == 200 and report["rollback_ratio"] == 0.5
    assert set(report["phases"]) == {"main", "rollback"}  # the first layout's, as before
    pg_figures = report["layouts"]["pg-wallet"]
    assert pg_figures["sagas_per_s"] == 800 and pg_figures["stores"]["wallet"] == "postgres"
    assert pg_figures["cpu_ms_per_saga_by_role"] == {
        "coordinator": 0.4, "wallet": 0.6, "ferretdb": 0.0,
    }  # fmt: skip
    assert report["layouts"]["default"]["cpu_ms_per_saga_total"] == 4.5
    assert report["parameters"]["layouts"]["pg-wallet"] == pg.spec
    checks = {(c["layout"], c["target"]): c for c in report["targets"]}
    main_pg = checks[("pg-wallet", "wallet on PostgreSQL: sagas/s, main")]
    assert main_pg["value"] == 800 and main_pg["ok"] is True  # at least 800
    assert checks[("default", "default layout: sagas/s, main")]["ok"] is False  # 200 < 400
    assert checks[("default", "default layout: rollback / main")]["ok"] is True  # 0.5
    shed = checks[("pg-wallet", "open loop, wallet on PostgreSQL: shed")]
    assert shed["value"] is None and shed["ok"] is None  # no open-loop phase ran

    out = io.StringIO()
    print_summary(Console(file=out, width=80), report)
    text = out.getvalue()
    assert "layouts side by side" in text and "pg-wallet" in text and "must-holds" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_role_of_a_process() -> None:
    assert role("bank#0 (sql)") == "bank"
    assert role("client (bench)") == "client"
    assert role("kafka") == "kafka"


def test_summarise_collapsed_stacks() -> None:
    raw = "\n".join(
        [
            "<module> (m.py:1);run (participants/_runtime.py:10);send (x.py:5) 6",
            "<module> (m.py:1);run (participants/_runtime.py:12);decode (streams/_codec.py:3) 3",
            "<module> (m.py:1);run (participants/_runtime.py:10);send (x.py:7) 1",
            "garbage line",
        ]
    )
    selfs, totals, samples = summarise(raw)
    assert samples == 10
    assert selfs["send (x.py)"] == 7 and selfs["decode (streams/_codec.py)"] == 3
    assert totals["run (participants/_runtime.py)"] == 10  # once per stack, lines merged
