"""The wire contract (docs/architecture.md §3): schemas, encoding, decoding, topic names.

Why this module is over 600 lines: it is the executable form of the wire contract,
one section per record kind, in the order the README's contract lists them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from importlib import resources
from types import MappingProxyType
from typing import Any

import fastjsonschema
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import saga.streams
from saga.streams import (
    MAX_STEPS,
    RECORD_TYPES,
    SCHEMA_NAMES,
    TX_ID_PATTERN,
    ConfigurationError,
    Decision,
    InvalidRecord,
    Isolation,
    Mode,
    Outcome,
    ParticipantAnnouncement,
    Record,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepProgress,
    StepsCommitted,
    StepStatus,
    Topics,
    decode,
    decode_as,
    decode_keyed,
    encode,
    schema,
    step_events,
    to_dict,
)

pytestmark = pytest.mark.unit

MAX_MS = 2**63 - 1

# ------------------------------------------------------------------ examples

VALID: dict[str, dict[str, Any]] = {
    "saga.request": {
        "v": 1,
        "type": "saga.request",
        "tx_id": "tx-1",
        "saga": "transfer",
        "mode": "parallel",
        "steps": [
            {
                "participant": "pg",
                "action": "insert",
                "args": {"target": "accounts", "key": "a1", "value": {"balance": 10}},
            }
        ],
        "deadline_ms": 2000,
        "created_ms": 1000,
        "isolation": "read_committed",
        "meta": {"trace": "t-1"},
    },
    "saga.abort": {
        "v": 1,
        "type": "saga.abort",
        "tx_id": "tx-1",
        "reason": "aborted by operator",
        "at_ms": 1500,
    },
    "saga.resolve": {
        "v": 1,
        "type": "saga.resolve",
        "tx_id": "tx-1",
        "step": 0,
        "note": "refunded by hand, ticket 42",
        "by": "ann@host",
        "at_ms": 1600,
    },
    "saga.step": {
        "v": 1,
        "type": "saga.step",
        "tx_id": "tx-1",
        "step": 0,
        "participant": "pg",
        "status": "failed",
        "reason": "key exists",
        "at_ms": 1200,
    },
    "saga.committed": {
        "v": 1,
        "type": "saga.committed",
        "participant": "pg",
        "at_ms": 1250,
        "steps": [["tx-1", 0], ["tx-9", 2]],
    },
    "saga.decision": {
        "v": 1,
        "type": "saga.decision",
        "tx_id": "tx-1",
        "outcome": "rollback",
        "reason": "step 0 failed: key exists",
        "at_ms": 1300,
    },
    "saga.status": {
        "v": 1,
        "type": "saga.status",
        "tx_id": "tx-1",
        "saga": "transfer",
        "state": "rolled_back",
        "steps": [{"participant": "pg", "status": "compensated"}],
        "reason": "step 0 failed: key exists",
        "created_ms": 1000,
        "updated_ms": 1400,
        "deadline_ms": 2000,
        "fingerprint": "0123456789abcdef0123456789abcdef",
    },
    "saga.participant": {
        "v": 1,
        "type": "saga.participant",
        "name": "pg",
        "storage": "sql",
        "targets": ["accounts", "orders"],
        "version": "0.1.0",
        "instance": "3f2a9c",
        "started_ms": 1000,
        "heartbeat_ms": 1500,
        "interval_ms": 5000,
        "state": "up",
        "host": "db-1",
    },
}
TX_SCHEMAS = tuple(
    name for name in SCHEMA_NAMES if name not in ("saga.participant", "saga.committed")
)
"""The records of one transaction, keyed by their tx_id field (an announcement is keyed
name/instance; a saga.committed by the first tx_id of its steps)."""

CLASSES: dict[str, type[Record]] = {
    "saga.request": SagaRequest,
    "saga.abort": SagaAbort,
    "saga.resolve": SagaResolve,
    "saga.step": StepEvent,
    "saga.committed": StepsCommitted,
    "saga.decision": Decision,
    "saga.status": SagaStatus,
    "saga.participant": ParticipantAnnouncement,
}


def valid(type_name: str, **changes: Any) -> dict[str, Any]:
    """A fresh valid record dict of ``type_name`` with ``changes`` applied."""
    data = copy.deepcopy(VALID[type_name])
    data.update(changes)
    return data


def raw(data: Any) -> bytes:
    return orjson.dumps(data)


def reason_of(value: Any, decoder: Callable[[Any], Record] = decode) -> str:
    """Decode ``value``, which must fail, and check the reason reads as one line."""
    with pytest.raises(InvalidRecord) as caught:
        decoder(value)
    reason = caught.value.reason
    assert_one_line(reason)
    assert str(caught.value) == reason
    return reason


def assert_one_line(reason: str) -> None:
    assert reason
    assert reason == reason.strip()
    assert "\n" not in reason
    assert "\r" not in reason
    assert len(reason) <= 500


# ------------------------------------------------------------ strategies

TX_IDS = st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True)
NAMES = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)
# orjson cannot write lone surrogates, so text is drawn from UTF-8 encodable characters.
TEXT = st.text(st.characters(codec="utf-8"), max_size=40)
MS = st.integers(0, MAX_MS)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    # numbers lie within the signed 64-bit range (streams._limits), floats too
    | st.floats(-(2.0**63), 2.0**63, exclude_min=True, exclude_max=True)
    | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=10,
)
JSON_OBJECTS = st.dictionaries(TEXT, JSON_VALUES, max_size=4)

STEPS = st.builds(Step, participant=NAMES, action=NAMES, args=JSON_OBJECTS)


@st.composite
def requests(draw: st.DrawFn) -> SagaRequest:
    created = draw(MS)
    return SagaRequest(
        tx_id=draw(TX_IDS),
        saga=draw(st.text(st.characters(codec="utf-8"), min_size=1, max_size=200)),
        mode=draw(st.sampled_from(Mode)),
        steps=tuple(draw(st.lists(STEPS, min_size=1, max_size=MAX_STEPS))),
        deadline_ms=draw(st.integers(created, MAX_MS)),
        created_ms=created,
        meta=draw(st.none() | JSON_OBJECTS),
    )


ABORTS = st.builds(
    SagaAbort, tx_id=TX_IDS, reason=TEXT, at_ms=MS, by=st.none() | st.text(min_size=1, max_size=200)
)
RESOLVES = st.builds(
    SagaResolve,
    tx_id=TX_IDS,
    step=st.integers(0, MAX_STEPS - 1),
    note=st.text(min_size=1, max_size=1000),
    by=st.text(min_size=1, max_size=200),
    at_ms=MS,
)
STEP_EVENTS = st.builds(
    StepEvent,
    tx_id=TX_IDS,
    step=st.integers(0, MAX_STEPS - 1),
    participant=NAMES,
    status=st.sampled_from(
        [s for s in StepStatus if s not in (StepStatus.PENDING, StepStatus.RESOLVED)]
    ),
    at_ms=MS,
    reason=st.none() | TEXT,
)
DECISIONS = st.builds(
    Decision, tx_id=TX_IDS, outcome=st.sampled_from(Outcome), reason=TEXT, at_ms=MS
)
STATUSES = st.builds(
    SagaStatus,
    tx_id=TX_IDS,
    saga=st.text(st.characters(codec="utf-8"), min_size=1, max_size=200),
    state=st.sampled_from(SagaState),
    steps=st.lists(
        st.builds(StepProgress, participant=NAMES, status=st.sampled_from(StepStatus)),
        max_size=MAX_STEPS,
    ).map(tuple),
    reason=st.none() | TEXT,
    created_ms=MS,
    updated_ms=MS,
    deadline_ms=MS,
    fingerprint=st.none() | st.from_regex(r"[0-9a-f]{32}", fullmatch=True),
)
COMMITTED = st.builds(
    StepsCommitted,
    participant=NAMES,
    at_ms=MS,
    steps=st.lists(
        st.tuples(TX_IDS, st.integers(0, MAX_STEPS - 1)), min_size=1, max_size=20, unique=True
    ).map(tuple),
)
RECORDS = requests() | ABORTS | RESOLVES | STEP_EVENTS | COMMITTED | DECISIONS | STATUSES

# Generating up to 64 steps with nested args is slow on a busy machine; the
# wall clock says nothing about correctness here.
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------- round trips


@PROPERTY
@given(RECORDS)
def test_every_record_survives_encode_then_decode(record: Record) -> None:
    assert decode(encode(record)) == record


@PROPERTY
@given(RECORDS)
def test_encoding_is_stable(record: Record) -> None:
    first = encode(record)
    assert encode(record) == first
    assert encode(decode(first)) == first


def test_equal_records_encode_to_equal_bytes_whatever_the_key_order() -> None:
    one = SagaRequest("tx-1", "s", Mode.PARALLEL, (Step("pg", "put", {"a": 1, "b": 2}),), 2, 1)
    two = SagaRequest("tx-1", "s", Mode.PARALLEL, (Step("pg", "put", {"b": 2, "a": 1}),), 2, 1)
    assert one == two
    assert encode(one) == encode(two)


@pytest.mark.parametrize("type_name", SCHEMA_NAMES)
def test_valid_example_decodes_to_its_record_class(type_name: str) -> None:
    record = decode(raw(VALID[type_name]))
    assert type(record) is CLASSES[type_name]
    assert to_dict(record) == VALID[type_name]


def test_request_decodes_to_typed_values() -> None:
    record = decode(raw(VALID["saga.request"]))
    assert isinstance(record, SagaRequest)
    assert record.mode is Mode.PARALLEL
    assert record.steps == (
        Step("pg", "insert", {"target": "accounts", "key": "a1", "value": {"balance": 10}}),
    )
    assert isinstance(record.steps, tuple)
    assert record.meta == {"trace": "t-1"}


def test_status_decodes_to_typed_values() -> None:
    record = decode(raw(VALID["saga.status"]))
    assert isinstance(record, SagaStatus)
    assert record.state is SagaState.ROLLED_BACK
    assert record.steps == (StepProgress("pg", StepStatus.COMPENSATED),)


def test_isolation_defaults_to_read_committed_and_only_none_changes_the_fingerprint() -> None:
    absent = {k: v for k, v in VALID["saga.request"].items() if k != "isolation"}
    record = decode(raw(absent))
    assert isinstance(record, SagaRequest)
    assert record.isolation is Isolation.READ_COMMITTED
    assert to_dict(record)["isolation"] == "read_committed"  # always written
    none = decode(raw(valid("saga.request", isolation="none")))
    assert isinstance(none, SagaRequest)
    assert none.isolation is Isolation.NONE
    assert decode(encode(none)) == none
    # A request's digest is what it was before levels existed unless it asks for none.
    assert record.fingerprint() == decode(raw(VALID["saga.request"])).fingerprint()
    assert none.fingerprint() != record.fingerprint()


def test_an_unknown_isolation_level_is_invalid() -> None:
    with pytest.raises(InvalidRecord, match="isolation"):
        decode(raw(valid("saga.request", isolation="serializable")))


def test_absent_mode_means_parallel_and_absent_args_mean_empty() -> None:
    data = valid("saga.request", steps=[{"participant": "pg", "action": "delete"}])
    del data["mode"]
    record = decode(raw(data))
    assert isinstance(record, SagaRequest)
    assert record.mode is Mode.PARALLEL
    assert record.steps[0].args == {}


def test_absent_or_null_optional_fields_decode_to_none() -> None:
    request = valid("saga.request")
    del request["meta"]
    step = valid("saga.step", status="applied")
    del step["reason"]
    status = valid("saga.status")
    del status["fingerprint"]
    for data in (request, valid("saga.request", meta=None)):
        decoded = decode(raw(data))
        assert isinstance(decoded, SagaRequest)
        assert decoded.meta is None
    for data in (step, valid("saga.step", status="applied", reason=None)):
        decoded = decode(raw(data))
        assert isinstance(decoded, StepEvent)
        assert decoded.reason is None
    for data in (status, valid("saga.status", fingerprint=None)):
        decoded = decode(raw(data))
        assert isinstance(decoded, SagaStatus)
        assert decoded.fingerprint is None


def test_integer_fields_want_integer_literals() -> None:
    """JSON Schema counts 5.0 as an integer; the contract does not (one definition with the
    audit's Spark reader, which reads these fields as BIGINT)."""
    for field, value in (("at_ms", b"5.0"), ("v", b"1.0")):
        text = b'{"v":1,"type":"saga.abort","tx_id":"t","reason":"r","at_ms":5}'
        text = text.replace(f'"{field}":'.encode() + (b"5" if field == "at_ms" else b"1"),
                            f'"{field}":'.encode() + value)  # fmt: skip
        with pytest.raises(InvalidRecord, match=f"{field} must be an integer literal"):
            decode(text)


def test_sixty_four_steps_and_a_128_char_tx_id_are_accepted() -> None:
    steps = [{"participant": "pg", "action": "put", "args": {}}] * 64
    record = decode(raw(valid("saga.request", tx_id="x" * 128, steps=steps)))
    assert isinstance(record, SagaRequest)
    assert len(record.steps) == 64


def test_pending_is_a_step_status_only_in_status_records() -> None:
    status = valid("saga.status", steps=[{"participant": "pg", "status": "pending"}])
    assert isinstance(decode(raw(status)), SagaStatus)
    assert "data.status must be one of" in reason_of(raw(valid("saga.step", status="pending")))


def test_status_may_list_no_steps() -> None:
    assert isinstance(decode(raw(valid("saga.status", steps=[]))), SagaStatus)


def test_decode_accepts_bytearray_and_memoryview() -> None:
    data = raw(VALID["saga.abort"])
    assert decode(bytearray(data)) == decode(data)  # type: ignore[arg-type]
    assert decode(memoryview(data)) == decode(data)  # type: ignore[arg-type]


# ---------------------------------------------------------------- encoding


def test_encode_writes_version_type_and_enum_strings() -> None:
    record = StepEvent("tx-1", 3, "pg", StepStatus.COMPENSATION_FAILED, 9, "disk full")
    data = orjson.loads(encode(record))
    assert data == {
        "v": 1,
        "type": "saga.step",
        "tx_id": "tx-1",
        "step": 3,
        "participant": "pg",
        "status": "compensation_failed",
        "reason": "disk full",
        "at_ms": 9,
    }


def test_encode_leaves_out_none_optional_fields() -> None:
    request = SagaRequest("tx-1", "s", Mode.SEQUENTIAL, (Step("pg", "put"),), 2, 1)
    assert "meta" not in orjson.loads(encode(request))
    assert "reason" not in orjson.loads(encode(StepEvent("tx-1", 0, "pg", StepStatus.APPLIED, 1)))
    status = SagaStatus("tx-1", "s", SagaState.PENDING, (), None, 1, 1, 2)
    written = orjson.loads(encode(status))
    assert "fingerprint" not in written
    # A status's reason is required on the wire, so null is written out.
    assert written["reason"] is None


def test_to_dict_gives_plain_json_values() -> None:
    data = to_dict(
        SagaStatus(
            "t", "s", SagaState.FAILED, (StepProgress("pg", StepStatus.FAILED),), "x", 1, 2, 3
        )
    )
    assert type(data["state"]) is str
    assert type(data["steps"][0]["status"]) is str
    assert json.loads(json.dumps(data)) == data


def test_encode_accepts_any_mapping_for_args_and_meta() -> None:
    args = MappingProxyType({"target": "t", "nested": MappingProxyType({"k": 1})})
    record = SagaRequest(
        "tx-1", "s", Mode.PARALLEL, (Step("pg", "put", args),), 2, 1, MappingProxyType({"m": 1})
    )
    decoded = decode(encode(record))
    assert isinstance(decoded, SagaRequest)
    assert decoded.steps[0].args == {"target": "t", "nested": {"k": 1}}
    assert decoded.meta == {"m": 1}


def request_with(**changes: Any) -> SagaRequest:
    base = SagaRequest(
        "tx-1", "transfer", Mode.PARALLEL, (Step("pg", "put", {"k": 1}),), 2000, 1000
    )
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (request_with(tx_id="tx 1"), "saga.request: data.tx_id must match pattern"),
        (request_with(steps=()), "saga.request: data.steps must contain at least 1 items"),
        (
            request_with(steps=(Step("pg", "put"),) * 65),
            "data.steps must contain less than or equal to 64",
        ),
        (
            request_with(deadline_ms=999),
            "saga.request: deadline_ms (999) is before created_ms (1000)",
        ),
        (
            request_with(created_ms=-1, deadline_ms=5),
            "data.created_ms must be bigger than or equal to 0",
        ),
        (request_with(mode="both"), "data.mode must be one of"),
        (request_with(steps=(Step("pg", "put", {"s": {1, 2}}),)), "cannot be written as JSON"),
        (request_with(steps=(Step("pg", "put", {"s": "\ud800"}),)), "cannot be written as JSON"),
        (request_with(steps=(Step("pg", "put", {"n": 2**64}),)), "outside the signed 64-bit range"),
        (request_with(meta={1: "non-string key"}), "cannot be written as JSON"),
        (
            StepEvent("tx-1", 64, "pg", StepStatus.APPLIED, 1),
            "data.step must be smaller than or equal to 63",
        ),
        (StepEvent("tx-1", 0, "pg", StepStatus.PENDING, 1), "data.status must be one of"),
        (SagaAbort("tx-1", "r", True), "data.at_ms must be integer"),
        (Decision("tx-1", Outcome.COMMIT, "r", 1.5), "data.at_ms must be integer"),  # type: ignore[arg-type]
    ],
    ids=lambda value: value if isinstance(value, str) else type(value).__name__,
)
def test_encode_refuses_records_that_break_the_contract(record: Record, expected: str) -> None:
    with pytest.raises(InvalidRecord) as caught:
        encode(record)
    assert expected in caught.value.reason
    assert_one_line(caught.value.reason)


