"""The audit proper: log records in, one row per transaction out, each classified.

Everything here is Spark SQL on the JVM: records are parsed with ``from_json``
and explicit schemas, checked against the wire contract with column
expressions, and folded into one row per transaction in a single aggregation.
No Python function runs per record.

Validity: one definition of an acceptable record serves the codec, the
coordinator, the participants and this audit (:mod:`streams._limits`). The audit
takes it in two parts.

* What Spark SQL can check, it checks, with the numbers of
  :mod:`streams._limits` (mirroring ``streams/schemas/*.json``; ``streams._codec``
  stays the authority): key and value together at most ``MAX_RECORD_BYTES``; the
  value valid UTF-8 and exactly one JSON object, nothing but blanks after its
  closing brace (strict JSON: no single quotes, no ``NaN``); the object's keys
  among the schema's properties; ``v`` is 1, ``type`` is the topic's type; every
  required field present with the right JSON type (integers as integers, within
  the signed 64-bit range: ``from_json`` gives NULL for a ``BIGINT`` beyond it);
  strings match their patterns, anchored at the absolute end (Java's ``$`` also
  matches before a final line break, so ``(?!.)`` under ``(?s)`` is used), and
  enums; lengths (``saga``, names, ``reason``) and bounds (1-64 steps, step 0-63,
  ``deadline_ms >= created_ms``) hold; the record key is the ``tx_id``
  (consumers ignore a record keyed otherwise).
* On the rest the coordinator's verdict stands: a record of requests, events
  or decisions that has a dead letter from the coordinator (``saga.component``
  ``coordinator``) at its ``(saga.source.topic, saga.source.partition,
  saga.source.offset)`` is invalid here, whatever the checks above say. That
  covers what SQL cannot see -- how deep ``args`` and ``meta`` nest, numbers
  inside them, a number where a string is expected (``from_json`` reads it as
  its text), the keys of nested step objects -- and the records the coordinator
  ignores although they are well formed (a conflicting resubmission, an abort
  after the decision). The coordinator writes exactly one dead letter per record
  it rejects, in the same Kafka transaction as the offsets that skip it, so a
  record it has read is either in the DLQ or accepted.

Invalid records are counted and left out of the audit (neither a transaction's
record, nor stuck, nor replayed), as every consumer leaves them out. A record
the coordinator has not read yet and the checks above pass counts as valid
until its dead letter appears.

Per step, the statuses its participant reported are kept as bit masks
(``steps`` are at most 64), so the checks are bit operations; the events list
is looked at only for transactions whose masks say it matters.

Classes, most severe first: ``violation`` (an invariant is broken; the row
names which and why), ``compensation_failed``, ``stuck_no_decision`` (no
decision ``grace`` after the deadline), ``stuck_unfinished`` (a decision, and
``grace`` after it a step still lacks ``committed``/``compensated``),
``in_flight`` (still within its deadline or grace), ``ok``.
"""

from __future__ import annotations

from typing import Any, Final

from streams._limits import (
    MAX_KEY_BYTES,
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    MAX_RECORD_BYTES,
    MAX_SAGA_CHARS,
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
    "compensation_failed",
    "stuck_no_decision",
    "stuck_unfinished",
    "in_flight",
    "ok",
)
INVARIANTS: Final = ("I1", "I2", "I3", "I4", "I6")
EVENT_STATUSES: Final = ("applied", "failed", "committed", "compensated", "compensation_failed")

# Patterns anchored at both ends of the whole string: `$` in a Java regex also matches
# before a final line terminator ("tx\n" would pass); `(?!.)` with DOTALL (`(?s)`)
# matches only at the very end. No backslash, so the SQL text reads the same whatever
# spark.sql.parser.escapedStringLiterals says.
_TX_ID: Final = f"(?s)^[A-Za-z0-9._:-]{{1,{MAX_KEY_BYTES}}}(?!.)"
"""A ``tx_id`` (also the record key, so at most ``MAX_KEY_BYTES`` ASCII characters)."""
_NAME: Final = f"(?s)^[A-Za-z0-9._-]{{1,{MAX_NAME_CHARS}}}(?!.)"
"""A participant or action name."""
_UNKNOWN: Final = "names unknown participant(s): "
"""How the coordinator's rollback reason lists the participants that do not exist."""
_JSON_OPTIONS: Final = {"allowSingleQuotes": "false", "allowNonNumericNumbers": "false"}
"""Strict JSON, as the codec reads it (Spark allows single quotes and NaN by default)."""

