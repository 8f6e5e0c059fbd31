"""Log records in: each parsed and checked against the wire contract, or ``invalid``.

Everything here is Spark SQL on the JVM: records are parsed with ``from_json``
and explicit schemas and checked with column expressions; no Python function
runs per record, but for the signature check when there is a key folder. Each
topic's records come out as rows of one union (the columns of ``_UNION_COLUMNS``),
which :mod:`._audit` folds into one row per transaction.

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
* A ``saga.committed`` (one participant's ``committed`` acknowledgements of one
  batch, :class:`streams._records.StepsCommitted`) is checked the same way, each
  listed ``[tx_id, step]`` pair exactly (a string and an integer literal, read from
  a ``VARIANT`` so that ``"0"`` or ``1.0`` do not pass for a step; 1 to 1,000
  pairs, none listed twice; the key is the first ``tx_id``), and every ``tx_id``
  it lists must belong on the partition the record sits on (murmur2, as
  :func:`streams.kafka.partition_for` computes it, in SQL: :func:`partition_sql`),
  as the coordinator requires: one listing a ``tx_id`` of another partition is
  ``invalid``, with that as its ``reason``. A valid one comes out as one
  ``committed`` event row per pair, exactly as if each had been a ``saga.step``
  of that step, participant and ``at_ms`` at the record's offset (``lead`` marks
  the first row of each record, so records can still be counted).
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

Signed records: with a key folder, a record is also invalid unless a principal
allowed to write it signed it (:mod:`._signatures`: requests and aborts
``client`` or ``operator``, a step event or a ``saga.committed`` of P
``participant-P``, a decision ``coordinator``); ``forged`` marks those records
(counted apart in the summary).

Invalid records are counted and left out of the audit (neither a transaction's
record, nor stuck, nor replayed), as every consumer leaves them out. A record
the coordinator has not read yet and the checks above pass counts as valid
until its dead letter appears.
"""

from __future__ import annotations

from typing import Any, Final

from saga.streams._limits import (
    MAX_KEY_BYTES,
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    MAX_RECORD_BYTES,
    MAX_SAGA_CHARS,
)
from saga.streams.reconcile._signatures import REQUEST_SIGNERS, SignerColumn

__all__ = [
    "EVENT_STATUSES",
    "parse_decisions",
    "parse_events",
    "parse_requests",
    "partition_sql",
]

EVENT_STATUSES: Final = ("applied", "failed", "committed", "compensated", "compensation_failed")

# Patterns anchored at both ends of the whole string: `$` in a Java regex also matches
# before a final line terminator ("tx\n" would pass); `(?!.)` with DOTALL (`(?s)`)
# matches only at the very end. No backslash, so the SQL text reads the same whatever
# spark.sql.parser.escapedStringLiterals says.
_TX_ID: Final = f"(?s)^[A-Za-z0-9._:-]{{1,{MAX_KEY_BYTES}}}(?!.)"
"""A ``tx_id`` (also the record key, so at most ``MAX_KEY_BYTES`` ASCII characters)."""
_NAME: Final = f"(?s)^[A-Za-z0-9._-]{{1,{MAX_NAME_CHARS}}}(?!.)"
"""A participant or action name."""
_MAX_ACKS: Final = 1000
"""Most ``[tx_id, step]`` pairs one ``saga.committed`` lists (its schema's ``maxItems``)."""
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
    ("forged", "boolean"),
    ("actor", "string"),
    ("note", "string"),
    ("redriven", "string"),
    ("rkey", "string"),
    ("confirm", "boolean"),
    ("isolation", "string"),
    ("actions", "array<string>"),
    ("lead", "boolean"),
)

