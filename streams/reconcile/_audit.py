"""The audit proper: parsed records in, one row per transaction out, each classified.

Everything here is Spark SQL on the JVM: the rows of :mod:`._parse` (one per
log record, each valid or ``invalid``) are folded into one row per transaction
in a single aggregation, then checked against the invariants and the ledgers.
No Python function runs per record (but the signature check of :mod:`._parse`).

Invalid records are counted and left out of the audit (neither a transaction's
record, nor stuck, nor replayed), as every consumer leaves them out; what makes
a record invalid is described in :mod:`._parse`.

Step events come as ``saga.step`` records or inside ``saga.committed`` ones (one
participant's ``committed`` acknowledgements of a batch): :mod:`._parse` gives one
``event`` row per step either way, so every check below sees a listed step exactly
as a ``committed`` ``saga.step`` of it. A transaction's ``events`` counts step
events; ``event_records`` counts the records of the events topic (each counted on
its key's transaction).

Per step, the statuses its participant reported are kept as bit masks
(``steps`` are at most 64), so the checks are bit operations; the events list
is looked at only for transactions whose masks say it matters.

Classes, most severe first: ``violation`` (an invariant is broken; the row
names which and why), ``early_effect`` (only I7 is: a step's effect reached its
store before its saga's commit, :mod:`._isolation`), ``compensation_failed``,
``resolved_by_hand`` (rolled back once an operator's ``saga.resolve`` closed each
failed compensation), ``stuck_no_decision`` (no decision ``grace`` after the
deadline), ``stuck_unfinished`` (a decision, and ``grace`` after it a step still
lacks ``compensated`` after a rollback, or, after a commit, ``committed`` where its
``applied`` event said ``"confirm": true``; a step with nothing to confirm is
finished by the commit decision itself, and a ``committed`` event for it, as every
step got before the ``confirm`` field, is harmless), ``in_flight`` (still within
its deadline or grace), ``ok``.
"""

from __future__ import annotations

from typing import Any, Final

from saga.streams.reconcile._isolation import EARLY_EFFECT, classed, early_effects
from saga.streams.reconcile._parse import (
    EVENT_STATUSES,
    parse_decisions,
    parse_events,
    parse_requests,
)

__all__ = [
    "CLASSES",
    "EVENT_STATUSES",
    "INVARIANTS",
    "classify",
    "ledger_findings",
    "parse_decisions",
    "parse_events",
    "parse_requests",
    "per_transaction",
]

CLASSES: Final = (
    "violation",
    EARLY_EFFECT,
    "compensation_failed",
    "resolved_by_hand",
    "stuck_no_decision",
    "stuck_unfinished",
    "in_flight",
    "ok",
)
INVARIANTS: Final = ("I1", "I2", "I3", "I4", "I6", "I7")

_UNKNOWN: Final = "names unknown participant(s): "
"""How the coordinator's rollback reason lists the participants that do not exist."""


# ---------------------------------------------------------------- one row per transaction


def _mask(status: str) -> str:
    return (
        f"bit_or(CASE WHEN kind = 'event' AND status = '{status}' "
        "THEN shiftleft(1L, step) ELSE 0L END)"
    )