def test_encode_and_to_dict_refuse_non_records() -> None:
    with pytest.raises(TypeError, match="dict is not a saga wire record"):
        encode({"v": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        to_dict(Step("pg", "put"))  # type: ignore[arg-type]


# ----------------------------------------------------- envelope rejections


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "value is empty (a tombstone)"),
        (b"", "value is empty (a tombstone)"),
        (b"   ", "record is not valid JSON: "),
        (b"{", "record is not valid JSON: "),
        (b"{'v': 1}", "record is not valid JSON: "),
        (b"\xff\xfe{}", "record is not valid JSON: "),
        (b'{"v": 1, "type": "saga.abort", "reason": "\xc3"}', "record is not valid JSON: "),
        (12, "record is not valid JSON: "),
        (b"[]", "record must be a JSON object, got an array"),
        (b'"saga.request"', "record must be a JSON object, got a string"),
        (b"42", "record must be a JSON object, got a number"),
        (b"null", "record must be a JSON object, got null"),
        (b"true", "record must be a JSON object, got a boolean"),
        (b"{}", "record has no 'v' field (the wire version)"),
        (b'{"type": "saga.abort"}', "record has no 'v' field (the wire version)"),
        (b'{"v": 2, "type": "saga.abort"}', "wire version 2 is not supported (expected 1)"),
        (b'{"v": "1", "type": "saga.abort"}', "wire version '1' is not supported (expected 1)"),
        (b'{"v": true, "type": "saga.abort"}', "wire version True is not supported (expected 1)"),
        (b'{"v": null}', "wire version None is not supported (expected 1)"),
        (b'{"v": 1}', "record has no 'type' field"),
        (b'{"v": 1, "type": "x"}', "unknown record type 'x'"),
        (b'{"v": 1, "type": "SAGA.REQUEST"}', "unknown record type 'SAGA.REQUEST'"),
        (b'{"v": 1, "type": ["saga.request"]}', "unknown record type ['saga.request']"),
        (b'{"v": 1, "type": {"a": 1}}', "unknown record type {'a': 1}"),
        (b'{"v": 1, "type": 7}', "unknown record type 7"),
    ],
)
def test_envelope_rejections(value: Any, expected: str) -> None:
    reason = reason_of(value)
    assert reason.startswith(expected), reason