_REQUESTS_SCHEMA: Final = (
    "v BIGINT, type STRING, tx_id STRING, saga STRING, mode STRING, isolation STRING, "
    "steps ARRAY<STRUCT<participant: STRING, action: STRING, args: STRING>>, "
    "deadline_ms BIGINT, created_ms BIGINT, meta STRING, reason STRING, at_ms BIGINT, "
    "step BIGINT, note STRING, by STRING"
)
_EVENTS_SCHEMA: Final = (
    "v BIGINT, type STRING, tx_id STRING, step BIGINT, participant STRING, status STRING, "
    "reason STRING, at_ms BIGINT, confirm BOOLEAN, steps VARIANT"
)
"""``saga.step`` and ``saga.committed``; ``steps`` (the latter's pairs) as a ``VARIANT``,
which keeps each value's JSON type."""
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
    "v", "type", "tx_id", "saga", "mode", "isolation", "steps", "deadline_ms", "created_ms", "meta"
)
_EVENT_KEYS: Final = _keys_within(
    "v", "type", "tx_id", "step", "participant", "status", "reason", "at_ms", "confirm"
)
_REQUEST_VALID: Final = f"""coalesce(
    {_common("saga.request")}
    AND {_REQUEST_KEYS}
    AND length(r.saga) BETWEEN 1 AND {MAX_SAGA_CHARS}
    AND (r.mode IN ('parallel', 'sequential') OR NOT array_contains(keys, 'mode'))
    AND (r.isolation IN ('read_committed', 'none') OR NOT array_contains(keys, 'isolation'))
    AND size(r.steps) BETWEEN 1 AND 64
    AND forall(r.steps, s -> s.participant RLIKE '{_NAME}' AND s.action RLIKE '{_NAME}'
                             AND (s.args IS NULL OR startswith(s.args, '{{')))
    AND r.created_ms >= 0 AND r.deadline_ms >= r.created_ms
    AND (r.meta IS NULL OR startswith(r.meta, '{{')), false)"""

_OPERATOR_NAME: Final = "length(r.by) BETWEEN 1 AND 200"
"""An operator's name (``by``) as the abort and resolve schemas bound it."""

_ABORT_VALID: Final = f"""coalesce(
    {_common("saga.abort")}
    AND {_keys_within("v", "type", "tx_id", "reason", "at_ms", "by")}
    AND (r.by IS NULL OR {_OPERATOR_NAME})
    AND {_reason(required=True)} AND r.at_ms >= 0, false)"""

# A resolve is the operator's alone: with signatures on, only the operator key counts.
_RESOLVE_VALID: Final = f"""coalesce(
    {_common("saga.resolve")}
    AND {_keys_within("v", "type", "tx_id", "step", "note", "by", "at_ms")}
    AND r.step BETWEEN 0 AND 63 AND length(r.note) BETWEEN 1 AND {MAX_REASON_CHARS}
    AND {_OPERATOR_NAME} AND r.at_ms >= 0
    AND (NOT signed OR coalesce(by = 'operator', false)), false)"""

_EVENT_VALID: Final = f"""coalesce(
    {_common("saga.step")}
    AND {_EVENT_KEYS}
    AND r.step BETWEEN 0 AND 63 AND r.participant RLIKE '{_NAME}'
    AND r.status IN ({", ".join(f"'{s}'" for s in EVENT_STATUSES)})
    AND {_reason(required=False)} AND r.at_ms >= 0
    AND (r.confirm IS NOT NULL OR NOT array_contains(keys, 'confirm')), false)"""
"""A step event. ``confirm`` is optional and boolean: ``from_json`` gives NULL for
``null``, a string or a number there, which the schema rejects too."""

_ACKS: Final = """CASE WHEN r.type = 'saga.committed' THEN transform(
    transform(try_cast(r.steps AS ARRAY<VARIANT>), e -> try_cast(e AS ARRAY<VARIANT>)),
    p -> named_struct('n', size(p),
        'tx', CASE WHEN schema_of_variant(get(p, 0)) = 'STRING'
                   THEN try_variant_get(get(p, 0), '$', 'string') END,
        'step', CASE WHEN schema_of_variant(get(p, 1)) = 'BIGINT'
                     THEN try_variant_get(get(p, 1), '$', 'bigint') END)) END"""
"""SQL: a ``saga.committed``'s ``steps`` as ``(n, tx, step)`` structs (NULL for any other
record): ``n`` the pair's length, ``tx`` its first value only if a JSON string, ``step``
its second only if a JSON integer (``schema_of_variant`` says ``BIGINT`` for an integer
literal, ``DECIMAL`` for ``1.0``, ``STRING`` for ``"1"``)."""

_COMMITTED_VALID: Final = f"""coalesce(
    whole AND r.v = 1 AND r.type = 'saga.committed'
    AND {_keys_within("v", "type", "participant", "at_ms", "steps")}
    AND r.participant RLIKE '{_NAME}' AND r.at_ms >= 0
    AND size(acks) BETWEEN 1 AND {_MAX_ACKS}
    AND forall(acks, a -> a.n = 2 AND a.tx RLIKE '{_TX_ID}' AND a.step BETWEEN 0 AND 63)
    AND size(array_distinct(transform(acks, a -> struct(a.tx, a.step)))) = size(acks)
    AND k = try_element_at(acks, 1).tx, false)"""