_AGGREGATES: Final = {
    "n_requests": "count_if(kind = 'request')",
    "n_aborts": "count_if(kind = 'abort')",
    "n_resolves": "count_if(kind = 'resolve')",
    # Steps an operator resolved by hand (saga.resolve; the coordinator dead-letters a
    # resolve of anything but a failed compensation, which makes it invalid here).
    "m_resolved": "bit_or(CASE WHEN kind = 'resolve' THEN shiftleft(1L, step) ELSE 0L END)",
    # What operators did, for the report's operator actions (a redriven record that is
    # still invalid is kept too: its key says which transaction it names).
    "ops": """collect_list(CASE WHEN kind IN ('abort', 'resolve') OR redriven IS NOT NULL
        THEN named_struct('action', CASE WHEN redriven IS NOT NULL THEN 'redrive' ELSE kind END,
        'tx_id', rkey, 'topic', src, 'part', part, 'off', off, 'at_ms', at_ms,
        'by', actor, 'step', step, 'text', coalesce(redriven, note, reason)) END)""",
    # Step events (a saga.committed gives one per step it lists) and the records of
    # the events topic they came in (`lead`: one row per record).
    "n_events": "count_if(kind = 'event')",
    "n_event_records": "count_if(kind = 'event' AND src = 'events' AND lead)",
    "n_decisions": "count_if(kind = 'decision')",
    "bad_requests": "count_if(kind = 'invalid' AND src = 'requests')",
    "bad_events": "count_if(kind = 'invalid' AND src = 'events')",
    "bad_decisions": "count_if(kind = 'invalid' AND src = 'decisions')",
    "forged_requests": "count_if(forged AND src = 'requests')",
    "forged_events": "count_if(forged AND src = 'events')",
    "forged_decisions": "count_if(forged AND src = 'decisions')",
    # Invalid records whose parse says why (a saga.committed listing another partition's
    # tx_id): how many, and the first by topic, partition and offset.
    "n_explained": "count_if(kind = 'invalid' AND reason IS NOT NULL)",
    "first_explained": """min(CASE WHEN kind = 'invalid' AND reason IS NOT NULL
        THEN named_struct('src', src, 'part', part, 'off', off, 'reason', reason) END)""",
    # The first request and decision by offset: all records of a transaction share
    # one partition (key = tx_id), and consumers act on the first.
    "req": """min(CASE WHEN kind = 'request' THEN named_struct('off', off, 'part', part,
        'saga', saga, 'mode', mode, 'parts', parts, 'deadline_ms', deadline_ms,
        'created_ms', created_ms, 'isolation', isolation, 'actions', actions) END)""",
    "dec": """min(CASE WHEN kind = 'decision' THEN named_struct('off', off, 'part', part,
        'outcome', outcome, 'at_ms', at_ms, 'reason', reason) END)""",
    "outcomes": "array_sort(collect_set(CASE WHEN kind = 'decision' THEN outcome END))",
    "events": """collect_list(CASE WHEN kind = 'event' THEN named_struct('step', step,
        'participant', participant, 'status', status, 'at_ms', at_ms, 'off', off,
        'confirm', confirm) END)""",
    "max_applied_ms": "max(CASE WHEN kind = 'event' AND status = 'applied' THEN at_ms END)",
    "m_applied": _mask("applied"),
    "m_failed": _mask("failed"),
    "m_committed": _mask("committed"),
    "m_compensated": _mask("compensated"),
    "m_comp_failed": _mask("compensation_failed"),
    "m_reported": "bit_or(CASE WHEN kind = 'event' THEN shiftleft(1L, step) ELSE 0L END)",
    # Steps whose `applied` event said `"confirm": true`: on commit, only those owe a
    # `committed` event; the others are finished by the decision itself.
    "m_confirm": """bit_or(CASE WHEN kind = 'event' AND status = 'applied' AND confirm
        THEN shiftleft(1L, step) ELSE 0L END)""",
}


def _own(e: str) -> str:
    """SQL: event ``e`` counts for its step, i.e. its participant is the one the request
    names for that step (the coordinator ignores the others)."""
    return f"coalesce(try_element_at(req.parts, {e}.step + 1) = {e}.participant, false)"


_OWN: Final = _own("e")


def _steps_of(mask: str) -> str:
    """SQL: the comma-separated step numbers set in ``mask``."""
    return (
        f"array_join(transform(filter(sequence(0, 63), i -> ({mask} & shiftleft(1L, i)) != 0L), "
        "i -> cast(i AS STRING)), ', ')"
    )


def _finding(invariant: str, condition: str, reason: str) -> str:
    return (
        f"CASE WHEN {condition} THEN named_struct('invariant', '{invariant}', "
        f"'reason', {reason}) END"
    )


