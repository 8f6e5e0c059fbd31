"""The business checks (I5): each ``--check`` query over the ``--table`` views."""

from __future__ import annotations

from typing import Any

from saga.streams.reconcile import _sources
from saga.streams.reconcile._config import ReconcileConfig
from saga.streams.reconcile._spark import ReconcileError, spark_boundary

__all__ = ["run_checks"]


def run_checks(spark: Any, config: ReconcileConfig) -> list[dict[str, Any]]:
    """Register the tables as views, run each business check, report its verdict."""
    if not config.checks:
        return []
    with spark_boundary("reading the tables for the business checks"):
        for table in config.tables:
            _sources.table_frame(spark, table).createOrReplaceTempView(table.name)
    results: list[dict[str, Any]] = []
    for check in config.checks:
        try:
            with spark_boundary(f"check {check.name}"):
                frame = spark.sql(check.sql)
                rows = [r.asDict(recursive=True) for r in frame.limit(21).collect()]
        except ReconcileError as exc:
            results.append(
                {
                    "name": check.name,
                    "sql": check.sql,
                    "holds": False,
                    "rows": [],
                    "error": str(exc),
                }
            )
            continue
        if "ok" in frame.columns:
            holds = bool(rows) and all(r.get("ok") is True for r in rows)
        else:
            holds = not rows
        results.append(
            {
                "name": check.name,
                "sql": check.sql,
                "holds": holds,
                "rows": [{k: _plain(v) for k, v in r.items()} for r in rows[:20]],
                "error": None,
            }
        )
    return results


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)
