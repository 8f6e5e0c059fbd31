"""The chaos checker: the stores, the ledgers and the log at quiescence, judged per saga.

Independent of the reconciliation job and of the participants' code: it reads
the log with the wire codec, the stores and ledgers in their own layouts
(:mod:`tests.chaos.stores`), and compares them with the run's history (what was
submitted, which records were injected, which were acknowledged).

Every transfer debits an account of its own, and half credit one of their own
(:mod:`tests.chaos.workload`), so the balance of such an account says how many
times its step is in effect (``n``); the log's decision says how many it should
be (``e``: 1 after ``commit``, 0 after ``rollback``). The counts:

``lost_sagas``
    an acknowledged request missing from the log, or a committed saga whose
    step is not in effect (``n < e`` after commit);
``steps_applied_twice``
    a step (or its compensation) in effect once too often: ``n > e`` where the
    participant's ledger says it applied the step, or ``n < 0`` where it says it
    compensated a step it had applied;
``two_decisions``
    both ``commit`` and ``rollback`` in the log, or more than one decision record
    from the coordinator (replays by ``saga reconcile`` and the run's own
    duplicates are byte-identical copies and are not counted);
``null_compensation_writes``
    a rollback that reached a step before its request changed the account
    (``n < 0`` where the step was never applied);
``applied_after_rollback``
    a step in effect after its saga rolled back, where the rollback closed it
    before it was applied (the barrier trio's sagas, or a ledger entry that never
    had an effect);
``money_not_conserved``
    accounts whose balance is not the opening balance plus the committed transfers
    (the broadest check: any step applied the wrong number of times shows here);
``negative_balances``
    accounts below zero;
``valid_records_in_dlq``
    dead letters that are not one of the run's poison records;
``poison_not_in_dlq_once``
    poison records not in the DLQ exactly once, with their original bytes;
``unfinished_sagas``
    sagas in the log without a decision, a step without its final event
    (``compensated`` after a rollback; after a commit ``committed`` for a step whose
    ``applied`` event said ``confirm``, and ``applied`` for any other: a commit leaves
    such a step alone and reports nothing), or a status that is not final; or that were
    not final when their recovery window ended, even if something (a replay) finished
    them later. A ``saga.committed`` record counts as the ``committed`` event of each
    step it lists (:meth:`tests.chaos.log.LogView.take_event`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from saga.streams import MAX_RECORD_BYTES, SagaState
from saga.streams._limits import DLQ_EXCERPT_BYTES
from tests.chaos.log import Delivery, LogView
from tests.chaos.stores import LedgerKey, LedgerRow
from tests.chaos.workload import MISSING_ACCOUNT, PARTICIPANTS, Transfer

COUNTS = (
    "lost_sagas",
    "steps_applied_twice",
    "two_decisions",
    "null_compensation_writes",
    "applied_after_rollback",
    "money_not_conserved",
    "negative_balances",
    "valid_records_in_dlq",
    "poison_not_in_dlq_once",
    "unfinished_sagas",
)
EXAMPLES = 5


@dataclass
class CheckInput:
    transfers: list[Transfer]  # every transfer the run tried to submit
    acked: Mapping[str, bool | None]  # tx_id -> request acknowledged (None: unknown)
    trio: set[str]  # sagas whose rollback was sent before their request
    openings: Mapping[str, Mapping[str, int]]  # store -> account -> opening balance
    balances: Mapping[str, Mapping[str, int]]  # store -> account -> balance now
    ledgers: Mapping[LedgerKey, LedgerRow]
    log: LogView
    poison: list[Delivery]
    late: set[str] = field(default_factory=set)  # not final when a recovery window ended


@dataclass
class Verdict:
    counts: dict[str, int]
    examples: dict[str, list[str]]
    outcomes: dict[str, int]  # commit / rollback / none, from the log
    history: dict[str, int]  # ok / failed / unknown, as the client saw them
    money: dict[str, int]  # opening and final totals
    poison: dict[str, int]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def violations(self) -> int:
        return sum(self.counts.values())


class _Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter({name: 0 for name in COUNTS})
        self.examples: dict[str, list[str]] = defaultdict(list)

    def add(self, name: str, example: str) -> None:
        self.counts[name] += 1
        if len(self.examples[name]) < EXAMPLES:
            self.examples[name].append(example)


def _in_effect(opening: int, balance: int | None, amount: int, sign: int) -> int | None:
    """How many times a change of ``sign * amount`` is in effect, or None if not a whole number."""
    if balance is None:
        return None
    delta = (balance - opening) * sign
    return delta // amount if delta % amount == 0 else None


def _finished(log: LogView, tx: str, step: int, final: str) -> bool:
    """Whether the step reported what its saga's decision asks of it (``final``)."""
    reported = log.events.get((tx, step), set())
    if final == "committed" and (tx, step) not in log.confirms:
        return "committed" in reported or "applied" in reported  # nothing to confirm
    return final in reported


