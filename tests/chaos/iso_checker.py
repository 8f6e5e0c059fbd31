"""The isolation checker: the log, the reader's samples, the final values and the ledgers.

Pure logic, independent of the participants' code. Times are wall-clock ms on one
machine: a sample is ``[before, after]`` (the read happened in between); a committed
saga's effect on a record became visible no earlier than its decision was produced
(``lb``: the decision record's Kafka timestamp; no participant acts on a decision
before it exists) and no later than the step's final event was produced (``ub``:
the ``committed`` event of a step whose ``applied`` event said ``confirm``, else the
``applied`` event itself; events are produced after the local commit). A step's
``committed`` event may come as a ``saga.committed`` record listing it (one per
participant batch): its Kafka timestamp is then the step's (not its ``at_ms``, taken
when the batch began, before the local commit).

Read committed means a reader sees only effects of committed sagas, and each of them
only once it could have been applied. So:

* **slots** (``writer`` = the writing saga): the committed writes of a record, ordered
  by decision (holds are exclusive, so their hold intervals, which contain their
  decisions, are disjoint: decision order is the order they were applied), give the
  record's committed states ``s0 -> s1 -> ... -> sn``. A sample may show ``s_j`` only
  if write ``j`` could have been applied before the read ended (``lb_j <= after``) and
  write ``j + 1`` not before it began (``ub_{j+1} >= before``; once a write is surely
  applied, so are all before it). Anything else — a rolled-back or undecided writer,
  a committed one read before its decision — is a **dirty read**;
* **accounts** (escrow increments commute, so commits may land in any order): a
  sample's value must be the opening plus every committed increment surely applied
  (``ub < before``) plus a subset of those that may have been (``lb <= after <=`` ...),
  and never one decided after the read; otherwise a **dirty read**. Every sample and
  the final value must also lie within ``[0, CAP]`` (**bound broken**: a dirty spend
  shows here, or as a compensation refused, below);
* at quiescence each slot holds its last committed writer's state (else a **lost
  update**) and each account its opening plus its committed increments, and so does
  their sum (else **money not conserved**).

Besides, as :mod:`tests.chaos.checker` does for I1-I4: an acknowledged request missing
from the log (**lost saga**), both outcomes or two coordinator decisions (**two
decisions**), a saga without its final events or status (**unfinished**), a saga
that ended ``failed`` (a compensation refused: **failed saga**), a ledger that
disagrees with the decision (**ledger disagrees**), and any record in the DLQ (the
tier sends no poison).
"""

from __future__ import annotations

import bisect
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from saga.streams import SagaState
from tests.chaos.iso_sampler import Sample, Value
from tests.chaos.iso_workload import (
    ACCOUNTS,
    CAP,
    MISSING,
    WRITER,
    IsoSaga,
    Record,
    record_of_step,
)
from tests.chaos.log import LogView
from tests.chaos.stores import LedgerRow

COUNTS = (
    "dirty_reads",
    "bound_broken",
    "lost_updates",
    "money_not_conserved",
    "failed_sagas",
    "lost_sagas",
    "two_decisions",
    "unfinished_sagas",
    "ledger_disagrees",
    "records_in_dlq",
)
EXAMPLES = 5
DETAILS = 10
LATE_ABORT = re.compile(r"abort of \S+ ignored")
NEVER = 2**62
"""``ub`` of a step whose final event is missing: it may become visible at any time."""


@dataclass
class IsoInput:
    sagas: list[IsoSaga]  # every saga the run tried to submit
    acked: Mapping[str, bool | None]
    log: LogView
    samples: Mapping[Record, list[Sample]]
    final: Mapping[Record, Value]
    opening_accounts: Mapping[Record, int]
    opening_slots: Mapping[Record, str | None]
    ledgers: Mapping[tuple[str, str, int], LedgerRow]
    late: set[str] = field(default_factory=set)
    acked_at: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    """Where Kafka said each acknowledged request went: (partition, offset)."""


@dataclass
class IsoVerdict:
    counts: dict[str, int]
    examples: dict[str, list[str]]
    outcomes: dict[str, int]  # commit / rollback / none
    rollback_reasons: dict[str, int]
    reason_examples: dict[str, str]  # one decision reason per kind of rollback
    samples: dict[str, int]  # checked, per target
    money: dict[str, int]
    details: list[dict[str, Any]] = field(default_factory=list)
    """Per dirty read (the first few): the samples around it and every step of any saga
    on the record near that time, to tell a product bug from a checker bug."""

    @property
    def violations(self) -> int:
        return sum(self.counts.values())