def per_transaction(union: Any, *, as_of_ms: int, grace_ms: int, window: bool) -> Any:
    """Fold the parsed records into one row per transaction with the log's findings.

    The row with ``tx IS NULL`` carries the counts of invalid records. ``window``
    (a ``--since`` run): transactions whose request lies before the window are
    partly outside it and are dropped rather than judged.
    """
    from pyspark.sql import functions as F

    grouped = union.groupBy("tx").agg(
        *(F.expr(sql).alias(name) for name, sql in _AGGREGATES.items())
    )
    if window:
        grouped = grouped.where("tx IS NULL OR n_requests > 0")

    # Masks of the events whose participant owns the step; recomputed from the
    # events list only when some event does not (rare: a misaddressed event).
    own_mask = {
        name: f"""aggregate(filter(events, e -> {_OWN} AND e.status = '{status}'), 0L,
                   (acc, e) -> acc | shiftleft(1L, e.step))"""
        for name, status in (
            ("m_applied", "applied"),
            ("m_failed", "failed"),
            ("m_committed", "committed"),
            ("m_compensated", "compensated"),
            ("m_comp_failed", "compensation_failed"),
        )
    }
    own_mask["m_confirm"] = f"""aggregate(filter(events, e -> {_OWN} AND e.status = 'applied'
        AND e.confirm), 0L, (acc, e) -> acc | shiftleft(1L, e.step))"""
    own_mask["m_reported"] = (
        f"aggregate(filter(events, e -> {_OWN}), 0L, (acc, e) -> acc | shiftleft(1L, e.step))"
    )
    frame = grouped.selectExpr(
        "*",
        "coalesce(size(req.parts), 0) AS n",
    ).selectExpr(
        "*",
        "CASE WHEN n >= 64 THEN -1L ELSE shiftleft(1L, n) - 1L END AS m_all",
        f"size(filter(events, e -> NOT {_OWN})) AS stray",
    )
    frame = frame.selectExpr(
        *(c for c in frame.columns if c not in own_mask),
        *(f"CASE WHEN stray > 0 THEN {own_mask[m]} ELSE {m} END AS {m}" for m in own_mask),
    )
    # A request naming a participant the coordinator was told does not exist is rolled
    # back at once, and the coordinator counts that step as compensated itself: no
    # participant will ever report it. The decision's reason names them.
    unknown = f"""CASE WHEN dec.reason LIKE '%{_UNKNOWN}%' THEN aggregate(
            filter(sequence(0, greatest(n - 1, 0)), i -> i < n AND array_contains(
                split(substring_index(dec.reason, '{_UNKNOWN}', -1), ', '),
                try_element_at(req.parts, i + 1))),
            0L, (acc, i) -> acc | shiftleft(1L, i)) ELSE 0L END"""
    frame = frame.withColumn("m_compensated", F.expr(f"m_compensated | {unknown}"))
    frame = frame.selectExpr(
        "*",
        "dec.outcome AS outcome",
        """CASE WHEN dec.outcome = 'commit' THEN m_all & m_confirm & ~m_committed
                WHEN dec.outcome = 'rollback' THEN m_all & ~(m_compensated | m_resolved)
                ELSE 0L END AS m_unfinished""",
        "m_comp_failed & ~m_compensated & ~m_resolved AS m_comp_open",
    )

    late = f"""array_join(array_sort(array_distinct(transform(filter(events, a ->
        {_own("a")} AND a.status = 'applied' AND a.at_ms > req.deadline_ms
        AND NOT exists(events, b -> b.step = a.step AND b.participant = a.participant
                       AND b.status = 'applied' AND b.at_ms <= req.deadline_ms)),
        a -> a.step))), ', ')"""
    reopened = f"""array_join(array_sort(array_distinct(transform(filter(events, a ->
        {_own("a")} AND a.status = 'applied'
        AND exists(events, c -> c.step = a.step AND c.participant = a.participant
                   AND c.status = 'compensated' AND c.off < a.off)),
        a -> a.step))), ', ')"""
    findings = [
        _finding(
            "I1",
            "size(outcomes) > 1",
            "concat('decided both commit and rollback (', n_decisions, ' decision records)')",
        ),
        _finding(
            "I1",
            "req IS NULL AND n_events > 0",
            "concat('step events (', n_events, ') for a transaction whose request is not in "
            "the log')",
        ),
        _finding(
            "I2",
            "req IS NULL AND array_contains(outcomes, 'commit')",
            "'commit decided, but the request is not in the log'",
        ),
        _finding(
            "I2",
            "req IS NOT NULL AND outcome = 'commit' AND (m_all & ~m_applied) != 0L",
            f"concat('commit, but step(s) ', {_steps_of('m_all & ~m_applied')}, "
            "' never reported applied')",
        ),
        _finding(
            "I2",
            "outcome = 'commit' AND m_failed != 0L",
            f"concat('commit, but step(s) ', {_steps_of('m_failed')}, ' failed')",
        ),
        _finding(
            "I2",
            "outcome = 'commit' AND m_compensated != 0L",
            f"concat('commit, but step(s) ', {_steps_of('m_compensated')}, ' were compensated')",
        ),
        _finding(
            "I3",
            "outcome = 'rollback' AND m_committed != 0L",
            f"concat('rollback, but step(s) ', {_steps_of('m_committed')}, ' were committed')",
        ),
        _finding(
            "I3",
            f"(m_applied & m_compensated) != 0L AND {reopened} != ''",
            f"concat('step(s) ', {reopened}, ' reported applied after being compensated')",
        ),
        _finding(
            "I3",
            f"max_applied_ms > req.deadline_ms AND {late} != ''",
            f"concat('step(s) ', {late}, ' first applied after the deadline ', req.deadline_ms)",
        ),
    ]
    due = as_of_ms - grace_ms
    return frame.selectExpr(
        "*",
        f"filter(array({', '.join(findings)}), f -> f IS NOT NULL) AS log_findings",
        f"""CASE
            WHEN req IS NULL THEN NULL
            WHEN n_decisions = 0 AND req.deadline_ms < {due} THEN 'stuck_no_decision'
            WHEN n_decisions = 0 THEN 'in_flight'
            WHEN m_comp_open != 0L AND outcome = 'rollback' THEN 'compensation_failed'
            WHEN m_unfinished != 0L AND dec.at_ms < {due} THEN 'stuck_unfinished'
            WHEN m_unfinished != 0L THEN 'in_flight'
            WHEN m_resolved != 0L AND outcome = 'rollback' THEN 'resolved_by_hand'
            ELSE 'ok' END AS progress""",
    )


