"""The built-in actions' validation: what every storage adapter can rely on before any I/O."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saga.participants._actions import (
    BUILTIN_ACTIONS,
    IDENTIFIER,
    Delete,
    Increment,
    Insert,
    Put,
    Update,
    is_builtin,
    parse_action,
)
from saga.streams import BusinessRejection

pytestmark = pytest.mark.unit

ALLOWED = frozenset({"accounts", "orders"})


def rejected(action: Any, args: Any) -> str:
    with pytest.raises(BusinessRejection) as info:
        parse_action(action, args, ALLOWED)
    assert str(info.value) == info.value.reason
    return info.value.reason


# ---------------------------------------------------------------- accepted


def test_each_action_parses_to_its_value() -> None:
    assert parse_action(
        "insert", {"target": "accounts", "key": 42, "value": {"balance": 10}}, ALLOWED
    ) == Insert("accounts", 42, {"balance": 10})
    assert parse_action(
        "put", {"target": "orders", "key": "o-1", "value": {"item": "book", "qty": 2}}, ALLOWED
    ) == Put("orders", "o-1", {"item": "book", "qty": 2})
    assert parse_action(
        "update", {"target": "accounts", "key": 1, "set": {"owner": None}}, ALLOWED
    ) == Update("accounts", 1, {"owner": None})
    assert parse_action("delete", {"target": "accounts", "key": "k"}, ALLOWED) == Delete(
        "accounts", "k"
    )
    assert parse_action(
        "increment",
        {"target": "accounts", "key": 7, "field": "balance", "by": -5, "min": 0},
        ALLOWED,
    ) == Increment("accounts", 7, "balance", -5, 0, None)


def test_increment_bounds_are_optional_and_null_means_absent() -> None:
    parsed = parse_action(
        "increment",
        {"target": "accounts", "key": 7, "field": "balance", "by": 1.5, "min": None, "max": 10},
        ALLOWED,
    )
    assert parsed == Increment("accounts", 7, "balance", 1.5, None, 10)


def test_values_are_frozen_and_copied() -> None:
    value = {"balance": 10}
    parsed = parse_action("insert", {"target": "accounts", "key": 1, "value": value}, ALLOWED)
    value["balance"] = 99
    assert isinstance(parsed, Insert)
    assert parsed.value == {"balance": 10}
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.key = 2  # type: ignore[misc]


def test_builtin_names() -> None:
    assert frozenset({"insert", "put", "update", "delete", "increment"}) == BUILTIN_ACTIONS
    assert is_builtin("increment")
    assert not is_builtin("reserve_seat")
    assert not is_builtin("Insert")


def test_scalar_values_of_every_json_kind_are_accepted() -> None:
    value = {"s": "text ü", "i": -(2**63), "f": 0.25, "t": True, "n": None}
    parsed = parse_action("put", {"target": "orders", "key": "a", "value": value}, ALLOWED)
    assert isinstance(parsed, Put)
    assert parsed.value == value


def test_keys_at_the_limits_are_accepted() -> None:
    for key in ("k" * 256, 2**63 - 1, -(2**63), 0, "ключ"):
        parse_action("delete", {"target": "accounts", "key": key}, ALLOWED)


# ---------------------------------------------------------------- rejected


def test_unknown_action_names_the_built_ins() -> None:
    assert rejected("x", {}) == (
        "unknown action 'x' (built-in actions: insert, put, update, delete, increment; "
        "custom actions need a handler)"
    )
    assert rejected(None, {}).startswith("unknown action None")


def test_target_outside_the_allow_list() -> None:
    reason = rejected("delete", {"target": "x", "key": 1})
    assert reason == "target 'x' is not in this participant's allow-list (accounts, orders)"
    with pytest.raises(BusinessRejection, match=r"allow-list \(empty\)"):
        parse_action("delete", {"target": "x", "key": 1}, frozenset())


@pytest.mark.parametrize(
    "name",
    [
        "accounts; DROP TABLE x",
        'a"b',
        "a b",
        "1accounts",
        "",
        "a" * 64,
        "accounts--",
        "ac\u0441ounts",  # a Cyrillic letter that looks Latin
        "accounts\n",
    ],
)
def test_names_that_are_not_identifiers_are_rejected(name: str) -> None:
    assert "is not a valid name" in rejected("delete", {"target": name, "key": 1})
    assert "is not a valid name" in rejected(
        "insert", {"target": "accounts", "key": 1, "value": {name: 1}}
    )
    assert "is not a valid name" in rejected(
        "update", {"target": "accounts", "key": 1, "set": {name: 1}}
    )
    assert "is not a valid name" in rejected(
        "increment", {"target": "accounts", "key": 1, "field": name, "by": 1}
    )


def test_identifier_pattern_allows_63_characters() -> None:
    assert IDENTIFIER.fullmatch("a" * 63)
    assert IDENTIFIER.fullmatch("_private_1")
    assert not IDENTIFIER.fullmatch("a" * 64)


def test_missing_and_unexpected_arguments() -> None:
    assert rejected("insert", {"target": "accounts", "key": 1}) == (
        "insert is missing argument 'value' (it takes target, key, value)"
    )
    assert rejected("increment", {"target": "accounts"}) == (
        "increment is missing arguments 'key', 'field', 'by' "
        "(it takes target, key, field, by, min?, max?)"
    )
    assert rejected(
        "increment",
        {"target": "accounts", "key": 1, "field": "b", "by": 1, "mni": 0},
    ) == ("increment got unexpected argument 'mni' (it takes target, key, field, by, min?, max?)")
    assert "unexpected argument 1" in rejected("delete", {"target": "accounts", "key": 1, 1: 2})
    assert rejected("delete", ["target", "key"]) == (
        "the arguments of delete must be an object, not a list"
    )


@pytest.mark.parametrize(
    ("key", "fragment"),
    [
        ("", "must not be empty"),
        ("k" * 257, "257 characters long"),
        ("a\x00b", "control character"),
        ("a\nb", "control character"),
        ("a\x7fb", "control character"),
        (True, "not a boolean"),
        (1.0, "not a number"),
        (None, "not null"),
        ([1], "not a list"),
        ({"id": 1}, "not an object"),
        (2**63, "does not fit in 64 bits"),
    ],
)
def test_bad_keys(key: Any, fragment: str) -> None:
    assert fragment in rejected("delete", {"target": "accounts", "key": key})


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ([1, 2], "must be a JSON scalar"),
        ({"a": 1}, "must be a JSON scalar"),
        (math.nan, "finite number"),
        (math.inf, "finite number"),
        ("a\x00b", "NUL character"),
        (2**64, "does not fit in 64 bits"),
        (b"bytes", "must be a JSON scalar"),
    ],
)
def test_values_must_be_json_scalars(value: Any, fragment: str) -> None:
    reason = rejected("put", {"target": "orders", "key": "a", "value": {"item": value}})
    assert fragment in reason
    assert "'item'" in reason


def test_value_and_set_must_be_non_empty_objects() -> None:
    assert rejected("insert", {"target": "accounts", "key": 1, "value": {}}) == (
        "insert value must name at least one field"
    )
    assert rejected("update", {"target": "accounts", "key": 1, "set": {}}) == (
        "update set must name at least one field"
    )
    assert rejected("update", {"target": "accounts", "key": 1, "set": "balance=0"}) == (
        "update set must be an object of fields, not a string"
    )


@pytest.mark.parametrize("arg", ["by", "min", "max"])
@pytest.mark.parametrize("bad", [True, "1", [1], math.nan, 2**63])
def test_increment_numbers(arg: str, bad: Any) -> None:
    args: dict[str, Any] = {"target": "accounts", "key": 1, "field": "balance", "by": 1}
    args[arg] = bad
    assert f"increment {arg} " in rejected("increment", args)


def test_increment_min_above_max() -> None:
    args = {"target": "accounts", "key": 1, "field": "balance", "by": 1, "min": 5, "max": 1}
    assert rejected("increment", args) == "increment has min 5 greater than max 1"


def test_long_values_are_cut_short_in_reasons() -> None:
    reason = rejected("delete", {"target": "x" * 1000, "key": 1})
    assert len(reason) < 200


# ---------------------------------------------------------------- fuzzing

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
arg_names = st.sampled_from(["target", "key", "value", "set", "field", "by", "min", "max"])
names = st.sampled_from(["accounts", "orders", "x", "balance", 'a"b', ""]) | st.text(max_size=70)
shaped_args = st.dictionaries(
    arg_names,
    json_values | names | st.dictionaries(names, json_scalars, max_size=3),
    max_size=7,
)
any_args = shaped_args | st.dictionaries(st.text(max_size=8), json_values) | json_values
actions = st.sampled_from(sorted(BUILTIN_ACTIONS)) | st.text(max_size=10) | json_scalars


@settings(max_examples=1500, deadline=None)
@given(action=actions, args=any_args)
def test_parse_action_raises_only_business_rejections(action: Any, args: Any) -> None:
    try:
        parsed = parse_action(action, args, ALLOWED)
    except BusinessRejection as exc:
        assert exc.reason
        return
    # Whatever got through is well-formed.
    assert parsed.target in ALLOWED
    assert isinstance(parsed.key, str | int)
    assert not isinstance(parsed.key, bool)
    for field in getattr(parsed, "value", None) or getattr(parsed, "set", None) or {}:
        assert IDENTIFIER.fullmatch(field)


identifiers = st.from_regex(IDENTIFIER, fullmatch=True)
keys = st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cc"]), min_size=1, max_size=256
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"))
)
fields = st.dictionaries(identifiers, scalars, min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(target=st.sampled_from(sorted(ALLOWED)), key=keys, value=fields)
def test_well_formed_steps_are_accepted(target: str, key: str | int, value: dict[str, Any]) -> None:
    assert parse_action("put", {"target": target, "key": key, "value": value}, ALLOWED) == Put(
        target, key, value
    )
    assert parse_action("update", {"target": target, "key": key, "set": value}, ALLOWED) == Update(
        target, key, value
    )
