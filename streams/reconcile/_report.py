"""What a run leaves behind: the JSON summary, and the table printed for a person."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from saga.streams.reconcile._audit import CLASSES, INVARIANTS
from saga.streams.reconcile._operators import render_actions

__all__ = ["render", "write_json", "write_jsonl"]

_MEANING = {
    "violation": "an invariant is broken",
    "early_effect": "a step's effect reached its store before its saga's commit (I7)",
    "compensation_failed": "an operator must act",
    "resolved_by_hand": "rolled back; a failed compensation was resolved by hand",
    "stuck_no_decision": "no decision after the deadline + grace",
    "stuck_unfinished": "decided, steps unanswered after grace",
    "in_flight": "within its deadline or grace",
    "ok": "finished as it should",
}
_INVARIANT = {
    "I1": "one decision per request",
    "I2": "commit => every step applied (and committed where it said confirm)",
    "I3": "rollback => applied steps compensated, none applied after",
    "I4": "ledgers agree with the log",
    "I6": "only invalid records on the DLQ",
    "I7": "isolation: no effect in a store before its saga's commit (ledgers)",
}


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


def render(
    console: Console, summary: Mapping[str, Any], shown: Sequence[Mapping[str, Any]]
) -> None:
    """Print the summary table, then up to ``--show`` findings."""
    table = Table(title=f"saga reconcile — {summary['prefix']}.*", title_justify="left")
    table.add_column("what")
    table.add_column("count", justify="right")
    table.add_column("meaning")
    classes = summary["classes"]
    table.add_row("transactions", str(summary["transactions"]), "")
    for name in CLASSES:
        style = "" if name in ("ok", "in_flight") or not classes.get(name) else "bold red"
        table.add_row(f"  {name}", str(classes.get(name, 0)), _MEANING[name], style=style)
    for name in INVARIANTS:
        count = summary["invariants"].get(name, 0)
        table.add_row(f"  {name}", str(count), _INVARIANT[name], style="bold red" if count else "")
    records = summary["records"]
    table.add_row(
        "records read",
        str(records["total"]),
        ", ".join(f"{k} {v}" for k, v in records.items() if k != "total"),
    )
    invalid = summary["invalid_records"]
    table.add_row(
        "  invalid (skipped)",
        str(sum(invalid.values())),
        ", ".join(f"{k} {v}" for k, v in invalid.items()),
    )
    explained = summary.get("invalid_explained") or {}
    if explained.get("count"):
        table.add_row(
            "  with a reason",
            str(explained["count"]),
            f"first: {explained['first']}"[:160],
            style="yellow",
        )
    signatures = summary.get("signatures") or {}
    if signatures.get("keys_dir"):
        forged = signatures["forged_records"]
        table.add_row(
            "  not signed by their writer",
            str(sum(forged.values())),
            ", ".join(f"{k} {v}" for k, v in forged.items())
            + f"; dead letters: not the coordinator's {signatures['dlq_forged']}, "
            f"of unsigned records {signatures['dlq_unauthenticated']}",
        )
    else:
        table.add_row("  signatures", "-", "not checked (no --keys-dir / SAGA_KEYS_DIR)")
    dlq = summary["dlq"]
    table.add_row(
        "dead letters",
        str(dlq["records"]),
        f"invalid {dlq['invalid']}, rightly rejected {dlq['justified']}, "
        f"wrongly rejected {dlq['violations']}",
    )
    for ledger in summary["ledgers"]:
        table.add_row(
            "ledger",
            str(ledger["entries"]),
            f"{ledger['source']} ({', '.join(ledger['participants']) or 'no participant'})",
        )
    for check in summary["checks"]:
        verdict = "holds" if check["holds"] else "FAILS"
        detail = check.get("error") or "; ".join(
            ", ".join(f"{k}={v}" for k, v in row.items()) for row in check["rows"][:3]
        )
        table.add_row(
            f"check {check['name']}",
            verdict,
            detail[:160],
            style="" if check["holds"] else "bold red",
        )
    replay = summary["replay"]
    table.add_row(
        "replay" + (" (dry run)" if replay["mode"] == "dry-run" else ""),
        str(replay["sent"] if replay["mode"] == "sent" else replay["planned"]),
        f"{replay['decisions']} decision(s), {replay['requests']} request(s)"
        + (" would be re-published (use --replay)" if replay["mode"] == "dry-run" else " sent"),
    )
    t = summary["timings"]
    table.add_row(
        "throughput",
        f"{t['records_per_s']:,.0f}/s",
        f"audit {t['audit_s']:.1f}s, Spark start {t['startup_s']:.1f}s, wall {t['wall_s']:.1f}s",
    )
    console.print(table)
    render_actions(console, (summary.get("operator_actions") or {}).get("actions") or [])
    if shown:
        found = Table(title="findings (first rows; all of them in findings/)", title_justify="left")
        for column in ("tx_id", "class", "why"):
            found.add_column(column, overflow="fold")
        for row in shown:
            why = "; ".join(row.get("reasons") or [])
            if not why and row.get("unfinished_steps"):
                steps = ", ".join(str(s) for s in row["unfinished_steps"])
                why = f"step(s) {steps} unanswered; outcome {row.get('outcome')}"
            if not why and row["class"] == "stuck_no_decision":
                why = f"no decision; deadline {row.get('deadline_ms')}"
            found.add_row(str(row["tx_id"]), str(row["class"]), why)
        console.print(found)
    console.print(f"exit status {summary['exit_code']}: {summary['verdict']}")