_UNION_COLUMNS: Final = (
    ("tx", "string"),
    ("src", "string"),
    ("kind", "string"),
    ("part", "int"),
    ("off", "bigint"),
    ("saga", "string"),
    ("mode", "string"),
    ("parts", "array<string>"),
    ("deadline_ms", "bigint"),
    ("created_ms", "bigint"),
    ("step", "int"),
    ("participant", "string"),
    ("status", "string"),
    ("outcome", "string"),
    ("at_ms", "bigint"),
    ("reason", "string"),
)

_REQUESTS_SCHEMA: Final = (
    "v BIGINT, type STRING, tx_id STRING, saga STRING, mode STRING, "
    "steps ARRAY<STRUCT<participant: STRING, action: STRING, args: STRING>>, "
    "deadline_ms BIGINT, created_ms BIGINT, meta STRING, reason STRING, at_ms BIGINT"
)
_EVENTS_SCHEMA: Final = (
    "v BIGINT, type STRING, tx_id STRING, step BIGINT, participant STRING, status STRING, "
    "reason STRING, at_ms BIGINT"
)
_DECISIONS_SCHEMA: Final = (
    "v BIGINT, type STRING, tx_id STRING, outcome STRING, reason STRING, at_ms BIGINT"
)


def _keys_within(*names: str) -> str:
    allowed = ", ".join(f"'{n}'" for n in names)
    return f"(keys IS NOT NULL AND size(array_except(keys, array({allowed}))) = 0)"


def _common(type_name: str) -> str:
    """SQL: what every record holds: ``whole`` (see :func:`_parsed`), version, type, ``tx_id``."""
    return (
        f"whole AND r.v = 1 AND r.type = '{type_name}' AND r.tx_id RLIKE '{_TX_ID}' AND k = r.tx_id"
    )


def _reason(required: bool) -> str:
    bounded = f"length(r.reason) <= {MAX_REASON_CHARS}"
    return f"r.reason IS NOT NULL AND {bounded}" if required else f"(r.reason IS NULL OR {bounded})"


_REQUEST_KEYS: Final = _keys_within(
    "v", "type", "tx_id", "saga", "mode", "steps", "deadline_ms", "created_ms", "meta"
)
_EVENT_KEYS: Final = _keys_within(
    "v", "type", "tx_id", "step", "participant", "status", "reason", "at_ms"
)
_REQUEST_VALID: Final = f"""coalesce(
    {_common("saga.request")}
    AND {_REQUEST_KEYS}
    AND length(r.saga) BETWEEN 1 AND {MAX_SAGA_CHARS}
    AND (r.mode IN ('parallel', 'sequential') OR NOT array_contains(keys, 'mode'))
    AND size(r.steps) BETWEEN 1 AND 64
    AND forall(r.steps, s -> s.participant RLIKE '{_NAME}' AND s.action RLIKE '{_NAME}'
                             AND (s.args IS NULL OR startswith(s.args, '{{')))
    AND r.created_ms >= 0 AND r.deadline_ms >= r.created_ms
    AND (r.meta IS NULL OR startswith(r.meta, '{{')), false)"""

_ABORT_VALID: Final = f"""coalesce(
    {_common("saga.abort")}
    AND {_keys_within("v", "type", "tx_id", "reason", "at_ms")}
    AND {_reason(required=True)} AND r.at_ms >= 0, false)"""

_EVENT_VALID: Final = f"""coalesce(
    {_common("saga.step")}
    AND {_EVENT_KEYS}
    AND r.step BETWEEN 0 AND 63 AND r.participant RLIKE '{_NAME}'
    AND r.status IN ({", ".join(f"'{s}'" for s in EVENT_STATUSES)})
    AND {_reason(required=False)} AND r.at_ms >= 0, false)"""

_DECISION_VALID: Final = f"""coalesce(
    {_common("saga.decision")}
    AND {_keys_within("v", "type", "tx_id", "outcome", "reason", "at_ms")}
    AND r.outcome IN ('commit', 'rollback') AND {_reason(required=True)} AND r.at_ms >= 0,
    false)"""


