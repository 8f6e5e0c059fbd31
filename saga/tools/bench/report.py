"""The bench's JSON report and its rendering as two tables (within 80 columns)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.table import Table

from saga.tools.bench.baselines import DirectResult, LogResult
from saga.tools.bench.config import PARTICIPANTS, BenchConfig, signing_pairs
from saga.tools.bench.cpu import cpu_ms as _cpu_ms
from saga.tools.bench.cpu import cpu_ms_by_role
from saga.tools.bench.isolation import hot_figures, isolation_figures, print_isolation
from saga.tools.bench.phases import SagaPhaseResult


def _git_commit() -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(dirty)}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 3)


def _total_ms(per_process: Mapping[str, float | None]) -> float:
    return round(sum(v for v in per_process.values() if v is not None), 3)


def signing_figures(
    cfg: BenchConfig, phases: Mapping[str, SagaPhaseResult]
) -> dict[str, Any] | None:
    """What signing costs (``--signing both``): the main phase without and with a key
    folder, side by side: sagas/s, CPU ms per saga per process, and the ratios. With
    several rounds (``--signing-rounds``), each side pools its rounds: its sagas over
    its seconds, its CPU over its sagas; ``rounds`` keeps each round's own figures."""
    if cfg.signing != "both":
        return {"mode": cfg.signing} if cfg.signing == "on" else None
    pairs = [
        (off, on)
        for off, on in ((phases.get(a), phases.get(b)) for a, b in signing_pairs(cfg))
        if off is not None and on is not None
    ]
    if not pairs:
        return {"mode": "both"}
    offs, ons = [off for off, _ in pairs], [on for _, on in pairs]
    off_rate, on_rate = _pooled_rate(offs), _pooled_rate(ons)
    off_ms, on_ms = _pooled_cpu_ms(offs), _pooled_cpu_ms(ons)
    delta: dict[str, float | None] = {}
    for name, value in on_ms.items():
        before = off_ms.get(name)
        delta[name] = None if value is None or before is None else round(value - before, 3)
    return {
        "mode": "both",
        "phases": {"off": offs[0].name, "on": ons[0].name},
        "rounds": [
            {
                "phases": {"off": off.name, "on": on.name},
                "sagas_per_s": {"off": off.sagas_per_s, "on": on.sagas_per_s},
                "throughput_ratio": _ratio(on.sagas_per_s, off.sagas_per_s),
            }
            for off, on in pairs
        ],
        "sagas_per_s": {"off": off_rate, "on": on_rate},
        "throughput_ratio": _ratio(on_rate, off_rate),
        "cpu_ms_per_saga": {"off": off_ms, "on": on_ms, "delta": delta},
        "cpu_ms_per_saga_total": {"off": _total_ms(off_ms), "on": _total_ms(on_ms)},
        "cpu_ratio": _ratio(_total_ms(on_ms), _total_ms(off_ms)),
        "decision_p99_ms": {
            "off": max(_p99s(offs), default=None),
            "on": max(_p99s(ons), default=None),
        },
    }


def _pooled_rate(runs: list[SagaPhaseResult]) -> float:
    """Sagas completed per second over every run (one run: its own sagas/s)."""
    if len(runs) == 1:
        return runs[0].sagas_per_s
    seconds = sum(r.duration_s for r in runs)
    return round(sum(r.completed_in_window for r in runs) / seconds, 1) if seconds > 0 else 0.0


def _pooled_cpu_ms(runs: list[SagaPhaseResult]) -> dict[str, float | None]:
    """CPU ms per saga per process over every run: each run weighs by its sagas."""
    if len(runs) == 1:
        return _cpu_ms(runs[0])
    sagas = sum(r.completed_in_window for r in runs)
    out: dict[str, float | None] = {}
    for name in _cpu_ms(runs[0]):
        values = [r.cpu_s_per_saga.get(name) for r in runs]
        if sagas <= 0 or any(v is None for v in values):
            out[name] = None
        else:
            spent = sum(
                (v or 0.0) * r.completed_in_window for v, r in zip(values, runs, strict=True)
            )
            out[name] = round(1000 * spent / sagas, 3)
    return out


