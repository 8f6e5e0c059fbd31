"""``saga bench``: the phases in order, then the report, the summary and the exit code."""

from __future__ import annotations

import json
import os
import time
from contextlib import suppress
from dataclasses import replace

from rich.console import Console

from saga.tools.bench.baselines import (
    DirectResult,
    LogResult,
    run_direct,
    run_log_bound,
    synthetic_records,
)
from saga.tools.bench.config import (
    COMPARED,
    HOT_RECORDS,
    NONE_SUFFIX,
    ROUND_MARK,
    SAGA_PHASES,
    SIGNED_MAIN,
    BenchConfig,
    is_signed,
    phase_level,
    signing_pairs,
)
from saga.tools.bench.phases import SagaPhaseResult, run_saga_phase
from saga.tools.bench.proc import infra_dir, service_pids
from saga.tools.bench.profile import py_spy
from saga.tools.bench.report import build_report, print_phase, print_summary
from saga.tools.bench.stores import check_services, drop_data


def run_bench(cfg: BenchConfig, console: Console) -> int:
    started = time.monotonic()
    console.rule("[bold]saga bench")
    console.print("Services:")
    check_services(cfg, console)
    services = service_pids(cfg)
    missing = [n for n, p in services.items() if p is None]
    if missing:
        console.print(
            f"  CPU of {', '.join(missing)}: n/a (not started by infra/services.sh "
            f"under {infra_dir()})"
        )
    console.print(
        f"Phases: {', '.join(cfg.phases)}; topics under [bold]{cfg.kafka.prefix}.<phase>[/] "
        f"({cfg.partitions} partitions); {cfg.accounts} accounts per store; "
        f"{cfg.workers} worker(s) per participant; logs in {cfg.logs}"
    )
    console.print(_signing_line(cfg.signing, cfg.signing_rounds))
    console.print(_isolation_line(cfg.isolation))
    if cfg.profile is not None:
        py_spy()  # missing: one sentence now, not after the first phases
        console.print(
            f"Profile: py-spy records every process of each main phase into {cfg.profile}"
        )
    console.print(
        "Layouts: " + "; ".join(f"[bold]{layout.name}[/] ({layout.spec})" for layout in cfg.layouts)
    )
    load_before = os.getloadavg()
    by_layout: dict[str, dict[str, SagaPhaseResult]] = {}
    directs: dict[str, DirectResult] = {}
    sample: list[tuple[bytes | None, bytes | None]] = []
    sample_per_saga: float | None = None
    log_bound: LogResult | None = None
    plan = {
        "main": ("closed", cfg.fail_share, cfg.duration),
        "latency": ("open", cfg.fail_share, cfg.latency_duration),
        "rollback": ("closed", cfg.rollback_fail_share, cfg.rollback_duration),
        "hot": ("closed", cfg.fail_share, cfg.hot_duration),
    }
    several = len(cfg.layouts) > 1
    try:
        for layout in cfg.layouts:
            if several:
                console.rule(f"layout {layout.name}: {layout.spec}")
            phases = by_layout.setdefault(layout.name, {})
            for i, name, kind in phase_order(cfg):
                mode, share, duration = plan[kind]
                signed = is_signed(cfg, name)
                result, records = run_saga_phase(
                    cfg, console, name, mode=mode, fail_share=share, duration=duration,
                    services=services, seed=cfg.seed + 1000 * i, layout=layout,
                    tag=f"{layout.name}.{name}" if several else name, signed=signed,
                    isolation=phase_level(cfg, name),
                    hot=HOT_RECORDS if kind == "hot" else None,
                )  # fmt: skip
                phases[name] = result
                print_phase(console, result)
                # The log bound's sample: the first layout's main phase, else any phase.
                first_main = name == "main" and layout is cfg.layouts[0]
                if records and result.records_per_saga and (not sample or first_main):
                    sample, sample_per_saga = records, result.records_per_saga
            if "direct" in cfg.phases:
                direct = directs[layout.name] = run_direct(cfg, layout, console, services)
                console.print(
                    f"  direct writes: {direct.sagas_per_s:,.0f} sagas/s "
                    f"({', '.join(f'{k} {v:,.0f}/s' for k, v in direct.writes_per_s.items())})"
                )
        if "log" in cfg.phases:
            measured = sample_per_saga is not None
            if not sample or sample_per_saga is None:
                sample, sample_per_saga = synthetic_records()
            log_bound = run_log_bound(cfg, console, sample, sample_per_saga, measured)
            console.print(
                f"  log bound: {log_bound.records_per_s:,.0f} records/s / "
                f"{log_bound.records_per_saga:g} records per saga = "
                f"{log_bound.sagas_per_s:,.0f} sagas/s"
            )
    finally:
        with suppress(Exception):
            drop_data(cfg)
    report = build_report(cfg, by_layout, directs, log_bound, started, load_before)
    cfg.report.parent.mkdir(parents=True, exist_ok=True)
    cfg.report.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(console, report)
    console.print(f"report: [bold]{cfg.report}[/]")
    runs = [r for layout, phases in by_layout.items() for r in _named(phases, layout, several)]
    warnings = [f"{r.name}: {r.unfinished:,} sagas unfinished" for r in runs if r.unfinished]
    warnings += [
        f"{r.name}: the system did not keep up with {r.offered_rate:g} sagas/s; "
        f"{r.shed:,} sagas were shed (not sent) in the window"
        for r in runs
        if r.shed
    ]
    warnings += [
        f"{r.name}: {r.unexpected_rollbacks:,} sagas rolled back that were meant to commit "
        "(deadline passed?)"
        for r in runs
        if r.unexpected_rollbacks
    ]
    problems = [f"{r.name}: {r.failed:,} sagas failed" for r in runs if r.failed]
    problems += [
        f"{r.name}: {r.forged_status:,} final status records without the coordinator's "
        "valid signature"
        for r in runs
        if r.forged_status
    ]
    problems += [
        f"{r.name}: the stores disagree with the committed sagas: {r.store_totals} "
        f"moved, {r.expected_total} expected"
        for r in runs
        if r.stores_agree is False
    ]
    for w in warnings:
        console.print(f"[bold yellow]{w}[/]")
    for p in problems:
        console.print(f"[bold red]{p}[/]")
    return 1 if problems else 0