# ---------------------------------------------------------------- I4: ledgers


def ledger_findings(
    frame: Any, ledgers: Any, covered: list[str], *, as_of_ms: int, grace_ms: int, window: bool
) -> Any:
    """Join the ledgers' step entries to ``frame`` and add ``ledger_findings`` (I4).

    A ledger entry whose change took effect (``effect``) must have its step's
    ``applied`` event from the same participant in the log, once the entry has
    been quiet for ``grace_ms`` (the event is emitted right after the local
    commit); a compensated one may have its ``compensated`` event instead: a
    participant killed between its local commit and its events, whose batch held
    the request and the rollback, re-reports only the step's latest state (found
    by the chaos suite). An ``applied`` event from a participant in ``covered``
    must have a ledger entry with ``effect``. Entries with an unresolved intent
    (MongoDB without transactions) are not judged. The entry's status is not
    compared with the decision for I4: a step with nothing to confirm stays
    ``applied`` in its ledger after the commit (its participant does nothing on
    commit). The I7 findings (:func:`._isolation.early_effects`) join them.
    """
    from pyspark.sql import functions as F

    entries = ledgers.groupBy("tx_id").agg(
        F.expr(
            "collect_list(named_struct('participant', participant, 'step', step, "
            "'status', status, 'effect', effect, 'updated_ms', updated_ms, "
            "'pending', pending, 'source', source, 'level', level))"
        ).alias("ledger")
    )
    how = "left" if window else "full"
    joined = frame.join(entries.withColumnRenamed("tx_id", "tx"), on="tx", how=how)
    if not window:
        # Transactions only the ledgers know: fill what the log would have given.
        joined = joined.withColumn("events", F.expr("coalesce(events, array())"))
    covered_sql = "array(" + ", ".join(f"'{c}'" for c in covered) + ")" if covered else "array()"
    quiet = as_of_ms - grace_ms
    store_only = f"""transform(filter(coalesce(ledger, array()), l -> l.effect AND NOT l.pending
            AND l.updated_ms <= {quiet}
            AND NOT exists(events, e -> e.step = l.step AND e.participant = l.participant
                           AND (e.status = 'applied'
                                OR (l.status = 'compensated' AND e.status = 'compensated')))),
        l -> named_struct('invariant', 'I4', 'reason', concat('step ', l.step,
            ' took effect in ', l.source, ' (participant ', l.participant, ', ledger status ',
            l.status, ') but the log has no applied event for it')))"""
    log_only = f"""transform(array_distinct(transform(filter(events, e -> e.status = 'applied'
            AND array_contains({covered_sql}, e.participant)
            AND NOT exists(coalesce(ledger, array()), l -> l.participant = e.participant
                           AND l.step = e.step AND (l.effect OR l.pending))),
            e -> named_struct('step', e.step, 'participant', e.participant))),
        x -> named_struct('invariant', 'I4', 'reason', concat('the log says step ', x.step,
            ' was applied by ', x.participant, ', but its ledger has no effect recorded')))"""
    return joined.selectExpr(
        "*",
        f"concat({store_only}, {log_only}, {early_effects(quiet)}) AS ledger_findings",
        "size(coalesce(ledger, array())) AS ledger_entries",
    ).drop("ledger")