"""A ``saga.committed``, but for where its ``tx_id``s belong (``acks``: :data:`_ACKS`)."""


def _mul(a: str) -> str:
    """SQL: ``a * m`` in 32 bits (murmur2's ``m``); ``a`` is below 2**32, so the
    product stays below 2**63: no ``BIGINT`` overflow, even with ANSI mode on."""
    return f"((({a}) * 1540483477L) & 4294967295L)"


def _let(value: str, name: str, body: str) -> str:
    """SQL: ``body`` with ``name`` bound to ``value`` (a ``BIGINT``), computed once."""
    return f"aggregate(array({value}), 0L, (_, {name}) -> {body})"


def partition_sql(key: str, partitions: int) -> str:
    """SQL: the partition among ``partitions`` of the records keyed by ``key``, an SQL
    string of ASCII characters (a ``tx_id``), as :func:`streams.kafka.partition_for`
    gives it: Kafka's murmur2 of the key's bytes, made positive, modulo ``partitions``.

    Spark SQL has no murmur2 (its ``hash`` is murmur3), so this spells it out with
    32-bit values held in ``BIGINT`` (masked after each product, never overflowing):
    4-byte little-endian blocks, then the 1 to 3 bytes left, then the final mix.
    """
    n = f"length({key})"

    def byte(at: str) -> str:
        return f"CAST(ascii(substr({key}, {at}, 1)) & 255 AS BIGINT)"

    word = (
        f"({byte('4 * i + 1')} | shiftleft({byte('4 * i + 2')}, 8) "
        f"| shiftleft({byte('4 * i + 3')}, 16) | shiftleft({byte('4 * i + 4')}, 24))"
    )
    blocks = f"IF({n} >= 4, sequence(0, {n} div 4 - 1), array())"
    mixed = (
        f"transform(transform({blocks}, i -> {_mul(word)}), "
        f"k -> {_mul('k ^ shiftrightunsigned(k, 24)')})"
    )
    body = f"aggregate({mixed}, 2538058380L ^ {n}, (h, k) -> {_mul('h')} ^ k)"
    end = f"({n} - {n} % 4)"
    third = f"CASE WHEN {n} % 4 = 3 THEN shiftleft({byte(end + ' + 3')}, 16) ELSE 0L END"
    second = f"CASE WHEN {n} % 4 >= 2 THEN shiftleft({byte(end + ' + 2')}, 8) ELSE 0L END"
    rest = _mul(f"h ^ ({third}) ^ ({second}) ^ {byte(end + ' + 1')}")
    tail = f"CASE WHEN {n} % 4 = 0 THEN h ELSE {rest} END"
    mixed_tail = _let(body, "h", _let(tail, "t", _mul("t ^ shiftrightunsigned(t, 13)")))
    final = _let(mixed_tail, "u", "u ^ shiftrightunsigned(u, 15)")
    return f"CAST(pmod({final} & 2147483647L, {partitions}) AS INT)"


_DECISION_VALID: Final = f"""coalesce(
    {_common("saga.decision")}
    AND {_keys_within("v", "type", "tx_id", "outcome", "reason", "at_ms")}
    AND r.outcome IN ('commit', 'rollback') AND {_reason(required=True)} AND r.at_ms >= 0,
    false)"""