def phase_order(cfg: BenchConfig) -> list[tuple[int, str, str]]:
    """``(seed index, phase name, kind)`` of each saga phase, in the order they run: a
    compared phase at level ``none`` (``--isolation both``) and the signed main phase
    (``--signing both``) right after the phase they are compared with; the rounds of
    ``--signing-rounds`` after it, alternately signed first and unsigned first."""
    order: list[tuple[int, str, str]] = []
    for i, name in enumerate(SAGA_PHASES):
        if name not in cfg.phases:
            continue
        order.append((i, name, name))
        if name == "main":
            # Alternated, so that a drift of the machine weighs on both sides alike.
            for n, (off, on) in enumerate(signing_pairs(cfg)):
                turn = (on, off) if n % 2 else (off, on)
                order += [(i, phase, name) for phase in turn if phase != name]
        if name in COMPARED and cfg.isolation == "both":
            order.append((i, name + NONE_SUFFIX, name))
    return order


def _named(phases: dict[str, SagaPhaseResult], layout: str, several: bool) -> list[SagaPhaseResult]:
    """The phases, named with their layout when the run has several (for the warnings)."""
    if not several:
        return list(phases.values())
    return [replace(r, name=f"{layout}/{r.name}") for r in phases.values()]


def _isolation_line(isolation: str) -> str:
    if isolation == "both":
        return (
            "Isolation: the main and latency phases run at read_committed, then again at "
            f"none (main{NONE_SUFFIX}, latency{NONE_SUFFIX}); the other phases at "
            "read_committed"
        )
    return f"Isolation: every saga at level {isolation}"


def _signing_line(signing: str, rounds: int = 1) -> str:
    if signing == "both" and rounds > 1:
        return (
            f"Signing: the main phase runs {rounds} times without and {rounds} times with a "
            f"key folder, alternately ({SIGNED_MAIN}, {SIGNED_MAIN}{ROUND_MARK}2, "
            f"main{ROUND_MARK}2, ...), the figures pooled; the other phases unsigned"
        )
    if signing == "both":
        return (
            "Signing: the main phase runs twice, without then with a key folder "
            f"({SIGNED_MAIN}); the other phases unsigned"
        )
    if signing == "on":
        return "Signing: on (every saga phase with a key folder of its own)"
    return "Signing: off (records are not signed)"
