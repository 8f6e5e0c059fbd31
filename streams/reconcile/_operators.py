"""The report's operator actions: aborts, resolves and redrives, per transaction.

The audit folds them into each transaction's ``ops`` column (:mod:`._audit`): an
abort (with who asked: its ``by``, or ``operator`` when the operator key signed it),
a ``saga.resolve`` (step, note, by), and any record carrying the
``saga.redriven.from`` header that ``saga dlq redrive`` adds (kept even when the
copy is still invalid: its key names the transaction). This module collects them
for the summary and prints them; a transaction resolved by hand is classed
``resolved_by_hand`` there, not ``compensation_failed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

__all__ = ["collect_actions", "render_actions"]

MAX_ACTIONS: Final = 1000
"""How many operator actions the summary lists (newest first); the count is exact."""


def collect_actions(base: Any) -> tuple[int, list[dict[str, Any]]]:
    """``(count, actions)`` from the audit's per-transaction frame, newest first."""
    exploded = base.where("size(ops) > 0").selectExpr("explode(ops) AS op").selectExpr("op.*")
    count = exploded.count()
    rows = exploded.orderBy("at_ms", ascending=False).limit(MAX_ACTIONS).collect()
    actions = [
        {
            "tx_id": r["tx_id"],
            "action": r["action"],
            "by": r["by"],
            "step": r["step"],
            "text": r["text"],
            "at_ms": r["at_ms"],
            "where": f"{r['topic']}[{r['part']}]@{r['off']}",
        }
        for r in rows
    ]
    actions.sort(key=lambda a: (str(a["tx_id"]), a["at_ms"] or 0))
    return int(count), actions


def render_actions(console: Any, actions: Sequence[dict[str, Any]]) -> None:
    """Print the operator actions table (nothing when there are none)."""
    if not actions:
        return
    from rich.table import Table

    table = Table(title="operator actions", title_justify="left")
    for column in ("tx_id", "action", "by", "step", "detail", "where"):
        table.add_column(column, overflow="fold")
    for a in actions:
        table.add_row(
            str(a["tx_id"]),
            "resolved by hand" if a["action"] == "resolve" else str(a["action"]),
            str(a["by"] or ""),
            "" if a["step"] is None else str(a["step"]),
            str(a["text"] or ""),
            a["where"],
        )
    console.print(table)