def _p99s(runs: list[SagaPhaseResult]) -> list[float]:
    return [p for r in runs if (p := r.decision_latency_ms.get("p99")) is not None]


def layout_figures(
    cfg: BenchConfig,
    layout: str,
    phases: Mapping[str, SagaPhaseResult],
    direct: DirectResult | None,
    log_bound: LogResult | None,
) -> dict[str, Any]:
    """The headline figures of one layout's phases, its direct-write baseline and ratios."""
    main = phases.get("main")
    latency = phases.get("latency") or main
    rollback = phases.get("rollback")
    sagas_per_s = main.sagas_per_s if main else None
    direct_rate = direct.sagas_per_s if direct else None
    log_rate = log_bound.sagas_per_s if log_bound else None
    rollback_rate = rollback.sagas_per_s if rollback else None
    records_per_saga = (
        main.records_per_saga if main else (log_bound.records_per_saga if log_bound else None)
    )
    stores = next(iter(phases.values())).stores if phases else {}
    isolation, hot = isolation_figures(cfg, phases), hot_figures(phases)
    signing = signing_figures(cfg, phases)
    return {
        "layout": layout,
        "stores": stores,
        "sagas_per_s": sagas_per_s,
        "decision_latency_ms": latency.decision_latency_ms if latency else None,
        "completion_latency_ms": latency.completion_latency_ms if latency else None,
        "latency_phase": latency.name if latency else None,
        "latency_shed": latency.shed if latency else None,
        "direct_write_sagas_per_s": direct_rate,
        "log_bound_sagas_per_s": log_rate,
        "rollback_sagas_per_s": rollback_rate,
        "rollback_ratio": _ratio(rollback_rate, sagas_per_s),
        "direct_write_ratio": _ratio(sagas_per_s, direct_rate),
        "log_bound_ratio": _ratio(sagas_per_s, log_rate),
        "cpu_s_per_saga": main.cpu_s_per_saga if main else None,
        "cpu_ms_per_saga_by_role": cpu_ms_by_role(main) if main else None,
        "cpu_ms_per_saga_total": _total_ms(_cpu_ms(main)) if main else None,
        "cpu_cores_used": main.cpu_cores_used if main else None,
        "records_per_saga": records_per_saga,
        "signing": signing,
        "signing_ratio": (signing or {}).get("throughput_ratio"),
        "isolation": isolation,
        "isolation_ratio": (isolation or {}).get("throughput_ratio"),
        "hot": hot,
        "hot_ratio": hot["ratio_to_main"] if hot else None,
        "profile": main.profile if main else None,
        "phases": {name: r.as_json() for name, r in phases.items()},
        "direct_write": direct.as_json() if direct else None,
    }