def test_reasons_stay_one_bounded_line_whatever_the_input() -> None:
    key = "line one\nline two\r\n" + "z" * 5000
    reason = reason_of(raw(valid("saga.abort", **{key: 1})))
    assert reason.startswith("saga.abort: data must not contain")
    reason = reason_of(raw({"v": 1, "type": "x\n" * 1000}))
    assert reason.startswith("unknown record type 'x\\nx")


# ------------------------------------------------------ schema rejections


def required_fields() -> list[tuple[str, str]]:
    return [
        (name, field)
        for name in SCHEMA_NAMES
        for field in schema(name)["required"]
        if field not in ("v", "type")
    ]


def all_fields() -> list[tuple[str, str]]:
    return [
        (name, field)
        for name in SCHEMA_NAMES
        for field in schema(name)["properties"]
        if field not in ("v", "type")
    ]


@pytest.mark.parametrize(("type_name", "field"), required_fields())
def test_missing_required_field_is_rejected(type_name: str, field: str) -> None:
    data = valid(type_name)
    del data[field]
    reason = reason_of(raw(data))
    assert reason.startswith(f"{type_name}: data must contain"), reason
    assert repr(field) in reason


@pytest.mark.parametrize(("type_name", "field"), all_fields())
def test_wrong_json_type_is_rejected(type_name: str, field: str) -> None:
    allowed = schema(type_name)["properties"][field].get("type")
    # An object is wrong for every field except the free-form ones.
    wrong: Any = "text" if "object" in allowed else {"x": 1}
    reason = reason_of(raw(valid(type_name, **{field: wrong})))
    assert reason.startswith(f"{type_name}: data.{field} must be"), reason


