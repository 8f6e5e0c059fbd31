"""Hostile records against the codec: the limits of streams._limits, and property tests.

Whatever bytes arrive, decoding either gives a record or raises InvalidRecord;
and whatever it accepts, every later step can handle: it encodes again, its
fingerprint can be taken, and it fits the dead-letter topic whole.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saga.streams import (
    MAX_NESTING,
    MAX_REASON_CHARS,
    MAX_RECORD_BYTES,
    InvalidRecord,
    SagaAbort,
    SagaRequest,
    StepEvent,
    StepsCommitted,
    decode,
    decode_keyed,
    encode,
    schema,
)

pytestmark = pytest.mark.unit


def request(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "v": 1,
        "type": "saga.request",
        "tx_id": "tx-1",
        "saga": "transfer",
        "steps": [{"participant": "bank", "action": "increment", "args": {"by": 1}}],
        "deadline_ms": 2000,
        "created_ms": 1000,
    }
    data.update(overrides)
    return data


def nested(levels: int) -> bytes:
    """An ``args`` object whose nesting is exactly ``levels`` (the object itself is 1)."""
    inner = b"[" * (levels - 1) + b"]" * (levels - 1)
    return b'{"x":' + inner + b"}" if levels > 1 else b"{}"


def with_args(args_json: bytes) -> bytes:
    return orjson.dumps(request()).replace(b'{"by":1}', args_json)


def reason_of(value: bytes) -> str:
    with pytest.raises(InvalidRecord) as caught:
        decode(value)
    return caught.value.reason


# ------------------------------------------------------------------ each limit


def test_args_may_nest_up_to_the_limit_and_no_deeper() -> None:
    assert isinstance(decode(with_args(nested(MAX_NESTING))), SagaRequest)
    assert "nests more than" in reason_of(with_args(nested(MAX_NESTING + 1)))


def test_the_reported_300_level_list_is_rejected_not_a_crash() -> None:
    assert "nests more than" in reason_of(with_args(b'{"x":' + b"[" * 300 + b"]" * 300 + b"}"))


def test_meta_nesting_is_bounded_too() -> None:
    deep = orjson.loads(nested(MAX_NESTING + 1))
    value = orjson.dumps(request(meta=deep))
    assert "meta nests more than" in reason_of(value)


def test_parser_depth_beyond_its_own_limit_is_an_invalid_record() -> None:
    assert "not valid JSON" in reason_of(with_args(b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}"))


@pytest.mark.parametrize(
    "number",
    [b"1180591620717411303425", b"9223372036854775808", b"-9223372036854775809", b"1e300"],
)
def test_numbers_outside_signed_64_bits_are_rejected_not_rounded(number: bytes) -> None:
    assert "outside the signed 64-bit range" in reason_of(with_args(b'{"by":' + number + b"}"))


@pytest.mark.parametrize("number", [b"9223372036854775807", b"-9223372036854775808", b"2.5"])
def test_numbers_inside_signed_64_bits_are_kept_exactly(number: bytes) -> None:
    record = decode(with_args(b'{"by":' + number + b"}"))
    assert isinstance(record, SagaRequest)
    assert record.steps[0].args["by"] == orjson.loads(number)


@pytest.mark.parametrize(
    "tail", [b" x", b'{"v":1}', b"\x00", b"]"], ids=["text", "object", "nul", "bracket"]
)
def test_exactly_one_object_and_nothing_after_it(tail: bytes) -> None:
    assert "not valid JSON" in reason_of(orjson.dumps(request()) + tail)


def test_trailing_whitespace_is_json_and_accepted() -> None:
    assert isinstance(decode(orjson.dumps(request()) + b"\n  "), SagaRequest)


def test_tx_id_with_a_trailing_newline_is_rejected() -> None:
    assert "tx_id" in reason_of(orjson.dumps(request(tx_id="tx-1\n")))


@pytest.mark.parametrize("size", [MAX_RECORD_BYTES + 1, 1_040_000])
def test_records_over_the_size_limit_are_rejected_before_parsing(size: int) -> None:
    assert f"more than the {MAX_RECORD_BYTES} allowed" in reason_of(b"{" * size)


def test_a_valid_record_just_over_the_size_limit_is_rejected() -> None:
    padding = "p" * MAX_RECORD_BYTES
    value = orjson.dumps(request(meta={"pad": padding}))
    assert "more than the" in reason_of(value)


def test_encode_refuses_what_decode_would_refuse_for_size() -> None:
    record = decode(orjson.dumps(request()))
    assert isinstance(record, SagaRequest)
    big = SagaRequest(
        record.tx_id,
        record.saga,
        record.mode,
        record.steps,
        record.deadline_ms,
        record.created_ms,
        {"pad": "p" * MAX_RECORD_BYTES},
    )
    with pytest.raises(InvalidRecord, match="more than the"):
        encode(big)


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"v": 1, "type": "saga.abort", "tx_id": "t", "at_ms": 1}, "reason"),
        (
            {
                "v": 1,
                "type": "saga.step",
                "tx_id": "t",
                "step": 0,
                "participant": "bank",
                "status": "failed",
                "at_ms": 1,
            },
            "reason",
        ),
        (
            {"v": 1, "type": "saga.decision", "tx_id": "t", "outcome": "rollback", "at_ms": 1},
            "reason",
        ),
    ],
    ids=["abort", "step", "decision"],
)
def test_reasons_are_bounded(value: dict[str, Any], field: str) -> None:
    decode(orjson.dumps({**value, field: "r" * MAX_REASON_CHARS}))
    for length in (MAX_REASON_CHARS + 1, 1_030_000):
        too_long = orjson.dumps({**value, field: "r" * length})
        assert f"than or equal to {MAX_REASON_CHARS} characters" in reason_of(too_long) or (
            "more than the" in reason_of(too_long)
        )


def test_every_reason_field_of_the_schemas_carries_the_limit() -> None:
    for name in ("saga.abort", "saga.step", "saga.decision", "saga.status"):
        assert schema(name)["properties"]["reason"]["maxLength"] == MAX_REASON_CHARS, name


def test_decode_keyed_wants_the_key_to_be_the_tx_id() -> None:
    value = orjson.dumps(request())
    assert isinstance(decode_keyed(b"tx-1", value, SagaRequest, SagaAbort), SagaRequest)
    for key in (b"tx-2", b"tx-1\n", None, b"\xff"):
        with pytest.raises(InvalidRecord, match="differs from its tx_id"):
            decode_keyed(key, value, SagaRequest)


def test_decode_keyed_counts_the_key_in_the_size() -> None:
    value = orjson.dumps(request())
    with pytest.raises(InvalidRecord, match="more than the"):
        decode_keyed(b"k" * MAX_RECORD_BYTES, value, SagaRequest)


# ------------------------------------------------------------------ properties

JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
ANY_JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=40,
)


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        return b"null"


def _accepts_everything_it_decoded(value: bytes) -> None:
    try:
        record = decode(value)
    except InvalidRecord:
        return
    # What a consumer accepted, every later step can handle.
    encoded = encode(record)
    assert len(encoded) <= MAX_RECORD_BYTES
    if isinstance(record, SagaRequest):
        assert len(record.fingerprint()) == 32


@given(st.binary(max_size=300))
@settings(max_examples=400)
def test_any_bytes_give_a_record_or_an_invalid_record(value: bytes) -> None:
    _accepts_everything_it_decoded(value)


@given(
    field=st.sampled_from(
        ["tx_id", "saga", "mode", "steps", "deadline_ms", "created_ms", "meta", "v", "type", "x"]
    ),
    replacement=ANY_JSON,
)
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_a_request_with_any_field_replaced_is_handled(field: str, replacement: Any) -> None:
    _accepts_everything_it_decoded(_dumps(request(**{field: replacement})))


@given(args=ANY_JSON, meta=ANY_JSON)
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_any_args_and_meta_are_handled(args: Any, meta: Any) -> None:
    steps = [{"participant": "bank", "action": "put", "args": args}]
    _accepts_everything_it_decoded(_dumps(request(steps=steps, meta=meta)))


@given(depth=st.integers(1, 3000), wrap=st.sampled_from([b"[", b'{"a":']))
@settings(max_examples=150)
def test_any_nesting_is_handled(depth: int, wrap: bytes) -> None:
    close = b"]" if wrap == b"[" else b"}"
    _accepts_everything_it_decoded(with_args(b'{"x":' + wrap * depth + b"1" + close * depth + b"}"))


@given(
    status=st.sampled_from(["applied", "failed", "compensated"]),
    reason=st.one_of(st.none(), st.text(max_size=1200)),
    step=st.integers(-5, 100),
)
@settings(max_examples=200)
def test_any_step_event_is_handled(status: str, reason: str | None, step: int) -> None:
    value = {
        "v": 1,
        "type": "saga.step",
        "tx_id": "t",
        "step": step,
        "participant": "bank",
        "status": status,
        "at_ms": 1,
        "reason": reason,
    }
    _accepts_everything_it_decoded(_dumps(value))
    try:
        record = decode(_dumps(value))
    except InvalidRecord:
        return
    assert isinstance(record, StepEvent)


@given(steps=ANY_JSON | st.lists(st.lists(ANY_JSON, max_size=3), max_size=5))
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
def test_any_committed_steps_list_is_handled(steps: Any) -> None:
    value = {"v": 1, "type": "saga.committed", "participant": "bank", "at_ms": 1, "steps": steps}
    _accepts_everything_it_decoded(_dumps(value))
    try:
        record = decode(_dumps(value))
    except InvalidRecord:
        return
    assert isinstance(record, StepsCommitted)
    assert all(type(step) is int and 0 <= step <= 63 for _, step in record.steps)
    assert len(set(record.steps)) == len(record.steps) == len(record.events())