def _parsed(raw: Any, schema: str, rejected: Any) -> Any:
    """The Kafka records of one topic with the columns the validity checks read.

    ``r``: the value parsed with ``schema``; ``keys``: its top-level keys; ``k``: the
    key. ``whole``: the record is within the size limit, valid UTF-8, exactly one
    JSON object and not rejected by the coordinator (``rejected``: a frame of
    ``partition, offset``, or None).

    One object and nothing after it: the value ``T`` is parsed as ``[T]``, which
    must hold one element, then -- only if ``T`` holds a ``]`` -- counted as
    ``[T,0]``, which must hold two. ``from_json`` stops at the array's close and
    ignores what follows, so ``[T]`` alone takes ``{..}]{..}`` for one object and
    ``[T,0]`` alone takes ``{..},0],{..}``; a ``T`` that passes both is one JSON
    value and blanks (after one value, ``[T]`` closes early only at a ``]`` of
    ``T``, and then ``[T,0]`` closes there too, with one element).
    """
    from pyspark.sql import functions as F

    if rejected is not None:
        marked = rejected.select("partition", "offset", F.lit(True).alias("dead"))
        raw = raw.join(F.broadcast(marked), on=["partition", "offset"], how="left")
    else:
        raw = raw.withColumn("dead", F.lit(False))
    text = F.col("value").cast("string")
    wrapped = F.from_json(
        F.concat(F.lit("["), text, F.lit("]")), f"ARRAY<STRUCT<{schema}>>", _JSON_OPTIONS
    )
    return raw.select(
        F.col("key").cast("string").alias("k"),
        F.col("partition").alias("part"),
        F.col("offset").alias("off"),
        wrapped.alias("objects"),
        F.json_object_keys(text).alias("keys"),
        F.expr(
            f"NOT coalesce(dead, false) "
            f"AND coalesce(octet_length(key), 0) + coalesce(octet_length(value), 0) "
            f"<= {MAX_RECORD_BYTES} "
            "AND is_valid_utf8(CAST(value AS STRING))"
        ).alias("sound"),
        text.alias("text"),
    ).selectExpr(
        "k",
        "part",
        "off",
        "keys",
        "try_element_at(objects, 1) AS r",
        """coalesce(sound AND size(objects) = 1 AND (NOT contains(text, ']')
            OR json_array_length(concat('[', text, ',0]')) = 2), false) AS whole""",
    )


def _union_row(frame: Any, src: str, **columns: str) -> Any:
    """``frame`` projected onto the union's columns; ``columns`` are SQL for the others."""
    from pyspark.sql import functions as F

    fixed = {"src": f"'{src}'", "part": "part", "off": "off", **columns}
    return frame.select(
        *(
            F.expr(fixed[name]).cast(kind).alias(name)
            if name in fixed
            else F.lit(None).cast(kind).alias(name)
            for name, kind in _UNION_COLUMNS
        )
    )


def parse_requests(raw: Any, rejected: Any = None) -> Any:
    """``saga.request`` and ``saga.abort`` records of the requests topic, or ``invalid``."""
    checked = _parsed(raw, _REQUESTS_SCHEMA, rejected).selectExpr(
        "*",
        f"CASE WHEN {_REQUEST_VALID} THEN 'request' WHEN {_ABORT_VALID} THEN 'abort' "
        "ELSE 'invalid' END AS kind",
    )
    return _union_row(
        checked,
        "requests",
        tx="CASE WHEN kind = 'invalid' THEN NULL ELSE r.tx_id END",
        kind="kind",
        saga="CASE WHEN kind = 'request' THEN r.saga END",
        mode="CASE WHEN kind = 'request' THEN coalesce(r.mode, 'parallel') END",
        parts="CASE WHEN kind = 'request' THEN transform(r.steps, s -> s.participant) END",
        deadline_ms="CASE WHEN kind = 'request' THEN r.deadline_ms END",
        created_ms="CASE WHEN kind = 'request' THEN r.created_ms END",
        at_ms="CASE WHEN kind = 'abort' THEN r.at_ms END",
        reason="CASE WHEN kind = 'abort' THEN r.reason END",
    )