@pytest.mark.parametrize("type_name", SCHEMA_NAMES)
def test_unknown_top_level_field_is_rejected(type_name: str) -> None:
    reason = reason_of(raw(valid(type_name, colour="blue")))
    assert reason == f"{type_name}: data must not contain {{'colour'}} properties"


@pytest.mark.parametrize("type_name", TX_SCHEMAS)
@pytest.mark.parametrize(
    "tx_id",
    ["", "tx 1", "tx/1", "tx-é", "транзакция", "tx-1\n", "\ntx-1", "x" * 129, "tx\x00"],
)
def test_bad_tx_id_is_rejected(type_name: str, tx_id: str) -> None:
    reason = reason_of(raw(valid(type_name, tx_id=tx_id)))
    assert reason.startswith(f"{type_name}: data.tx_id must match pattern"), reason


def integer_fields() -> list[tuple[str, str]]:
    return [
        (name, field)
        for name in SCHEMA_NAMES
        for field, spec in schema(name)["properties"].items()
        if spec.get("type") == "integer" and field != "v"
    ]


@pytest.mark.parametrize(("type_name", "field"), integer_fields())
@pytest.mark.parametrize("bad", [-1, MAX_MS + 1, True, 1.5, "5"])
def test_bad_integers_are_rejected(type_name: str, field: str, bad: Any) -> None:
    reason = reason_of(raw(valid(type_name, **{field: bad})))
    assert reason.startswith(f"{type_name}: data.{field} must be"), reason