# ---------------------------------------------------------------- the verdict


def classify(frame: Any, *, as_of_ms: int) -> Any:
    """The final ``class``, ``invariants``, ``reasons`` and replay plan of every transaction.

    ``frame`` has ``log_findings``, ``ledger_findings``, ``dlq_findings`` and
    ``progress``. ``replay`` says what :mod:`._replay` re-publishes: a
    ``stuck_no_decision`` transaction gets its ``request`` again; a
    ``stuck_unfinished`` one its ``decision``, and its request too
    (``decision+request``) when a step that must still answer never answered at
    all (its participant may have missed the request as well) and the deadline
    has passed, so that the repeated request can no longer apply anything.
    """
    return (
        frame.selectExpr(
            "*",
            "concat(coalesce(log_findings, array()), coalesce(ledger_findings, array()), "
            "coalesce(dlq_findings, array())) AS findings",
        )
        .selectExpr(
            "tx AS tx_id",
            f"{classed('findings', 'progress')} AS class",
            "array_sort(array_distinct(transform(findings, f -> f.invariant))) AS invariants",
            "transform(findings, f -> concat(f.invariant, ': ', f.reason)) AS reasons",
            "req.saga AS saga",
            "req.mode AS mode",
            "n AS steps",
            "outcome",
            "outcomes",
            "n_requests AS requests",
            "n_decisions AS decisions",
            "n_events AS events",
            "n_event_records AS event_records",
            "n_aborts",
            "n_resolves",
            "CASE WHEN ops IS NULL THEN 0 ELSE size(ops) END AS n_ops",
            "bad_requests",
            "bad_events",
            "bad_decisions",
            "forged_requests",
            "forged_events",
            "forged_decisions",
            "n_explained AS explained",
            """CASE WHEN first_explained IS NOT NULL THEN concat(first_explained.src, '[',
                first_explained.part, ']@', first_explained.off, ': ',
                first_explained.reason) END AS first_explained""",
            "req.created_ms AS created_ms",
            "req.deadline_ms AS deadline_ms",
            "dec.at_ms AS decided_ms",
            "dec.reason AS decision_reason",
            """CASE WHEN m_unfinished != 0L THEN
              transform(filter(sequence(0, 63), i -> (m_unfinished & shiftleft(1L, i)) != 0L),
                        i -> i) END AS unfinished_steps""",
            "named_struct('part', req.part, 'off', req.off) AS request_at",
            "named_struct('part', dec.part, 'off', dec.off) AS decision_at",
            "(m_unfinished & m_all & ~m_reported) != 0L AS silent_unfinished",
        )
        .selectExpr(
            "*",
            f"""CASE class
            WHEN 'stuck_no_decision' THEN 'request'
            WHEN 'stuck_unfinished' THEN
                CASE WHEN silent_unfinished AND deadline_ms < {as_of_ms}
                     THEN 'decision+request' ELSE 'decision' END
            END AS replay""",
        )
    )
