"""Hostile records: what the coordinator rejects, ``saga reconcile`` does not audit.

One definition of an acceptable record (:mod:`streams._limits`, enforced by the
codec) must hold for the audit too, or the audit counts records every consumer
skipped: reports their transactions stuck and, with ``--replay``, publishes them
again. The audit checks in Spark SQL what SQL can check, and takes the
coordinator's dead letters as the verdict on the rest.

* :func:`test_the_checks_spark_makes_agree_with_the_codec`: records of each topic
  parsed by the audit's own functions (no Kafka): each is judged as expected, and
  as the codec (``decode_keyed``) judges it -- except the few only the coordinator
  can judge (nesting, numbers inside ``args``, a number for a string), which a
  dead letter covers.
* :func:`test_records_the_coordinator_rejected_are_not_audited`: the whole job on
  Kafka. Rejected shapes (bytes after the object, two objects, a ``tx_id`` ending
  in a newline, a record over the size limit, ``args`` nested too deep, an event
  with a number for its reason) beside the same records without the defect: only
  the latter are transactions, stuck, and in the replay plan.

One SparkSession serves the module.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from saga.streams import (
    Decision,
    InvalidRecord,
    Record,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    StepEvent,
    decode_keyed,
)
from saga.streams._limits import (
    INT64_MAX,
    MAX_KEY_BYTES,
    MAX_NAME_CHARS,
    MAX_NESTING,
    MAX_REASON_CHARS,
    MAX_RECORD_BYTES,
    MAX_SAGA_CHARS,
)
from saga.streams.kafka import (
    KafkaSettings,
    Message,
    Producer,
    send_to_dlq,
)
from saga.streams.reconcile import ReconcileConfig, run
from saga.streams.reconcile._audit import parse_decisions, parse_events, parse_requests
from tests._infra import Services
from tests._system import fresh_topics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

NOW = 1_800_000_000_000  # the audit's "now" (--now-ms)
GRACE = 60_000
OLD = NOW - 600_000  # long enough ago for anything to be stuck


# ---------------------------------------------------------------- records


def dump(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def request(tx: str, **fields: Any) -> dict[str, Any]:
    """A valid request of ``tx`` (one step), stuck if nothing else is sent; ``fields`` override."""
    return {
        "v": 1,
        "type": "saga.request",
        "tx_id": tx,
        "saga": "test",
        "steps": [
            {
                "participant": "bank",
                "action": "insert",
                "args": {"key": f"{tx}-0", "list": [{"b": 2}], "text": "a]b}{"},
            }
        ],
        "deadline_ms": OLD + 30_000,
        "created_ms": OLD,
        **fields,
    }


def with_args(tx: str, args: Any) -> dict[str, Any]:
    return request(tx, steps=[{"participant": "bank", "action": "insert", "args": args}])


def with_names(tx: str, participant: str, action: str = "insert") -> dict[str, Any]:
    return request(tx, steps=[{"participant": participant, "action": action, "args": {}}])


def nested(levels: int) -> dict[str, Any]:
    """An object ``levels`` deep: ``{}`` is 1 (as the codec counts)."""
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def padded(key: bytes, value: bytes, total: int) -> bytes:
    """``value`` followed by blanks so that key and value are ``total`` bytes."""
    assert total >= len(key) + len(value)
    return value + b" " * (total - len(key) - len(value))


def abort(tx: str, reason: str) -> dict[str, Any]:
    return {"v": 1, "type": "saga.abort", "tx_id": tx, "reason": reason, "at_ms": OLD}


def resolve(tx: str, **fields: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "type": "saga.resolve",
        "tx_id": tx,
        "step": 0,
        "note": "refunded by hand",
        "by": "ann@host",
        "at_ms": OLD,
        **fields,
    }


def event(tx: str, **fields: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "type": "saga.step",
        "tx_id": tx,
        "step": 0,
        "participant": "bank",
        "status": "applied",
        "at_ms": OLD + 1_000,
        **fields,
    }


def decision(tx: str, **fields: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "type": "saga.decision",
        "tx_id": tx,
        "outcome": "commit",
        "reason": "all steps applied",
        "at_ms": OLD + 2_000,
        **fields,
    }


def keyed(record: dict[str, Any], tail: bytes = b"") -> tuple[bytes, bytes]:
    """Keyed as a valid record would be: by its ``tx_id``."""
    return str(record["tx_id"]).encode(), dump(record) + tail


# ---------------------------------------------------------------- the checks, without Kafka

# The step event's optional `confirm` (a boolean) is part of the wire contract; a codec
# built before it rejects every event carrying it, so those cases are compared with the
# codec only once it knows the field.
CONFIRM_CASES = {
    ("events", name)
    for name in (
        "valid-with-confirm",
        "valid-with-confirm-false",
        "confirm-a-string",
        "confirm-a-number",
        "confirm-null",
    )
}
CODEC_KNOWS_CONFIRM = "confirm" in {f.name for f in dataclasses.fields(StepEvent)}

# Spark SQL cannot see these; the codec rejects them, so the coordinator dead-letters them.
COORDINATOR_ONLY = {
    ("requests", "args-nested-too-deep"),
    ("requests", "args-number-beyond-int64"),
    ("requests", "number-for-a-string"),
    ("events", "number-for-a-string"),
}


def request_cases() -> dict[str, tuple[bytes, bytes, str]]:
    """``{name: (key, value, kind the audit must give)}`` of the requests topic."""
    good = request("tx-1")
    key, value = keyed(good)
    long_tx = "t" * MAX_KEY_BYTES
    cases = {
        "valid": (key, value, "request"),
        "valid-then-blanks": (key, value + b" \n\t\r\n", "request"),
        "valid-at-the-size-limit": (key, padded(key, value, MAX_RECORD_BYTES), "request"),
        "valid-at-the-string-limits": (
            *keyed(
                request(
                    long_tx,
                    saga="s" * MAX_SAGA_CHARS,
                    steps=[{"participant": "p" * MAX_NAME_CHARS, "action": "a" * MAX_NAME_CHARS}],
                )
            ),
            "request",
        ),
        "valid-at-int64-max": (*keyed(request("tx-1", deadline_ms=INT64_MAX)), "request"),
        "valid-sequential": (*keyed(request("tx-1", mode="sequential")), "request"),
        "valid-nested-at-the-limit": (*keyed(with_args("tx-1", nested(MAX_NESTING))), "request"),
        "valid-abort-at-the-reason-limit": (
            *keyed(abort("tx-1", "r" * MAX_REASON_CHARS)),
            "abort",
        ),
        # what only the coordinator can judge: Spark takes them
        "args-nested-too-deep": (*keyed(with_args("tx-1", nested(MAX_NESTING + 1))), "request"),
        "args-number-beyond-int64": (*keyed(with_args("tx-1", {"n": INT64_MAX + 1})), "request"),
        "number-for-a-string": (*keyed(request("tx-1", saga=5)), "request"),
        # what Spark must reject
        "over-the-size-limit": (key, padded(key, value, MAX_RECORD_BYTES + 1), "invalid"),
        "bytes-after-the-object": (key, value + b" trailing", "invalid"),
        "two-objects": (key, value + value, "invalid"),
        "two-objects-with-a-comma": (key, value + b"," + value, "invalid"),
        "a-bracket-then-an-object": (key, value + b"]" + value, "invalid"),
        "a-forged-second-element": (key, value + b",0]," + value, "invalid"),
        "tx-id-ending-in-a-newline": (*keyed(request("tx-1\n")), "invalid"),
        "tx-id-ending-in-a-line-separator": (*keyed(request("tx-1\u2028")), "invalid"),
        "tx-id-too-long": (*keyed(request(long_tx + "t")), "invalid"),
        "saga-too-long": (*keyed(request("tx-1", saga="s" * (MAX_SAGA_CHARS + 1))), "invalid"),
        "name-too-long": (*keyed(with_names("tx-1", "p" * (MAX_NAME_CHARS + 1))), "invalid"),
        "name-ending-in-a-newline": (*keyed(with_names("tx-1", "bank", "insert\n")), "invalid"),
        "int64-overflow": (*keyed(request("tx-1", deadline_ms=INT64_MAX + 1)), "invalid"),
        "abort-reason-too-long": (*keyed(abort("tx-1", "r" * (MAX_REASON_CHARS + 1))), "invalid"),
        "valid-abort-naming-who": (*keyed({**abort("tx-1", "stop"), "by": "ann@host"}), "abort"),
        "abort-naming-nobody": (*keyed({**abort("tx-1", "stop"), "by": ""}), "invalid"),
        "valid-resolve": (*keyed(resolve("tx-1", step=63)), "resolve"),
        "resolve-of-step-64": (*keyed(resolve("tx-1", step=64)), "invalid"),
        "resolve-without-a-note": (*keyed(resolve("tx-1", note="")), "invalid"),
        "resolve-with-an-extra-field": (*keyed(resolve("tx-1", reason="x")), "invalid"),
        "mode-null": (*keyed(request("tx-1", mode=None)), "invalid"),
        "single-quotes": (key, value.replace(b'"test"', b"'test'"), "invalid"),
        "nan": (key, value.replace(b'"b":2', b'"b":NaN'), "invalid"),
        "not-utf-8": (key, value.replace(b'"test"', b'"te\xffst"'), "invalid"),
        "dead-lettered": (key, value, "invalid"),  # valid, but at a rejected offset
    }
    assert cases["single-quotes"][1] != value and cases["nan"][1] != value
    return cases


def event_cases() -> dict[str, tuple[bytes, bytes, str]]:
    return {
        "valid": (*keyed(event("tx-1", reason="r" * MAX_REASON_CHARS)), "event"),
        "number-for-a-string": (*keyed(event("tx-1", reason=7)), "event"),
        "reason-too-long": (*keyed(event("tx-1", reason="r" * (MAX_REASON_CHARS + 1))), "invalid"),
        "tx-id-ending-in-a-newline": (*keyed(event("tx-1\n")), "invalid"),
        "participant-ending-in-a-newline": (*keyed(event("tx-1", participant="bank\n")), "invalid"),
        "step-beyond-int64": (*keyed(event("tx-1", step=INT64_MAX + 1)), "invalid"),
        "bytes-after-the-object": (*keyed(event("tx-1"), b"x"), "invalid"),
        "valid-with-confirm": (*keyed(event("tx-1", confirm=True)), "event"),
        "valid-with-confirm-false": (*keyed(event("tx-1", confirm=False)), "event"),
        "confirm-a-string": (*keyed(event("tx-1", confirm="true")), "invalid"),
        "confirm-a-number": (*keyed(event("tx-1", confirm=1)), "invalid"),
        "confirm-null": (*keyed(event("tx-1", confirm=None)), "invalid"),
    }


def decision_cases() -> dict[str, tuple[bytes, bytes, str]]:
    key, value = keyed(decision("tx-1"))
    return {
        "valid": (*keyed(decision("tx-1", reason="r" * MAX_REASON_CHARS)), "decision"),
        "reason-too-long": (
            *keyed(decision("tx-1", reason="r" * (MAX_REASON_CHARS + 1))),
            "invalid",
        ),
        "two-objects": (key, value + value, "invalid"),
        "tx-id-ending-in-a-newline": (*keyed(decision("tx-1\n")), "invalid"),
    }


TOPICS: dict[str, tuple[Any, tuple[type[Record], ...]]] = {
    "requests": (parse_requests, (SagaRequest, SagaAbort, SagaResolve)),
    "events": (parse_events, (StepEvent,)),
    "decisions": (parse_decisions, (Decision,)),
}


@pytest.mark.parametrize(
    ("topic", "cases"),
    [("requests", request_cases()), ("events", event_cases()), ("decisions", decision_cases())],
    ids=["requests", "events", "decisions"],
)
def test_the_checks_spark_makes_agree_with_the_codec(
    spark: Any, topic: str, cases: dict[str, tuple[bytes, bytes, str]]
) -> None:
    parse, kinds = TOPICS[topic]
    names = list(cases)
    rows = [(key, value, 0, offset) for offset, (key, value, _) in enumerate(cases.values())]
    frame = spark.createDataFrame(rows, "key BINARY, value BINARY, partition INT, offset BIGINT")
    rejected = spark.createDataFrame(
        [(0, names.index(n)) for n in names if n == "dead-lettered"], "partition INT, offset BIGINT"
    )
    got = {names[r["off"]]: r["kind"] for r in parse(frame, rejected).collect()}
    assert got == {name: kind for name, (_, _, kind) in cases.items()}

    def codec_accepts(key: bytes, value: bytes) -> bool:
        try:
            decode_keyed(key, value, *kinds)
        except InvalidRecord:
            return False
        return True

    disagree = {
        name: (kind, codec_accepts(key, value))
        for name, (key, value, kind) in cases.items()
        if name != "dead-lettered"
        and (kind != "invalid") != codec_accepts(key, value)
        and (topic, name) not in COORDINATOR_ONLY
        and (CODEC_KNOWS_CONFIRM or (topic, name) not in CONFIRM_CASES)
    }
    assert disagree == {}, "the audit's checks and the codec disagree (kind, codec accepts)"
    for t, name in COORDINATOR_ONLY:
        if t == topic:
            assert not codec_accepts(*cases[name][:2]), f"the codec accepts {name}"


# ---------------------------------------------------------------- the job on Kafka


@pytest.fixture
def settings(services: Services) -> Iterator[KafkaSettings]:
    yield from fresh_topics(services, "rh", 3)


def test_records_the_coordinator_rejected_are_not_audited(
    spark: Any, settings: KafkaSettings, tmp_path: Path
) -> None:
    """Hostile requests beside the same requests without the defect, all past their
    deadline with no decision: only the latter are transactions, stuck and replayed.
    The records only the coordinator can judge get its dead letter (``send_to_dlq``, as
    the coordinator writes it); the oversized one gets one too, an excerpt that decodes
    as a valid request, and is still rightly rejected."""
    t = settings.topics
    controls = {
        # the same shapes, within the limits: they must be audited
        "c-plain": keyed(request("c-plain")),
        "c-at-the-size-limit": (
            b"c-at-the-size-limit",
            padded(b"c-at-the-size-limit", dump(request("c-at-the-size-limit")), MAX_RECORD_BYTES),
        ),
        "c-nested-at-the-limit": keyed(with_args("c-nested-at-the-limit", nested(MAX_NESTING))),
    }
    plain = dump(request("h-bytes-after"))
    two = dump(request("h-two-objects"))
    hostile = {
        "h-bytes-after": (b"h-bytes-after", plain + b" and then some"),
        "h-two-objects": (b"h-two-objects", two + two),
        "h-newline\n": keyed(request("h-newline\n")),
        "h-oversized": (
            b"h-oversized",
            padded(b"h-oversized", dump(request("h-oversized")), MAX_RECORD_BYTES + 1),
        ),
        "h-nested-too-deep": keyed(with_args("h-nested-too-deep", nested(MAX_NESTING + 1))),
    }
    # A step event with a number for its reason: Spark reads it as text, the codec rejects it.
    bad_event = keyed(event("c-plain", reason=7))
    for key, value in controls.values():
        decode_keyed(key, value, SagaRequest)  # valid, or the test proves nothing
    for key, value in [*hostile.values(), bad_event]:
        with pytest.raises(InvalidRecord):
            decode_keyed(key, value, SagaRequest, StepEvent)

    delivered: dict[str, Message] = {}

    def remember(name: str) -> Any:
        def on_delivery(error: Exception | None, message: Message) -> None:
            assert error is None, error
            delivered[name] = message

        return on_delivery

    with Producer(settings) as producer:
        for name, (key, value) in [*controls.items(), *hostile.items()]:
            producer.produce(t.requests, key, value, on_delivery=remember(name))
        producer.produce(t.events, bad_event[0], bad_event[1], on_delivery=remember("event"))
        producer.flush(30)
        for name in ("h-oversized", "h-nested-too-deep", "event"):
            send_to_dlq(producer, t, delivered[name], "rejected", component="coordinator")
        producer.flush(30)

    config = ReconcileConfig(
        settings=settings,
        out=tmp_path,
        grace_ms=GRACE,
        now_ms=NOW,
        write_all=True,
        show=100,
    )
    result = run(config, spark=spark, say=lambda _: None)
    summary = result.summary
    rows = {
        r["tx_id"]: r.asDict(recursive=True)
        for r in spark.read.parquet(str(tmp_path / "findings")).collect()
    }

    assert {tx: r["class"] for tx, r in rows.items()} == dict.fromkeys(
        controls, "stuck_no_decision"
    )
    assert rows["c-plain"]["events"] == 0  # the dead-lettered event is not counted
    assert summary["transactions"] == len(controls)
    assert summary["classes"]["stuck_no_decision"] == len(controls)
    assert summary["invalid_records"] == {"requests": len(hostile), "events": 1, "decisions": 0}
    assert summary["records"]["requests"] == len(controls) + len(hostile)
    # the oversized excerpt decodes as a valid request, yet it was rightly rejected
    assert summary["dlq"] == {
        "records": 3,
        "invalid": 3,
        "justified": 0,
        "violations": 0,
        "by_component": {"coordinator": 3},
    }
    assert summary["invariants"]["I6"] == 0
    plan = sorted((r.tx_id, r.kind) for r, _ in result.resends)
    assert plan == sorted((tx, "request") for tx in controls)
    assert {(r.partition, r.offset) for r, _ in result.resends} == {
        (delivered[tx].partition, delivered[tx].offset) for tx in controls
    }