def step_list(count: int) -> list[dict[str, Any]]:
    return [{"participant": "pg", "action": "put", "args": {}}] * count


CASES: list[tuple[str, dict[str, Any], str]] = [
    ("saga.request", {"steps": []}, "saga.request: data.steps must contain at least 1 items"),
    (
        "saga.request",
        {"steps": step_list(65)},
        "saga.request: data.steps must contain less than or equal to 64 items",
    ),
    (
        "saga.request",
        {"steps": [{"participant": "pg", "action": "put", "extra": 1}]},
        "data.steps[0] must not contain {'extra'}",
    ),
    ("saga.request", {"steps": [{"participant": "pg"}]}, "data.steps[0] must contain ['action']"),
    (
        "saga.request",
        {"steps": [{"participant": "pg/1", "action": "put"}]},
        "data.steps[0].participant must match pattern",
    ),
    (
        "saga.request",
        {"steps": [{"participant": "pg", "action": ""}]},
        "data.steps[0].action must be longer than or equal to 1",
    ),
    (
        "saga.request",
        {"steps": [{"participant": "p" * 65, "action": "put"}]},
        "data.steps[0].participant must be shorter than or equal to 64",
    ),
    (
        "saga.request",
        {"steps": [{"participant": "pg", "action": "put", "args": []}]},
        "data.steps[0].args must be object",
    ),
    ("saga.request", {"steps": ["put"]}, "data.steps[0] must be object"),
    ("saga.request", {"mode": "both"}, "data.mode must be one of ['parallel', 'sequential']"),
    ("saga.request", {"mode": None}, "data.mode must be string"),
    ("saga.request", {"saga": ""}, "data.saga must be longer than or equal to 1"),
    ("saga.request", {"saga": "s" * 201}, "data.saga must be shorter than or equal to 200"),
    ("saga.request", {"meta": [1]}, "data.meta must be object or null"),
    (
        "saga.request",
        {"deadline_ms": 999},
        "saga.request: deadline_ms (999) is before created_ms (1000)",
    ),
    ("saga.step", {"step": 64}, "data.step must be smaller than or equal to 63"),
    ("saga.step", {"status": "done"}, "data.status must be one of"),
    ("saga.step", {"participant": "a b"}, "data.participant must match pattern"),
    ("saga.decision", {"outcome": "maybe"}, "data.outcome must be one of ['commit', 'rollback']"),
    ("saga.decision", {"reason": None}, "data.reason must be string"),
    ("saga.abort", {"reason": None}, "data.reason must be string"),
    ("saga.status", {"state": "done"}, "data.state must be one of"),
    (
        "saga.status",
        {"steps": [{"participant": "pg", "status": "done"}]},
        "data.steps[0].status must be one of",
    ),
    ("saga.status", {"steps": [{"participant": "pg"}]}, "data.steps[0] must contain ['status']"),
    (
        "saga.status",
        {"steps": [{"participant": "pg", "status": "applied", "x": 1}]},
        "data.steps[0] must not contain {'x'}",
    ),
    (
        "saga.status",
        {"steps": [{"participant": "pg", "status": "applied"}] * 65},
        "data.steps must contain less than or equal to 64 items",
    ),
    ("saga.status", {"fingerprint": 5}, "data.fingerprint must be string or null"),
    ("saga.status", {"v": 1.5}, "wire version 1.5 is not supported"),
]