def _parsed(raw: Any, schema: str, rejected: Any, signer: SignerColumn | None) -> Any:
    """The Kafka records of one topic with the columns the validity checks read.

    ``r``: the value parsed with ``schema``; ``keys``: its top-level keys; ``k``: the
    key. ``whole``: the record is within the size limit, valid UTF-8, exactly one
    JSON object and not rejected by the coordinator (``rejected``: a frame of
    ``partition, offset``, or None). ``by``: the record's valid signer, NULL when it
    has none or when ``signer`` is None (no key folder: ``signed`` is false); ``raw``
    then needs ``topic`` and ``headers`` too.

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
    if signer is not None:
        by = signer(F.col("topic"), F.col("key"), F.col("value"), F.col("headers"))
    else:
        by = F.lit(None).cast("string")
    wrapped = F.from_json(
        F.concat(F.lit("["), text, F.lit("]")), f"ARRAY<STRUCT<{schema}>>", _JSON_OPTIONS
    )
    # An operator's copy of a dead letter (`saga dlq redrive`) says so in two headers.
    if "headers" in raw.columns:
        redriven = F.expr(
            "concat(CAST(try_element_at(filter(headers, h -> h.key = 'saga.redriven.from'), -1)"
            ".value AS STRING), ' by ', coalesce(CAST(try_element_at(filter(headers, "
            "h -> h.key = 'saga.redriven.by'), -1).value AS STRING), '?'))"
        )
    else:
        redriven = F.lit(None).cast("string")
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
        by.alias("by"),
        F.lit(signer is not None).alias("signed"),
        redriven.alias("redriven"),
    ).selectExpr(
        "k",
        "part",
        "off",
        "keys",
        "by",
        "signed",
        "redriven",
        "try_element_at(objects, 1) AS r",
        """coalesce(sound AND size(objects) = 1 AND (NOT contains(text, ']')
            OR json_array_length(concat('[', text, ',0]')) = 2), false) AS whole""",
    )


def _signed_by(allowed: str) -> str:
    """SQL: the record's signer is one of ``allowed`` (SQL), or signatures are off."""
    return f"(NOT signed OR coalesce(by IN ({allowed}), false))"


_BY_REQUESTER: Final = _signed_by(", ".join(f"'{p}'" for p in REQUEST_SIGNERS))
# A `compensated` event may also be the coordinator's: the step of a participant that
# never announced itself, reported so that its sequential predecessor compensates.
_BY_PARTICIPANT: Final = _signed_by(
    "concat('participant-', r.participant), "
    "CASE WHEN r.status = 'compensated' THEN 'coordinator' END"
)
_BY_COORDINATOR: Final = _signed_by("'coordinator'")


def _union_row(frame: Any, src: str, **columns: str) -> Any:
    """``frame`` projected onto the union's columns; ``columns`` are SQL for the others."""
    from pyspark.sql import functions as F

    fixed = {
        "src": f"'{src}'",
        "part": "part",
        "off": "off",
        "forged": "forged",
        "redriven": "redriven",
        "rkey": "k",
        "lead": "true",
        **columns,
    }
    return frame.select(
        *(
            F.expr(fixed[name]).cast(kind).alias(name)
            if name in fixed
            else F.lit(None).cast(kind).alias(name)
            for name, kind in _UNION_COLUMNS
        )
    )


def parse_requests(raw: Any, rejected: Any = None, signer: SignerColumn | None = None) -> Any:
    """``saga.request``, ``saga.abort`` and ``saga.resolve`` records of the requests
    topic, or ``invalid``.

    ``signer`` (a key folder's, :func:`._signatures.signer_column`): only records
    signed by ``client`` or ``operator`` are valid (a resolve: ``operator`` only).
    ``actor`` is who acted (an abort's or resolve's ``by``; ``operator`` for an abort
    the operator key signed), ``note`` a resolve's note. ``isolation`` is the request's
    level as written (NULL when absent: a request older than the field, which the
    participants of its time applied without isolation), ``actions`` its steps' actions.
    """
    checked = _parsed(raw, _REQUESTS_SCHEMA, rejected, signer).selectExpr(
        "*", f"NOT {_BY_REQUESTER} AS forged"
    )
    checked = checked.selectExpr(
        "*",
        f"CASE WHEN forged THEN 'invalid' WHEN {_REQUEST_VALID} THEN 'request' "
        f"WHEN {_ABORT_VALID} THEN 'abort' WHEN {_RESOLVE_VALID} THEN 'resolve' "
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
        actions="CASE WHEN kind = 'request' THEN transform(r.steps, s -> s.action) END",
        isolation="CASE WHEN kind = 'request' THEN r.isolation END",
        deadline_ms="CASE WHEN kind = 'request' THEN r.deadline_ms END",
        created_ms="CASE WHEN kind = 'request' THEN r.created_ms END",
        at_ms="CASE WHEN kind IN ('abort', 'resolve') THEN r.at_ms END",
        reason="CASE WHEN kind = 'abort' THEN r.reason END",
        step="CASE WHEN kind = 'resolve' THEN r.step END",
        note="CASE WHEN kind = 'resolve' THEN r.note END",
        actor="""CASE WHEN kind = 'resolve' THEN r.by
            WHEN kind = 'abort' THEN coalesce(r.by, CASE WHEN by = 'operator' THEN by END) END""",
    )


