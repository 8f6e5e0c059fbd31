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
``client`` or ``operator``, a step event of P ``participant-P``, a decision
``coordinator``); ``forged`` marks those records (counted apart in the summary).

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
)

_REQUESTS_SCHEMA: Final = (
    "v BIGINT, type STRING, tx_id STRING, saga STRING, mode STRING, isolation STRING, "
    "steps ARRAY<STRUCT<participant: STRING, action: STRING, args: STRING>>, "
    "deadline_ms BIGINT, created_ms BIGINT, meta STRING, reason STRING, at_ms BIGINT, "
    "step BIGINT, note STRING, by STRING"
)
_EVENTS_SCHEMA: Final = (
    "v BIGINT, type STRING, tx_id STRING, step BIGINT, participant STRING, status STRING, "
    "reason STRING, at_ms BIGINT, confirm BOOLEAN"
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


def parse_events(raw: Any, rejected: Any = None, signer: SignerColumn | None = None) -> Any:
    """``saga.step`` records of the events topic, or ``invalid``.

    ``confirm``: the event's optional ``confirm`` (false when absent): an ``applied``
    step that said true expects a ``committed`` event once the commit is decided.
    ``signer``: only events signed by the participant they name are valid.
    """
    checked = _parsed(raw, _EVENTS_SCHEMA, rejected, signer).selectExpr(
        "*", f"NOT {_BY_PARTICIPANT} AS forged"
    )
    checked = checked.selectExpr(
        "*", f"CASE WHEN NOT forged AND {_EVENT_VALID} THEN 'event' ELSE 'invalid' END AS kind"
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
        confirm=f"CASE WHEN {valid} THEN coalesce(r.confirm, false) END",
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