@pytest.mark.parametrize(("type_name", "changes", "expected"), CASES)
def test_schema_rejections(type_name: str, changes: dict[str, Any], expected: str) -> None:
    reason = reason_of(raw(valid(type_name, **changes)))
    assert expected in reason, reason
    assert reason.startswith(type_name) or reason.startswith("wire version")


# ---------------------------------------------------------------- fuzzing


@PROPERTY
@given(st.binary(max_size=200))
def test_arbitrary_bytes_give_a_record_or_invalid_record(value: bytes) -> None:
    try:
        decode(value)
    except InvalidRecord as exc:
        assert_one_line(exc.reason)


FIELD_NAMES = sorted({field for data in VALID.values() for field in data} | {"args", "x"})


@PROPERTY
@given(
    st.sampled_from(SCHEMA_NAMES),
    st.dictionaries(st.sampled_from(FIELD_NAMES), JSON_VALUES, max_size=6),
)
def test_damaged_records_give_a_record_or_invalid_record(
    type_name: str, damage: dict[str, Any]
) -> None:
    data = valid(type_name, **damage)
    data["v"], data["type"] = 1, type_name
    try:
        record = decode(raw(data))
    except InvalidRecord as exc:
        assert_one_line(exc.reason)
    else:
        assert type(record) is CLASSES[type_name]
        assert decode(encode(record)) == record


# --------------------------------------------------------------- decode_as