def check(inp: CheckInput) -> Verdict:
    tally = _Tally()
    log = inp.log
    outcomes: Counter[str] = Counter()
    history: Counter[str] = Counter()
    expected: dict[str, dict[str, int]] = {s: dict(a) for s, a in inp.openings.items()}

    for t in inp.transfers:
        tx = t.tx_id
        in_log = tx in log.requests
        if inp.acked.get(tx) and not in_log:
            why = log.missing(tx)
            tally.add("lost_sagas", f"{tx}: acknowledged, but its request is not in the log: {why}")
        records = log.decisions.get(tx, [])
        own = [d for d in records if not d.replayed and not d.injected]
        if len({d.outcome for d in records}) > 1 or len(own) > 1:
            tally.add(
                "two_decisions",
                f"{tx}: {len(own)} coordinator decision(s), outcomes "
                f"{sorted({d.outcome for d in records})}",
            )
        outcome = own[0].outcome if own else (records[0].outcome if records else None)
        outcomes[outcome or "none"] += 1
        status = log.statuses.get(tx)
        if status is not None and status.state is SagaState.COMMITTED:
            history["ok"] += 1
        elif status is not None and status.state in (SagaState.ROLLED_BACK, SagaState.FAILED):
            history["failed"] += 1
        else:
            history["unknown"] += 1

        if in_log or inp.acked.get(tx):
            unfinished = None
            if outcome is None:
                unfinished = "no decision"
            else:
                final = "committed" if outcome == "commit" else "compensated"
                missing = [s for s in (0, 1) if not _finished(log, tx, s, final)]
                if missing:
                    unfinished = f"{outcome}, step(s) {missing} never reported {final}"
                elif status is None or not status.state.final:
                    unfinished = f"{outcome}, status {status.state if status else 'none'}"
            if unfinished is None and tx in inp.late:
                unfinished = "finished only after its recovery window (a replay repaired it?)"
            if unfinished:
                tally.add("unfinished_sagas", f"{tx}: {unfinished}")

        if outcome == "commit":
            expected[t.src][t.src_key] = expected[t.src].get(t.src_key, 0) - t.amount
            expected[t.dst][t.dst_key] = expected[t.dst].get(t.dst_key, 0) + t.amount

        # How often each step of this saga is in effect, on the accounts it alone uses.
        # (A saga without a decision is unfinished; what it changed shows in the money.)
        if outcome is None:
            continue
        e = 1 if outcome == "commit" else 0
        steps = [(0, t.src, t.src_key, -1)]
        if t.dst_own:
            steps.append((1, t.dst, t.dst_key, +1))
        lost = False
        for step, store, key, sign in steps:
            opening = inp.openings[store].get(key, 0)
            n = _in_effect(opening, inp.balances.get(store, {}).get(key), t.amount, sign)
            if n is None or n == e:
                continue  # None: not a whole number of steps; money_not_conserved says it
            entry = inp.ledgers.get((PARTICIPANTS[store], tx, step))
            never_applied = tx in inp.trio or (entry is not None and not entry.effect)
            where = f"{tx} step {step} ({store} {key}): in effect {n}x after {outcome}"
            if n > e:
                if outcome == "rollback" and never_applied:
                    tally.add("applied_after_rollback", where)
                else:
                    tally.add("steps_applied_twice", where)
            elif outcome == "commit":
                lost = True
            elif never_applied:
                tally.add("null_compensation_writes", where)
            else:
                tally.add("steps_applied_twice", f"{where} (compensated twice)")
        if lost:
            tally.add("lost_sagas", f"{tx}: committed, but a step is not in effect")

    # Money: every account is its opening balance plus the committed transfers.
    opening_total = sum(sum(a.values()) for a in inp.openings.values())
    final_total = sum(sum(a.values()) for a in inp.balances.values())
    for store in sorted(set(expected) | set(inp.balances)):
        want, have = expected.get(store, {}), inp.balances.get(store, {})
        for key in sorted(set(want) | set(have)):
            if want.get(key) != have.get(key):
                what = "must not exist" if key == MISSING_ACCOUNT else f"expected {want.get(key)}"
                tally.add("money_not_conserved", f"{store} {key}: {have.get(key)}, {what}")
            if (have.get(key) or 0) < 0:
                tally.add("negative_balances", f"{store} {key}: {have.get(key)}")

    # Dead letters: each poison record exactly once, with its bytes (or, over the record
    # limit, their first bytes); nothing else.
    letters: dict[tuple[str, int, int], list[Any]] = defaultdict(list)
    for letter in log.dlq:
        letters[letter.source].append(letter)
    poison_sources = set()
    unknown_poison = 0
    for p in inp.poison:
        if not p.acked:
            unknown_poison += 1
            continue
        source = (p.topic, p.partition, p.offset)
        poison_sources.add(source)
        found = letters.get(source, [])
        if len(found) != 1 or (found[0].key, found[0].value) != dead_letter_of(p.key, p.value):
            tally.add(
                "poison_not_in_dlq_once",
                f"{p.label} at {source}: {len(found)} dead letter(s)",
            )
    for source, found in letters.items():
        if source not in poison_sources:
            for letter in found:
                tally.add("valid_records_in_dlq", f"{source}: {letter.error[:120]}")

    return Verdict(
        counts={name: tally.counts[name] for name in COUNTS},
        examples={k: v for k, v in tally.examples.items() if v},
        outcomes=dict(outcomes),
        history=dict(history),
        money={"opening_total": opening_total, "final_total": final_total},
        poison={
            "sent": len(inp.poison),
            "unacknowledged": unknown_poison,
            "in_dlq_once": len(poison_sources) - tally.counts["poison_not_in_dlq_once"],
            "dead_letters": len(log.dlq),
        },
    )


def summarize_counts(verdicts: Iterable[Verdict]) -> dict[str, int]:
    total: Counter[str] = Counter({name: 0 for name in COUNTS})
    for v in verdicts:
        total.update(v.counts)
    return dict(total)


def dead_letter_of(key: bytes | None, value: bytes | None) -> tuple[bytes | None, bytes | None]:
    """The key and value the DLQ keeps of a rejected record (an excerpt when oversized)."""
    if len(key or b"") + len(value or b"") <= MAX_RECORD_BYTES:
        return key, value
    cut = DLQ_EXCERPT_BYTES
    return (key[:cut] if key is not None else None, value[:cut] if value is not None else None)