TARGETS: Final = (
    # (layout, figure, bound, at least?, what the issue asks)
    ("pg-wallet", "sagas_per_s", 800.0, True, "wallet on PostgreSQL: sagas/s, main"),
    ("pg-wallet", "cpu_ms_per_saga_total", 2.5, False, "wallet on PostgreSQL: CPU ms/saga"),
    ("default", "sagas_per_s", 400.0, True, "default layout: sagas/s, main"),
    ("pg-wallet", "latency_p99", 100.0, False, "open loop, wallet on PostgreSQL: p99 ms"),
    ("pg-wallet", "latency_shed", 0.0, False, "open loop, wallet on PostgreSQL: shed"),
    ("default", "rollback_ratio", 0.5, True, "default layout: rollback / main"),
    ("pg-wallet", "rollback_ratio", 0.5, True, "wallet on PostgreSQL: rollback / main"),
    ("default", "isolation_ratio", 0.7, True, "#28 default: rc / none sagas/s"),
    ("pg-wallet", "isolation_ratio", 0.7, True, "#28 wallet on PostgreSQL: rc / none"),
    ("default", "hot_ratio", 0.5, True, "#28 default: hot records / main"),
    ("pg-wallet", "hot_ratio", 0.5, True, "#28 wallet on PostgreSQL: hot / main"),
    ("default", "signing_ratio", 0.8, True, "#32 default: signed / unsigned sagas/s"),
    ("pg-wallet", "signing_ratio", 0.8, True, "#32 wallet on PostgreSQL: signed / unsigned"),
)
"""Issue #14's must-holds 1-4, issue #28's cost figures (read_committed keeps 0.7 of
none's throughput; the hot-record phase 0.5 of the main phase's) and issue #32's
(signed records keep 0.8 of the unsigned main phase's throughput), checked against the
layouts of the same name."""