def test_decode_as_returns_a_record_of_an_accepted_type() -> None:
    abort = decode_as(raw(VALID["saga.abort"]), SagaRequest, SagaAbort)
    assert isinstance(abort, SagaAbort)
    assert isinstance(decode_as(raw(VALID["saga.step"]), StepEvent), StepEvent)


def test_decode_as_rejects_another_type() -> None:
    reason = reason_of(raw(VALID["saga.step"]), lambda v: decode_as(v, SagaRequest, SagaAbort))
    assert reason == "expected saga.request or saga.abort on this topic, got saga.step"
    reason = reason_of(raw(VALID["saga.request"]), lambda v: decode_as(v, StepEvent))
    assert reason == "expected saga.step on this topic, got saga.request"
    reason = reason_of(
        raw(VALID["saga.request"]), lambda v: decode_as(v, StepEvent, Decision, SagaStatus)
    )
    assert reason == (
        "expected saga.step, saga.decision or saga.status on this topic, got saga.request"
    )


def test_decode_as_reports_the_wrong_type_before_schema_errors() -> None:
    broken = raw({"v": 1, "type": "saga.step", "tx_id": "a b"})
    reason = reason_of(broken, lambda v: decode_as(v, SagaRequest))
    assert reason == "expected saga.request on this topic, got saga.step"


def test_decode_as_still_checks_the_envelope_and_the_schema() -> None:
    assert reason_of(None, lambda v: decode_as(v, SagaAbort)) == "value is empty (a tombstone)"
    broken = raw(valid("saga.abort", tx_id="a b"))
    assert reason_of(broken, lambda v: decode_as(v, SagaAbort)).startswith("saga.abort: data.tx_id")


def test_decode_as_needs_a_type() -> None:
    with pytest.raises(ConfigurationError):
        decode_as(raw(VALID["saga.abort"]))


# ------------------------------------------------------------ schema files

SCHEMA_DIR = resources.files("streams") / "schemas"


def schema_file(name: str) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text("utf-8"))
    return parsed


def test_schema_names_are_the_record_types() -> None:
    assert SCHEMA_NAMES == (
        "saga.request",
        "saga.abort",
        "saga.step",
        "saga.decision",
        "saga.status",
        "saga.resolve",
        "saga.participant",
        "saga.committed",
    )
    assert set(SCHEMA_NAMES) == set(RECORD_TYPES)


def test_every_shipped_schema_file_is_named() -> None:
    shipped = {entry.name for entry in SCHEMA_DIR.iterdir() if entry.name.endswith(".json")}
    assert shipped == {f"{name}.schema.json" for name in SCHEMA_NAMES}


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_schema_file_is_draft_07_and_compiles(name: str) -> None:
    document = schema_file(name)
    assert document["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert document["$id"] == f"https://saga-olep.invalid/schemas/v1/{name}.json"
    assert document["title"].startswith(name)
    assert document["description"]
    assert document["type"] == "object"
    assert document["additionalProperties"] is False
    assert document["properties"]["v"]["const"] == 1
    assert document["properties"]["type"]["const"] == name
    key = {"saga.participant": "name", "saga.committed": "steps"}.get(name, "tx_id")
    assert {"v", "type", key} <= set(document["required"])
    assert set(document["required"]) <= set(document["properties"])
    validate = fastjsonschema.compile(document)
    validate(VALID[name])


def undocumented(node: Any, path: str) -> list[str]:
    """Paths of properties (at any depth) that have no description."""
    missing: list[str] = []
    if not isinstance(node, dict):
        return missing
    for key, child in node.get("properties", {}).items():
        if not (isinstance(child, dict) and child.get("description", "").strip()):
            missing.append(f"{path}.{key}")
        missing.extend(undocumented(child, f"{path}.{key}"))
    if "items" in node:
        missing.extend(undocumented(node["items"], f"{path}[]"))
    return missing


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_every_property_is_documented(name: str) -> None:
    assert undocumented(schema_file(name), name) == []


@pytest.mark.parametrize("name", SCHEMA_NAMES)
def test_schema_properties_match_the_record_fields(name: str) -> None:
    fields = {f.name for f in dataclasses.fields(CLASSES[name])}
    assert set(schema(name)["properties"]) == fields | {"v", "type"}


@pytest.mark.parametrize("name", TX_SCHEMAS)
def test_schema_tx_id_pattern_is_the_records_pattern(name: str) -> None:
    assert schema(name)["properties"]["tx_id"]["pattern"] == TX_ID_PATTERN


def test_committed_steps_tx_id_pattern_is_the_records_pattern() -> None:
    entry = schema("saga.committed")["properties"]["steps"]["items"]["items"]
    assert entry[0]["pattern"] == TX_ID_PATTERN
    assert (entry[1]["minimum"], entry[1]["maximum"]) == (0, MAX_STEPS - 1)


def test_committed_steps_stand_for_one_committed_event_each() -> None:
    record = decode_keyed(b"tx-1", raw(VALID["saga.committed"]), StepEvent, StepsCommitted)
    assert record == StepsCommitted("pg", 1250, (("tx-1", 0), ("tx-9", 2)))
    assert isinstance(record, StepsCommitted) and record.tx_id == "tx-1"
    assert step_events(record) == (
        StepEvent("tx-1", 0, "pg", StepStatus.COMMITTED, 1250),
        StepEvent("tx-9", 2, "pg", StepStatus.COMMITTED, 1250),
    )
    event = StepEvent("tx-1", 0, "pg", StepStatus.APPLIED, 1)
    assert step_events(event) == (event,)
    assert decode(encode(record)) == record


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ([], "data.steps must contain at least 1 items"),
        ([["tx-1", 0]] * 1001, "data.steps must contain less than or equal to 1000 items"),
        ([["tx-1", 0], ["tx-1", 0]], "saga.committed: a step is listed twice"),
        ([["tx-1", 1.0]], "saga.committed: a step must be an integer literal"),
        ([["tx-1", 64]], "must be smaller than or equal to 63"),
        ([["tx 1", 0]], "must match pattern"),
        ([["tx-1"]], "must contain at least 2 items"),
        ([["tx-1", 0, 0]], "must contain only specified items"),
        ([{"tx_id": "tx-1", "step": 0}], "data.steps[0] must be array"),
    ],
)
def test_bad_committed_steps_are_rejected(steps: Any, expected: str) -> None:
    reason = reason_of(raw(valid("saga.committed", steps=steps)))
    assert reason.startswith("saga.committed") and expected in reason, reason