class _Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter({name: 0 for name in COUNTS})
        self.examples: dict[str, list[str]] = defaultdict(list)
        self.dirty: list[tuple[Record, Sample]] = []  # the first dirty reads, to explain

    def dirty_read(self, rec: Record, sample: Sample, example: str) -> None:
        if len(self.dirty) < DETAILS:
            self.dirty.append((rec, sample))
        self.add("dirty_reads", example)

    def add(self, name: str, example: str, n: int = 1) -> None:
        self.counts[name] += n
        if len(self.examples[name]) < EXAMPLES:
            self.examples[name].append(example)


@dataclass(frozen=True)
class Write:
    """A committed saga's effect on one record, and when it could have become visible."""

    tx_id: str
    lb: int
    ub: int
    by: int = 0  # accounts
    state: str | None = None  # slots: the writer after it (None: deleted)


def reason_kind(reason: str) -> str:
    """A rollback's cause, from its decision's reason (for the report)."""
    text = reason.lower()
    if "abort" in text:
        return "aborted"
    if "minimum" in text or "maximum" in text:
        return "bound (escrow)"
    if "held by" in text or "reserv" in text:
        return "record held by another saga"
    if MISSING in text:
        return "designed to fail (accounts/nobody)"
    if "exists" in text or "does not exist" in text or "absent" in text:
        return "insert/update/delete precondition"
    if "deadline" in text:
        return "deadline"
    return "other"


def _step_ub(log: LogView, tx: str, step: int) -> int:
    final = "committed" if (tx, step) in log.confirms else "applied"
    return log.event_ms.get((tx, step, final), NEVER)


def _effect(saga: IsoSaga, step: int) -> tuple[int, str | None]:
    s = saga.steps[step]
    if s.action == "increment":
        return int(s.args["by"]), None
    return 0, (None if s.action == "delete" else saga.tx_id)


def check(inp: IsoInput) -> IsoVerdict:
    tally = _Tally()
    log = inp.log
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    examples: dict[str, str] = {}
    writes: dict[Record, list[Write]] = defaultdict(list)
    for saga in inp.sagas:
        outcome = _judge_saga(inp, saga, tally)
        outcomes[outcome or "none"] += 1
        if outcome == "rollback":
            reason = log.decision_reasons.get(saga.tx_id, "")
            reasons[reason_kind(reason)] += 1
            examples.setdefault(reason_kind(reason), reason[:200])
        if outcome != "commit":
            continue
        lb = log.decided_ms.get(saga.tx_id, 0)
        for i, step in enumerate(saga.steps):
            rec = record_of_step(step)
            by, state = _effect(saga, i)
            writes[rec].append(Write(saga.tx_id, lb, _step_ub(log, saga.tx_id, i), by, state))
    for history in writes.values():
        history.sort(key=lambda w: (w.lb, w.tx_id))
    checked: Counter[str] = Counter()
    for rec, samples in inp.samples.items():
        checked[rec[1]] += len(samples)
        if rec[1] == ACCOUNTS:
            _account_samples(rec, inp.opening_accounts[rec], writes.get(rec, []), samples, tally)
        else:
            _slot_samples(rec, inp.opening_slots[rec], writes.get(rec, []), samples, tally)
    money = _finals(inp, writes, tally)
    # An abort that comes after its saga's decision is set aside in the DLQ by design.
    letters = [d for d in log.dlq if not LATE_ABORT.match(d.error)]
    for letter in letters:
        tally.add("records_in_dlq", f"{letter.source}: {letter.error[:120]}")
    return IsoVerdict(
        details=[_explain(inp, rec, sample) for rec, sample in tally.dirty],
        counts={name: tally.counts[name] for name in COUNTS},
        examples={k: v for k, v in tally.examples.items() if v},
        outcomes=dict(outcomes),
        rollback_reasons=dict(reasons),
        reason_examples=examples,
        samples=dict(checked),
        money=money,
    )


# ---------------------------------------------------------------- per saga (I1-I4)


