"""What isolation costs: the figures of ``--isolation both`` and of the hot-record phase.

``--isolation both`` runs the main phase (closed loop) and the latency phase (open loop
at ``--rate``) at ``read_committed`` and again at ``none`` (``main-none``,
``latency-none``), one right after the other on fresh topics, data and processes. The
figures put them side by side: sagas/s and their ratio (``read_committed / none``), CPU
ms per saga of every process (a participant's workers added up) and the open loop's
decision p50 / p99 and shed sagas.

The ``hot`` phase is the main phase's closed loop with every step on one of the first
:data:`~saga.tools.bench.config.HOT_RECORDS` records of its store: under
``read_committed`` all of them escrow increments of the same few records. Its figure is
its sagas/s and their ratio to the main phase (the uniform workload, same level).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from saga.tools.bench.config import NONE_SUFFIX, BenchConfig
from saga.tools.bench.cpu import cpu_ms_by_role
from saga.tools.bench.phases import SagaPhaseResult

LEVELS = ("read_committed", "none")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 3)


def _cpu_by_role(r: SagaPhaseResult) -> dict[str, float | None]:
    return cpu_ms_by_role(r)


def _total(per_role: Mapping[str, float | None]) -> float:
    return round(sum(v for v in per_role.values() if v is not None), 3)


def _open_loop(r: SagaPhaseResult | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {
        "p50_ms": r.decision_latency_ms.get("p50"),
        "p99_ms": r.decision_latency_ms.get("p99"),
        "shed": r.shed,
        "offered": r.sent_in_window + r.shed,
        "sagas_per_s": r.sagas_per_s,
        "cpu_ms_per_saga_total": _total(_cpu_by_role(r)),
    }


def isolation_figures(
    cfg: BenchConfig, phases: Mapping[str, SagaPhaseResult]
) -> dict[str, Any] | None:
    """``--isolation both``: each level's main and open-loop figures and the ratios;
    otherwise the one level the run used."""
    if cfg.isolation != "both":
        return {"mode": cfg.isolation}
    main = {"read_committed": phases.get("main"), "none": phases.get("main" + NONE_SUFFIX)}
    latency = {
        "read_committed": phases.get("latency"),
        "none": phases.get("latency" + NONE_SUFFIX),
    }
    rates = {level: (r.sagas_per_s if r else None) for level, r in main.items()}
    cpu = {level: (_cpu_by_role(r) if r else None) for level, r in main.items()}
    totals = {level: (_total(c) if c is not None else None) for level, c in cpu.items()}
    return {
        "mode": "both",
        "sagas_per_s": rates,
        "throughput_ratio": _ratio(rates["read_committed"], rates["none"]),
        "decision_latency_ms": {
            level: (r.decision_latency_ms if r else None) for level, r in main.items()
        },
        "cpu_ms_per_saga": cpu,
        "cpu_ms_per_saga_total": totals,
        "cpu_ratio": _ratio(totals["read_committed"], totals["none"]),
        "open_loop": {level: _open_loop(r) for level, r in latency.items()},
        "rate": cfg.rate,
    }


def hot_figures(phases: Mapping[str, SagaPhaseResult]) -> dict[str, Any] | None:
    """The hot phase's sagas/s and its ratio to the main phase (same level), or ``None``."""
    hot = phases.get("hot")
    if hot is None:
        return None
    main = phases.get("main")
    return {
        "records": hot.hot_records,
        "isolation": hot.isolation,
        "sagas_per_s": hot.sagas_per_s,
        "main_sagas_per_s": main.sagas_per_s if main else None,
        "ratio_to_main": _ratio(hot.sagas_per_s, main.sagas_per_s if main else None),
        "decision_latency_ms": hot.decision_latency_ms,
        "cpu_ms_per_saga_total": _total(_cpu_by_role(hot)),
    }


# --------------------------------------------------------------------------- output


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f} ms"


def _rate(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.1f}"


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f} x"