def parse_events(
    raw: Any,
    rejected: Any = None,
    signer: SignerColumn | None = None,
    *,
    partitions: int | None = None,
) -> Any:
    """``saga.step`` and ``saga.committed`` records of the events topic, or ``invalid``.

    A valid ``saga.committed`` gives one ``event`` row per ``[tx_id, step]`` it lists,
    ``committed`` at its ``at_ms`` from its participant, as a ``saga.step`` of each
    would; ``lead`` is true on the first row of each record (one row for any other
    record). ``partitions`` (the topics' partition count): a ``saga.committed`` that
    lists a ``tx_id`` of another partition than its own is ``invalid``, its ``reason``
    saying which (without it, that rule is not applied).

    ``confirm``: the event's optional ``confirm`` (false when absent): an ``applied``
    step that said true expects a ``committed`` event once the commit is decided.
    ``signer``: only events signed by the participant they name are valid.
    """
    checked = _parsed(raw, _EVENTS_SCHEMA, rejected, signer).selectExpr(
        "*", f"NOT {_BY_PARTICIPANT} AS forged", f"{_ACKS} AS acks"
    )
    checked = checked.selectExpr("*", f"NOT forged AND {_COMMITTED_VALID} AS batch")
    if partitions is not None:
        home = partition_sql("a.tx", partitions)
        elsewhere = f"""CASE WHEN batch THEN try_element_at(filter(
            transform(acks, a -> named_struct('tx', a.tx, 'home', {home})),
            a -> a.home != part), 1) END"""
    else:
        elsewhere = "CAST(NULL AS STRUCT<tx: STRING, home: INT>)"
    checked = checked.selectExpr("*", f"{elsewhere} AS elsewhere").selectExpr(
        "*",
        f"""CASE WHEN NOT forged AND {_EVENT_VALID} THEN 'event'
            WHEN batch AND elsewhere IS NULL THEN 'event' ELSE 'invalid' END AS kind""",
    )
    # One row per step event: a saga.committed's pairs, else the record itself. The
    # record's parsed value (up to 1,000 pairs) is dropped first, not copied per pair.
    expanded = checked.selectExpr(
        "k",
        "part",
        "off",
        "forged",
        "redriven",
        "kind",
        "r.participant AS participant",
        "CASE WHEN batch THEN 'committed' ELSE r.status END AS status",
        "r.at_ms AS at_ms",
        """CASE WHEN kind = 'event' THEN r.reason WHEN elsewhere IS NOT NULL THEN
            concat('saga.committed lists ', elsewhere.tx, ', which belongs on partition ',
                   elsewhere.home, ', not ', part) END AS reason""",
        "r.confirm AS confirm",
        """explode(CASE
            WHEN kind = 'event' AND batch THEN transform(acks, (a, i) ->
                named_struct('tx', a.tx, 'step', CAST(a.step AS INT), 'lead', i = 0))
            WHEN kind = 'event' THEN
                array(named_struct('tx', r.tx_id, 'step', CAST(r.step AS INT), 'lead', true))
            ELSE array(named_struct('tx', CAST(NULL AS STRING), 'step', CAST(NULL AS INT),
                                    'lead', true)) END) AS e""",
    )
    valid = "kind = 'event'"
    return _union_row(
        expanded,
        "events",
        tx=f"CASE WHEN {valid} THEN e.tx END",
        kind="kind",
        step=f"CASE WHEN {valid} THEN e.step END",
        participant=f"CASE WHEN {valid} THEN participant END",
        status=f"CASE WHEN {valid} THEN status END",
        at_ms=f"CASE WHEN {valid} THEN at_ms END",
        reason="reason",
        confirm=f"CASE WHEN {valid} THEN coalesce(confirm, false) END",
        lead="e.lead",
        # An operator's redrive is of the record: shown once, not once per pair.
        redriven="CASE WHEN e.lead THEN redriven END",
    )


def parse_decisions(raw: Any, rejected: Any = None, signer: SignerColumn | None = None) -> Any:
    """``saga.decision`` records of the decisions topic, or ``invalid``.

    ``signer``: only decisions signed by the coordinator are valid.
    """
    checked = _parsed(raw, _DECISIONS_SCHEMA, rejected, signer).selectExpr(
        "*", f"NOT {_BY_COORDINATOR} AS forged"
    )
    checked = checked.selectExpr(
        "*",
        f"CASE WHEN NOT forged AND {_DECISION_VALID} THEN 'decision' ELSE 'invalid' END AS kind",
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