def _judge_saga(inp: IsoInput, saga: IsoSaga, tally: _Tally) -> str | None:
    """The saga's outcome in the log (``None``: no decision); counts what is wrong with it."""
    log, tx = inp.log, saga.tx_id
    in_log = tx in log.requests
    if inp.acked.get(tx) and not in_log:
        why = log.missing(tx)
        if tx in inp.acked_at:
            why += " (acknowledged at partition {} offset {})".format(*inp.acked_at[tx])
        tally.add("lost_sagas", f"{tx}: acknowledged, but its request is not in the log: {why}")
    records = log.decisions.get(tx, [])
    own = [d for d in records if not d.replayed and not d.injected]
    if len({d.outcome for d in records}) > 1 or len(own) > 1:
        tally.add(
            "two_decisions", f"{tx}: {len(own)} decision(s), {sorted({d.outcome for d in records})}"
        )
    outcome = own[0].outcome if own else (records[0].outcome if records else None)
    if not (in_log or inp.acked.get(tx)):
        return outcome
    status = log.statuses.get(tx)
    if status is not None and status.state is SagaState.FAILED:
        tally.add("failed_sagas", f"{tx} ({saga.kind}): failed: {status.reason}")
        return outcome
    unfinished = None
    if outcome is None:
        unfinished = "no decision"
    else:
        final = "committed" if outcome == "commit" else "compensated"
        missing = [i for i in range(len(saga.steps)) if not _finished(log, tx, i, final)]
        if missing:
            unfinished = f"{outcome}, step(s) {missing} never reported {final}"
        elif status is None or not status.state.final:
            unfinished = f"{outcome}, status {status.state if status else 'none'}"
    if unfinished is None and tx in inp.late:
        unfinished = "finished only after its recovery window"
    if unfinished:
        tally.add("unfinished_sagas", f"{tx}: {unfinished}")
    if outcome is not None:
        _ledger(inp, saga, outcome, tally)
    return outcome


def _finished(log: LogView, tx: str, step: int, final: str) -> bool:
    reported = log.events.get((tx, step), set())
    if final == "committed" and (tx, step) not in log.confirms:
        return "committed" in reported or "applied" in reported
    return final in reported


def _ledger(inp: IsoInput, saga: IsoSaga, outcome: str, tally: _Tally) -> None:
    """I4: each step's ledger entry agrees with the decision (in effect once after a commit,
    not in effect after a rollback)."""
    for i, step in enumerate(saga.steps):
        row = inp.ledgers.get((step.participant, saga.tx_id, i))
        if outcome == "commit":
            ok = row is not None and row.effect and row.status in ("applied", "committed")
        else:
            ok = row is None or row.status in ("compensated", "failed")
        if not ok:
            what = "no entry" if row is None else f"{row.status}, effect {row.effect}"
            tally.add("ledger_disagrees", f"{saga.tx_id} step {i} ({step.participant}): "
                      f"{what} after {outcome}")  # fmt: skip


# ---------------------------------------------------------------- samples


def _name(rec: Record) -> str:
    return f"{rec[0]} {rec[1]}/{rec[2]}"


def _account_samples(
    rec: Record, opening: int, history: list[Write], samples: list[Sample], tally: _Tally
) -> None:
    """Each sample: within the bounds, and a sum of committed increments that may have
    been applied by then (see the module's docstring)."""
    flagged: set[Value] = set()
    i, surely, maybe = 0, 0, []
    cache: tuple[int, int] | None = None  # (len(maybe) version, reachable bitset)
    version = 0
    bounded: set[Value] = set()
    for before, after, value in sorted(samples, key=lambda s: (s[0], s[1])):
        while i < len(history) and history[i].lb <= after:
            w = history[i]
            i += 1
            if w.ub < before:
                surely += w.by
            else:
                maybe.append(w)
                version += 1
        keep = [w for w in maybe if w.ub >= before]
        if len(keep) != len(maybe):
            surely += sum(w.by for w in maybe if w.ub < before)
            maybe = keep
            version += 1
        if not isinstance(value, int):
            if value not in flagged:
                flagged.add(value)
                tally.add("dirty_reads", f"{_name(rec)} read {value!r} at {before}: not a balance")
            continue
        if not 0 <= value <= CAP and value not in bounded:
            bounded.add(value)
            tally.add("bound_broken", f"{_name(rec)} read {value} at {before} (bounds 0..{CAP})")
        if cache is None or cache[0] != version:
            cache = (version, _subset_sums([w.by for w in maybe]))
        low = sum(w.by for w in maybe if w.by < 0)
        target = value - opening - surely - low
        if target < 0 or not (cache[1] >> target) & 1:
            if value in flagged:
                continue
            flagged.add(value)
            tally.dirty_read(
                rec,
                (before, after, value),
                f"{_name(rec)} read {value} at [{before}, {after}]: committed sagas give "
                f"{opening + surely} plus a subset of {len(maybe)} in flight "
                f"({', '.join(f'{w.tx_id}:{w.by:+d}' for w in maybe[:4])})",
            )