def print_isolation(console: Console, layouts: Mapping[str, Mapping[str, Any]]) -> None:
    """One table, a column per layout and level: sagas/s, the ratio, open-loop p50/p99,
    CPU ms per saga per process; then the hot phase. Nothing when neither ran."""
    compared = {
        n: f for n, f in layouts.items() if (f.get("isolation") or {}).get("mode") == "both"
    }
    hot = {n: f["hot"] for n, f in layouts.items() if f.get("hot")}
    if not compared and not hot:
        return
    table = Table(title="isolation: read_committed (rc) and none side by side")
    table.add_column("figure")
    columns = [(n, level) for n in compared for level in LEVELS]
    short = {"read_committed": "rc", "none": "none"}
    for n, level in columns:
        table.add_column(f"{n}\n{short[level]}", justify="right")
    if columns:
        _compared_rows(table, compared, columns)
    if hot:
        if columns:
            table.add_section()
        cells = columns or [(n, "read_committed") for n in hot]
        if not columns:
            for n in hot:
                table.add_column(n, justify="right")

        def hot_cell(get: Callable[[Mapping[str, Any]], str]) -> list[str]:
            out = []
            for n, level in cells:
                h = hot.get(n)
                out.append(get(h) if h is not None and h["isolation"] == level else "")
            return out

        records = next(iter(hot.values()))["records"]
        table.add_row(f"[bold]hot ({records} records) sagas/s[/]",
                      *hot_cell(lambda h: f"[bold]{_rate(h['sagas_per_s'])}[/]"))  # fmt: skip
        table.add_row("  hot / main", *hot_cell(lambda h: _x(h["ratio_to_main"])))
        table.add_row("  decision p99", *hot_cell(lambda h: _ms(h["decision_latency_ms"]["p99"])))
    console.print(table)


def _compared_rows(
    table: Table,
    compared: Mapping[str, Mapping[str, Any]],
    columns: list[tuple[str, str]],
) -> None:
    def row(label: str, get: Callable[[Mapping[str, Any], str], str]) -> None:
        table.add_row(label, *(get(compared[n]["isolation"], level) for n, level in columns))

    row("[bold]main sagas/s[/]", lambda f, lv: f"[bold]{_rate(f['sagas_per_s'][lv])}[/]")
    row(
        "[bold]rc / none sagas/s[/]",
        lambda f, lv: f"[bold]{_x(f['throughput_ratio'])}[/]" if lv == LEVELS[0] else "",
    )
    row(
        "main decision p99",
        lambda f, lv: _ms(((f["decision_latency_ms"] or {}).get(lv) or {}).get("p99")),
    )

    def loop(key: str) -> Callable[[Mapping[str, Any], str], str]:
        def cell(f: Mapping[str, Any], lv: str) -> str:
            o = (f.get("open_loop") or {}).get(lv)
            if o is None:
                return "n/a"
            if key == "shed":
                return f"{o['shed']:,}"
            return _ms(o[key])

        return cell

    rate = next(iter(compared.values()))["isolation"]["rate"]
    row(f"open loop {rate:g}/s: p50", loop("p50_ms"))
    row("  p99", loop("p99_ms"))
    row("  shed", loop("shed"))
    table.add_section()
    row("[bold]CPU ms/saga, main[/]", lambda f, lv: "")
    roles: list[str] = []
    for f in compared.values():
        for per_role in (f["isolation"].get("cpu_ms_per_saga") or {}).values():
            roles += [r for r in per_role or {} if r not in roles]

    def cpu(role: str) -> Callable[[Mapping[str, Any], str], str]:
        return lambda f, lv: _ms2(((f["cpu_ms_per_saga"] or {}).get(lv) or {}).get(role))

    for role in roles:
        row(f"  {role}", cpu(role))
    row(
        "  [bold]total[/]",
        lambda f, lv: f"[bold]{_ms2((f['cpu_ms_per_saga_total'] or {}).get(lv))}[/]",
    )
    row("  rc / none CPU", lambda f, lv: _x(f["cpu_ratio"]) if lv == LEVELS[0] else "")


def _ms2(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"
