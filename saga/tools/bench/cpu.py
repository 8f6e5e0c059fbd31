"""CPU per saga from a phase's measurements, per process and per role (shared by the reports)."""

from __future__ import annotations

from saga.tools.bench.phases import SagaPhaseResult


def cpu_ms(r: SagaPhaseResult) -> dict[str, float | None]:
    """CPU ms per saga per process of a phase (``None``: not measured)."""
    return {k: None if v is None else round(1000 * v, 3) for k, v in r.cpu_s_per_saga.items()}


def role(process: str) -> str:
    """``bank#0 (sql)`` -> ``bank``; ``client (bench)`` -> ``client``; services unchanged."""
    return process.split(" (", maxsplit=1)[0].split("#", maxsplit=1)[0]


def cpu_ms_by_role(r: SagaPhaseResult) -> dict[str, float | None]:
    """CPU ms per saga per role (a participant's workers added up), for side-by-side rows."""
    out: dict[str, float | None] = {}
    for name, v in cpu_ms(r).items():
        key = role(name)
        if v is None:
            out.setdefault(key, None)
        else:
            out[key] = round((out.get(key) or 0.0) + v, 3)
    return out