def _subset_sums(values: list[int]) -> int:
    """A bitset: bit ``s`` is set when some subset of ``values`` sums to ``s + sum(negatives)``."""
    bits = 1
    for v in values:
        bits |= bits << abs(v)
    return bits


def _slot_samples(
    rec: Record,
    opening: str | None,
    history: list[Write],
    samples: list[Sample],
    tally: _Tally,
) -> None:
    """Each sample shows a committed state that may have been the latest at that moment."""
    lbs = [w.lb for w in history]
    states = [opening, *(w.state for w in history)]
    flagged: set[Value] = set()
    for before, after, value in samples:
        top = bisect.bisect_right(lbs, after)  # writes 1..top may have been applied
        possible = set()
        for j in range(top, -1, -1):
            if j < len(history) and history[j].ub < before:
                break  # write j+1 was surely applied before the read: so were 1..j
            possible.add(states[j])
        if value in possible or value in flagged:
            continue
        flagged.add(value)
        writer = f"writer {value}" if value is not None else "no record"
        tally.dirty_read(
            rec,
            (before, after, value),
            f"{_name(rec)} showed {writer} at [{before}, {after}]; committed states then: "
            f"{sorted(str(s) for s in possible)}",
        )


def _explain(inp: IsoInput, rec: Record, sample: Sample) -> dict[str, Any]:
    """The samples of ``rec`` around ``sample`` and every step on ``rec`` that was in
    flight within 2 s of it, with its times (applied, decided, final) and outcome."""
    before, after, _ = sample
    log = inp.log
    near = [s for s in inp.samples.get(rec, []) if before - 500 <= s[0] <= after + 500]
    steps = []
    for saga in inp.sagas:
        for i, step in enumerate(saga.steps):
            if record_of_step(step) != rec:
                continue
            applied = log.event_ms.get((saga.tx_id, i, "applied"))
            ends = [log.event_ms.get((saga.tx_id, i, e)) for e in ("committed", "compensated")]
            end = min((e for e in ends if e is not None), default=NEVER)
            if applied is None or applied > after + 2000 or end < before - 2000:
                continue
            decisions = log.decisions.get(saga.tx_id, [])
            steps.append({
                "tx_id": saga.tx_id, "step": i, "kind": saga.kind, "mode": saga.mode,
                "action": step.action, "by": step.args.get("by"),
                "outcome": decisions[0].outcome if decisions else None,
                "applied_ms": applied, "decided_ms": log.decided_ms.get(saga.tx_id),
                "final_ms": None if end == NEVER else end,
            })  # fmt: skip
    return {"record": _name(rec), "sample": list(sample), "samples_near": near, "steps": steps}


# ---------------------------------------------------------------- at quiescence


def _finals(inp: IsoInput, writes: Mapping[Record, list[Write]], tally: _Tally) -> dict[str, int]:
    opening_total = sum(inp.opening_accounts.values())
    expected_total = opening_total
    final_total = 0
    for rec, opening in inp.opening_accounts.items():
        committed = sum(w.by for w in writes.get(rec, []))
        expected_total += committed
        have = inp.final.get(rec)
        final_total += have if isinstance(have, int) else 0
        if have != opening + committed:
            tally.add(
                "money_not_conserved", f"{_name(rec)}: {have}, expected {opening + committed}"
            )
        if isinstance(have, int) and not 0 <= have <= CAP:
            tally.add("bound_broken", f"{_name(rec)}: {have} at quiescence (bounds 0..{CAP})")
    if final_total != expected_total and not tally.counts["money_not_conserved"]:
        tally.add("money_not_conserved", f"total {final_total}, expected {expected_total}")
    for rec, opening_state in inp.opening_slots.items():
        history = writes.get(rec, [])
        want = history[-1].state if history else opening_state
        have = inp.final.get(rec)
        if have != want:
            last = history[-1].tx_id if history else "none"
            tally.add(
                "lost_updates",
                f"{_name(rec)}: {WRITER} {have!r} at quiescence; the last committed writer "
                f"({last}) left {want!r}",
            )
    return {"opening_total": opening_total, "expected_total": expected_total,
            "final_total": final_total}  # fmt: skip


def summary(verdict: IsoVerdict) -> dict[str, Any]:
    return {
        "counts": verdict.counts,
        "violations": verdict.violations,
        "outcomes": verdict.outcomes,
        "rollback_reasons": verdict.rollback_reasons,
        "reason_examples": verdict.reason_examples,
        "samples_checked": verdict.samples,
        "money": verdict.money,
        "examples": verdict.examples,
        "dirty_read_details": verdict.details,
    }