def test_committed_steps_are_keyed_by_their_first_tx_id() -> None:
    value = raw(VALID["saga.committed"])
    reason = reason_of(value, lambda v: decode_keyed(b"tx-9", v, StepsCommitted))
    assert reason == "record key 'tx-9' differs from its tx_id 'tx-1'"


def test_schema_returns_a_fresh_copy() -> None:
    first = schema("saga.request")
    first["properties"].clear()
    assert schema("saga.request")["properties"]
    assert schema("saga.request") == schema_file("saga.request")


def test_schema_of_an_unknown_type_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match=r"there is no schema named 'saga\.nope'"):
        schema("saga.nope")


# ------------------------------------------------------------------ topics


def test_default_topic_names() -> None:
    topics = Topics()
    assert topics.requests == "saga.requests"
    assert topics.events == "saga.events"
    assert topics.decisions == "saga.decisions"
    assert topics.status == "saga.status"
    assert topics.dlq == "saga.dlq"
    assert topics.participants == "saga.participants"
    assert topics.all == (
        "saga.requests",
        "saga.events",
        "saga.decisions",
        "saga.status",
        "saga.dlq",
        "saga.participants",
    )
    assert topics.compacted == ("saga.status", "saga.participants")


def test_topic_prefix_is_configurable() -> None:
    topics = Topics("test-42_a.b")
    assert topics.requests == "test-42_a.b.requests"
    assert all(name.startswith("test-42_a.b.") for name in topics.all)
    assert Topics("x" * 100).dlq == "x" * 100 + ".dlq"


def test_topics_are_frozen_values() -> None:
    assert Topics("a") == Topics("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Topics().prefix = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "prefix", ["", "x" * 101, "my topics", "a/b", "saga!", "sagá", "a\n", 5, None]
)
def test_bad_topic_prefix_is_a_configuration_error(prefix: Any) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Topics(prefix)
    message = str(caught.value)
    assert "1 to 100 characters of A-Z, a-z, 0-9, '.', '_' and '-'" in message
    assert "\n" not in message


# -------------------------------------------------------------- public API


def test_public_names_are_exported() -> None:
    expected = {
        "Record", "SagaRequest", "SagaAbort", "StepEvent", "Decision", "SagaStatus",
        "Step", "StepProgress", "Mode", "StepStatus", "Outcome", "SagaState",
        "WIRE_VERSION", "MAX_STEPS", "TX_ID_PATTERN", "RECORD_TYPES",
        "SagaError", "ConfigurationError", "InvalidRecord", "BusinessRejection",
        "ConflictingRequest", "SagaTimeout", "TransientError", "FatalKafkaError",
        "encode", "decode", "decode_as", "schema", "to_dict", "SCHEMA_NAMES",
        "Topics",
    }  # fmt: skip
    assert expected <= set(saga.streams.__all__)
    assert len(saga.streams.__all__) == len(set(saga.streams.__all__))
    for name in saga.streams.__all__:
        assert hasattr(saga.streams, name), name
