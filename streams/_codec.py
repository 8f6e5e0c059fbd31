"""The one place that turns wire records into bytes and bytes into wire records.

Wire format (docs/architecture.md §3): one UTF-8 JSON object per record, carrying ``"v": 1``
and a ``"type"``, checked against the JSON Schema shipped in
``streams/schemas/<type>.schema.json``.

Contracts:

* :func:`decode` either returns a frozen record or raises
  :class:`~streams._errors.InvalidRecord` whose ``reason`` is one line a person
  can read. It raises nothing else, whatever the bytes are, so a consumer can
  send the record to the dead-letter topic and go on.
* :func:`encode` checks the record against the same schema before writing it,
  so a record this process produces is one every consumer accepts; a record
  that breaks the contract raises :class:`~streams._errors.InvalidRecord`.
* ``decode(encode(r)) == r`` for every valid record ``r`` whose ``args`` and
  ``meta`` hold plain JSON values, and equal records encode to equal bytes
  (keys are written sorted).

Beyond the schema, :mod:`streams._limits` bounds every record: its size,
how deep ``args`` and ``meta`` nest, and every number to the signed 64-bit
range. :func:`decode_keyed` also checks the record key, which is how every
consumer of the log reads it.

Schemas are compiled once, at import; decoding a record costs one JSON parse,
one run of the compiled validator and the construction of the frozen objects.
Nested ``args`` and ``meta`` objects are handed to the record as parsed, not
copied.

Every rule a record must follow is checked here, for decoding and encoding alike;
the JSON object form each record type is written as lives in :mod:`streams._wire_form`
(:func:`to_dict`, re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any, Final, TypeVar

import fastjsonschema
import orjson

from saga.streams._errors import ConfigurationError, InvalidRecord
from saga.streams._limits import INT64_MAX, INT64_MIN, MAX_NESTING, MAX_RECORD_BYTES
from saga.streams._records import (
    RECORD_TYPES,
    WIRE_VERSION,
    Decision,
    Isolation,
    Mode,
    Outcome,
    ParticipantAnnouncement,
    ParticipantState,
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
    StorageKind,
    TxRecord,
)
from saga.streams._wire_form import to_dict

__all__ = ["SCHEMA_NAMES", "decode", "decode_announcement", "decode_as", "decode_keyed"]
__all__ += ["encode", "schema", "to_dict"]

SCHEMA_NAMES: Final[tuple[str, ...]] = tuple(RECORD_TYPES)
"""The record types that have a schema, in wire-contract order."""

# Reasons end up in DLQ headers and log lines: keep them to one bounded line.
_MAX_REASON_CHARS: Final = 500
_MAX_VALUE_REPR_CHARS: Final = 60

_R = TypeVar("_R", bound="Record")
_Validator = Callable[[Any], Any]
_Builder = Callable[[dict[str, Any]], Record]


# --------------------------------------------------------------------- schemas


def _load_schemas() -> tuple[dict[str, bytes], dict[str, _Validator]]:
    """Read and compile every shipped schema; a broken package fails at import."""
    directory = resources.files(__name__.rpartition(".")[0]) / "schemas"
    raw: dict[str, bytes] = {}
    validators: dict[str, _Validator] = {}
    for name in SCHEMA_NAMES:
        text = (directory / f"{name}.schema.json").read_bytes()
        raw[name] = text
        # use_default=False: the validator must not add fields to the dicts it
        # checks (on encode they share nested objects with the caller's record);
        # defaults are filled by the builders below instead.
        validators[name] = fastjsonschema.compile(orjson.loads(text), use_default=False)
    return raw, validators


_SCHEMA_TEXT, _VALIDATORS = _load_schemas()


def schema(type_name: str) -> dict[str, Any]:
    """Return the JSON Schema of one record type, e.g. ``schema("saga.request")``.

    Each call returns a fresh dict, so callers may change it freely.

    Raises:
        ConfigurationError: ``type_name`` is not one of :data:`SCHEMA_NAMES`.
    """
    try:
        text = _SCHEMA_TEXT[type_name]
    except (KeyError, TypeError):
        known = ", ".join(SCHEMA_NAMES)
        raise ConfigurationError(
            f"there is no schema named {type_name!r}; the known ones are {known}"
        ) from None
    parsed: dict[str, Any] = orjson.loads(text)
    return parsed


# ----------------------------------------------------------------- reasons


def _one_line(text: str) -> str:
    """Collapse whitespace (newlines included) and bound the length of a reason."""
    line = " ".join(text.split())
    if len(line) > _MAX_REASON_CHARS:
        line = line[: _MAX_REASON_CHARS - 3] + "..."
    return line


def _short(value: object) -> str:
    """``repr`` of an untrusted value, cut so a huge value cannot flood a reason."""
    text = repr(value)
    if len(text) > _MAX_VALUE_REPR_CHARS:
        text = text[: _MAX_VALUE_REPR_CHARS - 3] + "..."
    return text


def _invalid(reason: str) -> InvalidRecord:
    return InvalidRecord(_one_line(reason))


_JSON_KIND: Final[dict[type, str]] = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def _expected(types: tuple[str, ...]) -> str:
    if len(types) == 1:
        return types[0]
    return ", ".join(types[:-1]) + " or " + types[-1]


# ----------------------------------------------------------------- limits

# A float is accepted when it lies strictly inside the signed 64-bit range:
# orjson turns an integer literal beyond 64 bits into a (rounded) float, so a
# larger float may be an integer that lost its digits.
_FLOAT_BOUND: Final = float(2**63)


def _check_values(data: dict[str, Any]) -> None:
    """Bound how deep ``args`` and ``meta`` nest and the range of every number in them.

    The schema bounds every other field. Iterative, so a record nested deeper than
    any limit cannot exhaust the stack here; the JSON parser refuses nesting beyond
    its own limit before this runs.
    """
    meta = data.get("meta")
    if meta:
        _check_tree("meta", meta)
    for i, step in enumerate(data["steps"] if data["type"] == "saga.request" else ()):
        args = step.get("args")
        if args:
            _check_tree(f"steps[{i}].args", args)


def _check_tree(where: str, root: Any) -> None:
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        value, level = stack.pop()
        kind = type(value)
        if kind is dict:
            children: Any = value.values()
        elif kind is list or kind is tuple:
            children = value
        elif isinstance(value, Mapping):  # encode: any mapping is written as an object
            children = value.values()
        else:
            continue
        if level > MAX_NESTING:
            raise _invalid(f"{where} nests more than {MAX_NESTING} levels deep")
        for child in children:
            kind = type(child)
            if kind is int:
                if not INT64_MIN <= child <= INT64_MAX:
                    raise _invalid(
                        f"the number {_short(child)} in {where} is outside the signed 64-bit range"
                    )
            elif kind is float:
                if not -_FLOAT_BOUND < child < _FLOAT_BOUND:
                    raise _invalid(
                        f"the number {_short(child)} in {where} is outside the signed 64-bit range"
                    )
            elif kind is not str and kind is not bool and child is not None:
                stack.append((child, level + 1))


# ----------------------------------------------------------------- decoding


def _check_request(data: dict[str, Any]) -> None:
    """Rules of a request that a JSON Schema cannot express."""
    if data["deadline_ms"] < data["created_ms"]:
        raise _invalid(
            f"saga.request: deadline_ms ({data['deadline_ms']}) is before "
            f"created_ms ({data['created_ms']})"
        )


# The builders run only on validated dicts, so every field is present and has
# the right JSON type. int() turns 5.0, which JSON Schema counts as an integer,
# into 5.


def _build_request(data: dict[str, Any]) -> SagaRequest:
    _check_request(data)
    return SagaRequest(
        tx_id=data["tx_id"],
        saga=data["saga"],
        mode=Mode(data.get("mode", "parallel")),
        steps=tuple(Step(s["participant"], s["action"], s.get("args", {})) for s in data["steps"]),
        deadline_ms=int(data["deadline_ms"]),
        created_ms=int(data["created_ms"]),
        meta=data.get("meta"),
        isolation=Isolation(data.get("isolation", "read_committed")),
    )


def _build_abort(data: dict[str, Any]) -> SagaAbort:
    return SagaAbort(
        tx_id=data["tx_id"], reason=data["reason"], at_ms=int(data["at_ms"]), by=data.get("by")
    )


def _build_resolve(data: dict[str, Any]) -> SagaResolve:
    return SagaResolve(
        tx_id=data["tx_id"],
        step=int(data["step"]),
        note=data["note"],
        by=data["by"],
        at_ms=int(data["at_ms"]),
    )


def _build_step(data: dict[str, Any]) -> StepEvent:
    return StepEvent(
        tx_id=data["tx_id"],
        step=int(data["step"]),
        participant=data["participant"],
        status=StepStatus(data["status"]),
        at_ms=int(data["at_ms"]),
        reason=data.get("reason"),
        confirm=data.get("confirm", False),
    )


def _build_committed(data: dict[str, Any]) -> StepsCommitted:
    if any(type(step) is not int for _, step in data["steps"]):
        raise _invalid("saga.committed: a step must be an integer literal")
    steps = tuple((tx_id, step) for tx_id, step in data["steps"])
    if len(set(steps)) != len(steps):
        raise _invalid("saga.committed: a step is listed twice")
    return StepsCommitted(participant=data["participant"], at_ms=int(data["at_ms"]), steps=steps)


def _build_decision(data: dict[str, Any]) -> Decision:
    return Decision(
        tx_id=data["tx_id"],
        outcome=Outcome(data["outcome"]),
        reason=data["reason"],
        at_ms=int(data["at_ms"]),
    )


def _build_status(data: dict[str, Any]) -> SagaStatus:
    return SagaStatus(
        tx_id=data["tx_id"],
        saga=data["saga"],
        state=SagaState(data["state"]),
        steps=tuple(
            StepProgress(s["participant"], StepStatus(s["status"]), s.get("confirm", False))
            for s in data["steps"]
        ),
        reason=data["reason"],
        created_ms=int(data["created_ms"]),
        updated_ms=int(data["updated_ms"]),
        deadline_ms=int(data["deadline_ms"]),
        fingerprint=data.get("fingerprint"),
    )


def _build_announcement(data: dict[str, Any]) -> ParticipantAnnouncement:
    return ParticipantAnnouncement(
        name=data["name"],
        storage=StorageKind(data["storage"]),
        targets=tuple(data["targets"]),
        version=data["version"],
        instance=data["instance"],
        started_ms=int(data["started_ms"]),
        heartbeat_ms=int(data["heartbeat_ms"]),
        interval_ms=int(data["interval_ms"]),
        state=ParticipantState(data.get("state", "up")),
        host=data.get("host"),
    )


_BUILDERS: Final[dict[str, _Builder]] = {
    SagaRequest.TYPE: _build_request,
    SagaAbort.TYPE: _build_abort,
    SagaResolve.TYPE: _build_resolve,
    StepEvent.TYPE: _build_step,
    StepsCommitted.TYPE: _build_committed,
    Decision.TYPE: _build_decision,
    SagaStatus.TYPE: _build_status,
    ParticipantAnnouncement.TYPE: _build_announcement,
}


_INTEGER_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    SagaRequest.TYPE: ("v", "deadline_ms", "created_ms"),
    SagaAbort.TYPE: ("v", "at_ms"),
    SagaResolve.TYPE: ("v", "step", "at_ms"),
    StepEvent.TYPE: ("v", "step", "at_ms"),
    StepsCommitted.TYPE: ("v", "at_ms"),
    Decision.TYPE: ("v", "at_ms"),
    SagaStatus.TYPE: ("v", "created_ms", "updated_ms", "deadline_ms"),
    ParticipantAnnouncement.TYPE: ("v", "started_ms", "heartbeat_ms", "interval_ms"),
}


def _decode(value: bytes | None, allowed: tuple[str, ...] | None) -> Record:
    # `not value` rather than len(): it also holds for a value of a wrong type.
    if not value:
        raise _invalid("value is empty (a tombstone)")
    if isinstance(value, bytes | bytearray | str) and len(value) > MAX_RECORD_BYTES:
        raise _invalid(f"record is {len(value)} bytes, more than the {MAX_RECORD_BYTES} allowed")
    try:
        data = orjson.loads(value)
    except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
        # orjson reports invalid UTF-8 as a JSONDecodeError; TypeError covers a
        # value that is not bytes at all.
        raise _invalid(f"record is not valid JSON: {exc}") from None
    if type(data) is not dict:
        kind = _JSON_KIND.get(type(data), type(data).__name__)
        raise _invalid(f"record must be a JSON object, got {kind}")

    if "v" not in data:
        raise _invalid("record has no 'v' field (the wire version)")
    version = data["v"]
    # bool is an int in Python, but `true` is not the version number 1.
    if version != WIRE_VERSION or isinstance(version, bool):
        raise _invalid(f"wire version {_short(version)} is not supported (expected {WIRE_VERSION})")

    if "type" not in data:
        raise _invalid("record has no 'type' field")
    type_name = data["type"]
    # The isinstance check comes first: an unhashable "type" (a list) would make
    # the dict lookup raise TypeError.
    if not isinstance(type_name, str) or type_name not in _BUILDERS:
        raise _invalid(f"unknown record type {_short(type_name)}")
    if allowed is not None and type_name not in allowed:
        raise _invalid(f"expected {_expected(allowed)} on this topic, got {type_name}")

    try:
        _VALIDATORS[type_name](data)
    except fastjsonschema.JsonSchemaException as exc:
        message = getattr(exc, "message", None) or str(exc)
        raise _invalid(f"{type_name}: {message}") from None
    for name in _INTEGER_FIELDS[type_name]:
        # JSON Schema counts 10.0 as an integer; the contract (and the audit's Spark
        # reader, which parses these fields as BIGINT) wants an integer literal.
        if name in data and type(data[name]) is not int:
            raise _invalid(f"{type_name}: {name} must be an integer literal, got {data[name]!r}")
    _check_values(data)
    return _BUILDERS[type_name](data)


def decode(value: bytes | None) -> Record:
    """Decode one record value (as read from Kafka) into a frozen record.

    ``None`` and ``b""`` (tombstones) are rejected. A request without ``mode``
    gets ``Mode.PARALLEL``, a step without ``args`` gets ``{}``.

    Raises:
        InvalidRecord: the value breaks the wire contract; ``reason`` says how in
            one line, e.g. ``"saga.request: data.steps must contain at least 1
            items"``. Nothing else is raised, whatever ``value`` holds.
    """
    return _decode(value, None)


def decode_as(value: bytes | None, /, *kinds: type[Record]) -> Record:
    """Decode a record that must be one of ``kinds``, e.g. a topic's record types.

    ``decode_as(value, SagaRequest, SagaAbort)`` is how the requests topic is read.
    The type is checked before the schema, so a record of the wrong type is
    reported as such even when it is also malformed.

    Raises:
        InvalidRecord: as :func:`decode`, and with ``"expected saga.request or
            saga.abort on this topic, got saga.step"`` for a record of another type.
        ConfigurationError: no ``kinds`` were given.
    """
    if not kinds:
        raise ConfigurationError("decode_as needs at least one record type to accept")
    return _decode(value, tuple(kind.TYPE for kind in kinds))


def decode_keyed(key: bytes | None, value: bytes | None, /, *kinds: type[Record]) -> Record:
    """Decode a record as read from a topic: its key, its value, the topic's record types.

    Everything :func:`decode_as` checks, and that the key is exactly the record's
    ``tx_id`` (a record keyed otherwise may sit on another transaction's partition,
    and no decision would ever settle what it asks) and that key and value together
    stay within :data:`~streams._limits.MAX_RECORD_BYTES`.

    Raises:
        InvalidRecord: as :func:`decode_as`, or the key is not the ``tx_id``.
    """
    record = _with_key(key, value, kinds)
    if not isinstance(record, TxRecord):
        raise _invalid(f"{record.TYPE} is not a transaction's record; read it with its own decoder")
    return _keyed_as(record, key, record.tx_id, "tx_id")


def decode_announcement(key: bytes | None, value: bytes | None, /) -> ParticipantAnnouncement:
    """Decode a record of the participants topic: ``saga.participant``, key ``<name>/<instance>``.

    Raises:
        InvalidRecord: as :func:`decode_keyed`, with the key ``<name>/<instance>``. A
            tombstone is refused too: the registry reads it as "forget" before decoding.
    """
    record = _with_key(key, value, (ParticipantAnnouncement,))
    assert isinstance(record, ParticipantAnnouncement)
    return _keyed_as(record, key, record.key, "name/instance")


def _with_key(key: bytes | None, value: bytes | None, kinds: tuple[type[Record], ...]) -> Record:
    size = len(key or b"") + len(value or b"")
    if size > MAX_RECORD_BYTES:
        raise _invalid(f"record is {size} bytes, more than the {MAX_RECORD_BYTES} allowed")
    return decode_as(value, *kinds)


def _keyed_as(record: _R, key: bytes | None, expected: str, what: str) -> _R:
    if key != expected.encode():
        shown = _short(key.decode("utf-8", "replace")) if key is not None else "none"
        raise _invalid(f"record key {shown} differs from its {what} {expected!r}")
    return record


# ----------------------------------------------------------------- encoding


def _json_default(value: object) -> object:
    # orjson writes dicts natively; other mappings nested in args or meta
    # (MappingProxyType, ...) are written as objects too.
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def encode(record: Record) -> bytes:
    """Encode ``record`` as the UTF-8 JSON bytes of its wire form.

    The record is checked against its schema first, so what this returns is
    accepted by :func:`decode`. Keys are sorted, so equal records give equal
    bytes. ``args`` and ``meta`` should hold JSON values (dict, list, str, int,
    float, bool, None); other types orjson knows (datetime, UUID, ...) are
    written in their JSON form and come back as such.

    Raises:
        InvalidRecord: the record breaks the wire contract (e.g. 65 steps, a
            tx_id with a space, a deadline before creation) or holds a value
            that cannot be written as JSON.
        TypeError: ``record`` is not one of the wire record classes.
    """
    data = to_dict(record)
    type_name: str = data["type"]
    try:
        _VALIDATORS[type_name](data)
    except fastjsonschema.JsonSchemaException as exc:
        message = getattr(exc, "message", None) or str(exc)
        raise _invalid(f"{type_name}: {message}") from None
    if type_name == SagaRequest.TYPE:
        _check_request(data)
    _check_values(data)
    try:
        encoded = orjson.dumps(data, default=_json_default, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:
        raise _invalid(f"{type_name}: cannot be written as JSON: {exc}") from None
    if len(encoded) > MAX_RECORD_BYTES:
        raise _invalid(
            f"{type_name}: is {len(encoded)} bytes, more than the {MAX_RECORD_BYTES} allowed"
        )
    return encoded