def parse_events(raw: Any, rejected: Any = None) -> Any:
    """``saga.step`` records of the events topic, or ``invalid``."""
    checked = _parsed(raw, _EVENTS_SCHEMA, rejected).selectExpr(
        "*", f"CASE WHEN {_EVENT_VALID} THEN 'event' ELSE 'invalid' END AS kind"
    )
    valid = "kind = 'event'"
    return _union_row(
        checked,
        "events",
        tx=f"CASE WHEN {valid} THEN r.tx_id END",
        kind="kind",
        step=f"CASE WHEN {valid} THEN r.step END",
        participant=f"CASE WHEN {valid} THEN r.participant END",
        status=f"CASE WHEN {valid} THEN r.status END",
        at_ms=f"CASE WHEN {valid} THEN r.at_ms END",
        reason=f"CASE WHEN {valid} THEN r.reason END",
    )


def parse_decisions(raw: Any, rejected: Any = None) -> Any:
    """``saga.decision`` records of the decisions topic, or ``invalid``."""
    checked = _parsed(raw, _DECISIONS_SCHEMA, rejected).selectExpr(
        "*", f"CASE WHEN {_DECISION_VALID} THEN 'decision' ELSE 'invalid' END AS kind"
    )
    valid = "kind = 'decision'"
    return _union_row(
        checked,
        "decisions",
        tx=f"CASE WHEN {valid} THEN r.tx_id END",
        kind="kind",
        outcome=f"CASE WHEN {valid} THEN r.outcome END",
        at_ms=f"CASE WHEN {valid} THEN r.at_ms END",
        reason=f"CASE WHEN {valid} THEN r.reason END",
    )


# ---------------------------------------------------------------- one row per transaction


def _mask(status: str) -> str:
    return (
        f"bit_or(CASE WHEN kind = 'event' AND status = '{status}' "
        "THEN shiftleft(1L, step) ELSE 0L END)"
    )


_AGGREGATES: Final = {
    "n_requests": "count_if(kind = 'request')",
    "n_aborts": "count_if(kind = 'abort')",
    "n_events": "count_if(kind = 'event')",
    "n_decisions": "count_if(kind = 'decision')",
    "bad_requests": "count_if(kind = 'invalid' AND src = 'requests')",
    "bad_events": "count_if(kind = 'invalid' AND src = 'events')",
    "bad_decisions": "count_if(kind = 'invalid' AND src = 'decisions')",
    # The first request and decision by offset: all records of a transaction share
    # one partition (key = tx_id), and consumers act on the first.
    "req": """min(CASE WHEN kind = 'request' THEN named_struct('off', off, 'part', part,
        'saga', saga, 'mode', mode, 'parts', parts, 'deadline_ms', deadline_ms,
        'created_ms', created_ms) END)""",
    "dec": """min(CASE WHEN kind = 'decision' THEN named_struct('off', off, 'part', part,
        'outcome', outcome, 'at_ms', at_ms, 'reason', reason) END)""",
    "outcomes": "array_sort(collect_set(CASE WHEN kind = 'decision' THEN outcome END))",
    "events": """collect_list(CASE WHEN kind = 'event' THEN named_struct('step', step,
        'participant', participant, 'status', status, 'at_ms', at_ms, 'off', off) END)""",
    "max_applied_ms": "max(CASE WHEN kind = 'event' AND status = 'applied' THEN at_ms END)",
    "m_applied": _mask("applied"),
    "m_failed": _mask("failed"),
    "m_committed": _mask("committed"),
    "m_compensated": _mask("compensated"),
    "m_comp_failed": _mask("compensation_failed"),
    "m_reported": "bit_or(CASE WHEN kind = 'event' THEN shiftleft(1L, step) ELSE 0L END)",
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
        """CASE WHEN dec.outcome = 'commit' THEN m_all & ~m_committed
                WHEN dec.outcome = 'rollback' THEN m_all & ~m_compensated
                ELSE 0L END AS m_unfinished""",
        "m_comp_failed & ~m_compensated AS m_comp_open",
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
    (MongoDB without transactions) are not judged.
    """
    from pyspark.sql import functions as F

    entries = ledgers.groupBy("tx_id").agg(
        F.expr(
            "collect_list(named_struct('participant', participant, 'step', step, "
            "'status', status, 'effect', effect, 'updated_ms', updated_ms, "
            "'pending', pending, 'source', source))"
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
        f"concat({store_only}, {log_only}) AS ledger_findings",
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
            """CASE WHEN size(findings) > 0 THEN 'violation' ELSE coalesce(progress, 'ok') END
            AS class""",
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
            "n_aborts",
            "bad_requests",
            "bad_events",
            "bad_decisions",
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