def targets(layouts: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each must-hold of :data:`TARGETS` whose layout ran: its value and whether it holds
    (``None``: the figure is missing, e.g. its phase did not run)."""
    out: list[dict[str, Any]] = []
    for layout, figure, bound, at_least, what in TARGETS:
        figures = layouts.get(layout)
        if figures is None:
            continue
        if figure == "latency_p99":
            value = (figures.get("decision_latency_ms") or {}).get("p99")
            if figures.get("latency_phase") != "latency":
                value = None  # the open-loop phase did not run
        elif figure == "latency_shed":
            value = figures.get(figure) if figures.get("latency_phase") == "latency" else None
        else:
            value = figures.get(figure)
        ok = None if value is None else (value >= bound if at_least else value <= bound)
        out.append(
            {"target": what, "layout": layout, "value": value, "bound": bound,
             "at_least": at_least, "ok": ok}
        )  # fmt: skip
    return out


def build_report(
    cfg: BenchConfig,
    by_layout: Mapping[str, Mapping[str, SagaPhaseResult]],
    directs: Mapping[str, DirectResult],
    log_bound: LogResult | None,
    started: float,
    load_before: tuple[float, float, float],
) -> dict[str, Any]:
    """The report: the first layout's figures at the top level (as with one layout),
    every layout's under ``layouts``, then the log bound and the run's parameters."""
    layouts = {
        name: layout_figures(cfg, name, phases, directs.get(name), log_bound)
        for name, phases in by_layout.items()
    }
    first: dict[str, Any] = next(iter(layouts.values()), {"phases": {}})
    return {
        **first,
        "layouts": layouts,
        "targets": targets(layouts),
        "log_bound": log_bound.as_json() if log_bound else None,
        "parameters": {
            "phases": list(cfg.phases),
            "layouts": {layout.name: layout.spec for layout in cfg.layouts},
            "prefix": cfg.kafka.prefix,
            "warmup_s": cfg.warmup,
            "duration_s": cfg.duration,
            "latency_duration_s": cfg.latency_duration,
            "rollback_duration_s": cfg.rollback_duration,
            "baseline_duration_s": cfg.baseline_duration,
            "rate": cfg.rate,
            "window": cfg.window,
            "fail_share": cfg.fail_share,
            "rollback_fail_share": cfg.rollback_fail_share,
            "partitions": cfg.partitions,
            "workers": cfg.workers,
            "accounts": cfg.accounts,
            "batch": cfg.batch,
            "saga_timeout_s": cfg.saga_timeout,
            "steps_per_saga": len(PARTICIPANTS),
            "signing": cfg.signing,
            "signing_rounds": cfg.signing_rounds,
            "isolation": cfg.isolation,
            "hot_duration_s": cfg.hot_duration,
            "profile": None if cfg.profile is None else str(cfg.profile),
        },
        "machine": {
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "git": _git_commit(),
        "wall_s": round(time.monotonic() - started, 1),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# --------------------------------------------------------------------------- output


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f} ms"


def _num(v: float | None, unit: str = "") -> str:
    return "n/a" if v is None else f"{v:,.1f}{unit}"


def _ms2(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _ratio_text(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def print_phase(console: Console, r: SagaPhaseResult) -> None:
    console.print(
        f"  {r.name}: {r.sagas_per_s:,.1f} sagas/s over {r.duration_s:g} s "
        f"({r.committed_in_window} committed, {r.rolled_back_in_window} rolled back); "
        f"decision p99 {_ms(r.decision_latency_ms.get('p99'))}"
    )
    if r.settled_cores is not None:
        console.print(
            f"    (waited {r.settled_s:g} s before it for the services to settle: "
            f"{r.settled_cores:.2f} cores then)"
        )


def _latency_cell(key: str, q: str) -> Callable[[Mapping[str, Any]], str]:
    return lambda r: _ms(r[key][q])


def _agree_text(r: Mapping[str, Any]) -> str:
    if r["stores_agree"] is None:
        return "n/a"
    return "yes" if r["stores_agree"] else "[red]NO[/]"


def _mode_text(r: Mapping[str, Any]) -> str:
    if r["window"]:
        return f"closed, {r['window']:,}"
    return f"open, {r['offered_rate']:g}/s"


def _cpu_cell(r: Mapping[str, Any], name: str) -> str:
    per_saga, cores = r["cpu_s_per_saga"].get(name), r["cpu_cores_used"].get(name)
    if per_saga is None or cores is None:
        return "n/a"
    return f"{1000 * per_saga:.2f} ({cores:.2f})"


def print_summary(console: Console, report: Mapping[str, Any]) -> None:
    """Per layout the figures of every phase (one column each); with several layouts
    their headline figures side by side; then the baselines and the ratios.

    Kept within 80 columns, so that it reads in a plain terminal and in a log file.
    """
    layouts: Mapping[str, Any] = report.get("layouts") or {"": report}
    for name, figures in layouts.items():
        title = "saga bench: the measured window of each phase"
        _print_phases(console, f"{title} ({name})" if len(layouts) > 1 else title, figures)
    if len(layouts) > 1:
        _print_side_by_side(console, layouts)
    print_isolation(console, layouts)
    _print_baselines(console, report, layouts)
    _print_targets(console, report.get("targets") or [])


def _print_targets(console: Console, checks: list[Mapping[str, Any]]) -> None:
    """Issue #14's must-holds that this run measured, each with ok / NO."""
    if not checks:
        return
    table = Table(title="issue #14 and #28 must-holds (this run)")
    table.add_column("target")
    table.add_column("value", justify="right")
    table.add_column("bound", justify="right")
    table.add_column("", justify="center")
    for c in checks:
        value, bound = c["value"], c["bound"]
        verdict = "n/a" if c["ok"] is None else ("ok" if c["ok"] else "[red]NO[/]")
        table.add_row(
            c["target"],
            "n/a" if value is None else f"{value:,.3g}" if value < 10 else f"{value:,.0f}",
            f"{'>=' if c['at_least'] else '<='} {bound:g}",
            verdict,
        )
    console.print(table)


def _print_phases(console: Console, title: str, figures: Mapping[str, Any]) -> None:
    phases: Mapping[str, Any] = figures["phases"]
    if not phases:
        return
    table = Table(title=title)
    table.add_column("figure")
    for name in phases:
        table.add_column(name, justify="right")
    rows: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = [
        ("loop, in flight or rate", _mode_text),
        ("failure share", lambda r: f"{r['fail_share']:.0%}"),
        ("window", lambda r: f"{r['duration_s']:.1f} s"),
        ("sent (per s)", lambda r: f"{r['sent_in_window']:,} ({r['send_rate']:,.0f})"),
        ("shed (overloaded)", lambda r: f"{r['shed']:,}"),
        ("completed", lambda r: f"{r['completed_in_window']:,}"),
        (
            "  committed/rolled back",
            lambda r: f"{r['committed_in_window']:,}/{r['rolled_back_in_window']:,}",
        ),
        ("[bold]sagas/s[/]", lambda r: f"[bold]{r['sagas_per_s']:,.1f}[/]"),
    ]
    for kind in ("decision", "completion"):
        for q in ("p50", "p95", "p99", "max"):
            rows.append((f"{kind} {q}", _latency_cell(f"{kind}_latency_ms", q)))
    rows += [
        ("log records per saga", lambda r: _num(r["records_per_saga"])),
        ("  without tx markers", lambda r: _num(r["records_per_saga_without_markers"])),
        ("unfinished/failed", lambda r: f"{r['unfinished']}/{r['failed']}"),
        ("stores agree", _agree_text),
    ]
    for label, get in rows:
        table.add_row(label, *(get(r) for r in phases.values()))
    cpu_names: list[str] = []
    for r in phases.values():
        cpu_names += [n for n in r["cpu_s_per_saga"] if n not in cpu_names]
    table.add_section()
    table.add_row("[bold]CPU ms/saga (cores)[/]", *("" for _ in phases))
    for n in cpu_names:
        table.add_row(f"  {n}", *(_cpu_cell(r, n) for r in phases.values()))
    table.add_row(
        "  total",
        *(
            f"{1000 * sum(v for v in r['cpu_s_per_saga'].values() if v is not None):.2f} "
            f"({sum(v for v in r['cpu_cores_used'].values() if v is not None):.2f})"
            for r in phases.values()
        ),
    )
    console.print(table)


def _print_side_by_side(console: Console, layouts: Mapping[str, Any]) -> None:
    """The issue's figures of each layout in one column each (the main phase's CPU)."""
    table = Table(title="layouts side by side")
    table.add_column("figure")
    for name in layouts:
        table.add_column(name, justify="right")
    stores = [(p, [str(f["stores"].get(p, "?")) for f in layouts.values()]) for p in PARTICIPANTS]
    for p, cells in stores:
        table.add_row(f"{p} on", *cells)

    def phase(f: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
        found: Mapping[str, Any] | None = f["phases"].get(name)
        return found

    def rate(name: str) -> Callable[[Mapping[str, Any]], str]:
        return lambda f: "n/a" if (r := phase(f, name)) is None else f"{r['sagas_per_s']:,.1f}"

    def latency(q: str) -> Callable[[Mapping[str, Any]], str]:
        def cell(f: Mapping[str, Any]) -> str:
            r = phase(f, "latency")
            return "n/a" if r is None else _ms(r["decision_latency_ms"].get(q))

        return cell

    def shed(f: Mapping[str, Any]) -> str:
        r = phase(f, "latency")
        return "n/a" if r is None else f"{r['shed']:,} of {r['sent_in_window'] + r['shed']:,}"

    rows: list[tuple[str, Callable[[Mapping[str, Any]], str]]] = [
        ("[bold]main sagas/s[/]", rate("main")),
        ("rollback sagas/s", rate("rollback")),
        ("rollback / main", lambda f: _ratio_text(f["rollback_ratio"])),
        ("open loop: decision p50", latency("p50")),
        ("open loop: decision p99", latency("p99")),
        ("open loop: shed", shed),
        ("direct-write sagas/s", lambda f: _num(f["direct_write_sagas_per_s"])),
        ("main / direct writes", lambda f: _ratio_text(f["direct_write_ratio"])),
        ("main / log bound", lambda f: _ratio_text(f["log_bound_ratio"])),
    ]
    for label, get in rows:
        table.add_row(label, *(get(f) for f in layouts.values()))
    table.add_section()
    table.add_row("[bold]CPU ms/saga, main[/]", *("" for _ in layouts))
    roles: list[str] = []
    for f in layouts.values():
        roles += [n for n in f.get("cpu_ms_per_saga_by_role") or {} if n not in roles]
    for n in roles:
        table.add_row(
            f"  {n}",
            *(_ms2((f.get("cpu_ms_per_saga_by_role") or {}).get(n)) for f in layouts.values()),
        )
    table.add_row(
        "  [bold]total[/]",
        *(f"[bold]{_ms2(f.get('cpu_ms_per_saga_total'))}[/]" for f in layouts.values()),
    )
    console.print(table)


def _print_baselines(
    console: Console, report: Mapping[str, Any], layouts: Mapping[str, Any]
) -> None:
    """The direct writes of each layout, the log bound, and (with one layout) the ratios
    (with several, the ratios are in the side-by-side table)."""
    base = Table(title="baselines and ratios")
    base.add_column("figure")
    base.add_column("value", justify="right")
    several = len(layouts) > 1
    for name, figures in layouts.items():
        direct = figures.get("direct_write")
        if not direct:
            continue
        if several:
            base.add_row(f"[bold]direct writes, layout {name}[/]", "")
        for store, rate in direct["writes_per_s"].items():
            base.add_row(
                f"direct writes {store} (batches of {direct['batch']})", f"{rate:,.0f} writes/s"
            )
        base.add_row(
            "[bold]direct-write sagas/s[/] (slowest store)",
            f"[bold]{direct['sagas_per_s']:,.0f}[/]",
        )
        for n, v in direct["cpu_s_per_saga"].items():
            base.add_row(f"  CPU ms/saga {n}", "n/a" if v is None else f"{1000 * v:.3f}")
        if several:
            base.add_section()
    log_bound = report.get("log_bound")
    if log_bound:
        base.add_row(
            "log produce + consume",
            f"{log_bound['records_per_s']:,.0f} records/s of {log_bound['record_bytes']:.0f} B",
        )
        base.add_row(
            "records per saga" + ("" if log_bound["records_per_saga_measured"] else " (estimated)"),
            f"{log_bound['records_per_saga']:g}",
        )
        base.add_row("[bold]log-bound sagas/s[/]", f"[bold]{log_bound['sagas_per_s']:,.0f}[/]")
    for name, figures in layouts.items():
        tag = f" ({name})" if several else ""
        signing = figures.get("signing") or {}
        if signing.get("throughput_ratio") is not None:
            rates, totals = signing["sagas_per_s"], signing["cpu_ms_per_saga_total"]
            base.add_row(
                f"sagas/s unsigned / signed{tag}", f"{rates['off']:,.1f} / {rates['on']:,.1f}"
            )
            base.add_row(
                f"CPU ms/saga unsigned / signed{tag}", f"{totals['off']:.2f} / {totals['on']:.2f}"
            )
            base.add_row(
                f"[bold]signed / unsigned sagas/s[/]{tag}",
                f"[bold]{signing['throughput_ratio']:.3f}[/]",
            )
            rounds = signing.get("rounds") or []
            if len(rounds) > 1:
                base.add_row(
                    f"  each round{tag}",
                    ", ".join(_ratio_text(r["throughput_ratio"]) for r in rounds),
                )
    if not several:
        figures = next(iter(layouts.values()))
        base.add_row("sagas/s (main)", _num(figures["sagas_per_s"]))
        base.add_row("rollback sagas/s", _num(figures["rollback_sagas_per_s"]))
        for label, key in (
            ("rollback / main", "rollback_ratio"),
            ("main / direct writes", "direct_write_ratio"),
            ("main / log bound", "log_bound_ratio"),
        ):
            base.add_row(label, _ratio_text(figures[key]))
    console.print(base)
    for name, figures in layouts.items():
        profile = figures.get("profile")
        if profile:
            where = profile.get("summary", profile.get("folder"))
            console.print(f"profile{f' ({name})' if several else ''}: {where}")
