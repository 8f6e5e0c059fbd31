"""The built-in actions (docs/architecture.md §3), validated once for every storage adapter.

A step names an action and its arguments; the wire contract only promises a
JSON object. :func:`parse_action` turns that object into one of the frozen
action values below or raises :class:`~streams.BusinessRejection` with one
sentence saying what is wrong, so a step that cannot be applied fails (and its
saga rolls back) before any storage sees it. No I/O happens here.

=============  ======================================  ===================================
action         arguments                               what the storage does
=============  ======================================  ===================================
``insert``     ``target, key, value``                  create; fails when the key exists
``put``        ``target, key, value``                  create or overwrite the fields
``update``     ``target, key, set``                    change fields; fails when absent
``delete``     ``target, key``                         remove; fails when absent
``increment``  ``target, key, field, by, min?, max?``  add ``by``; fails when absent or
                                                       when outside ``[min, max]``
=============  ======================================  ===================================

What is checked here, identically for every storage:

* the action is built in, the arguments are exactly the ones it takes;
* ``target`` is in the participant's allow-list; ``target`` and every field
  name match :data:`IDENTIFIER` (so no quoting or injection trick reaches a
  storage);
* ``key`` is a non-empty string (at most 256 characters, no control
  characters) or a 64-bit integer;
* field values are JSON scalars (string without NUL, 64-bit integer, finite
  float, boolean, null); ``value`` and ``set`` name at least one field;
* ``by``, ``min`` and ``max`` are numbers (a boolean is not), ``min <= max``.

What only the storage can check (the key exists, a field is a column, the
result stays in range) is the adapter's business.
"""

from __future__ import annotations

import copy
import math
import re
from abc import abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeAlias

from saga.participants._barrier import ISOLATION_KEY, isolation_of
from saga.participants._storage import Actions, NativeT, StepScope
from saga.streams import BusinessRejection, ConfigurationError, Isolation

IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
"""Target and field names: letters, digits and ``_``, not starting with a digit, 1-63 characters
(PostgreSQL's identifier limit). Use ``fullmatch``: ``$`` would let a trailing newline through."""

MAX_KEY_LENGTH: Final = 256
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

Key: TypeAlias = str | int
Scalar: TypeAlias = str | int | float | bool | None
Number: TypeAlias = int | float
Fields: TypeAlias = Mapping[str, Scalar]


@dataclass(frozen=True, slots=True)
class Insert:
    """Create ``target/key`` with ``value``; a business rejection when it exists."""

    target: str
    key: Key
    value: Fields


@dataclass(frozen=True, slots=True)
class Put:
    """Create ``target/key`` or overwrite the fields named in ``value`` (an upsert)."""

    target: str
    key: Key
    value: Fields


@dataclass(frozen=True, slots=True)
class Update:
    """Change the fields named in ``set``; a business rejection when the key is absent."""

    target: str
    key: Key
    set: Fields


@dataclass(frozen=True, slots=True)
class Delete:
    """Remove ``target/key``; a business rejection when it is absent."""

    target: str
    key: Key


@dataclass(frozen=True, slots=True)
class Increment:
    """Add ``by`` to ``field``; a business rejection when the key is absent or the result
    falls outside ``[min, max]`` (an absent bound does not limit)."""

    target: str
    key: Key
    field: str
    by: Number
    min: Number | None = None
    max: Number | None = None


BuiltinAction: TypeAlias = Insert | Put | Update | Delete | Increment

BUILTIN_ACTIONS: Final = frozenset({"insert", "put", "update", "delete", "increment"})

# Required and optional argument names per action; anything else is rejected so
# that a misspelt optional argument (``mni``) does not silently drop a guard.
_REQUIRED: Final[dict[str, tuple[str, ...]]] = {
    "insert": ("target", "key", "value"),
    "put": ("target", "key", "value"),
    "update": ("target", "key", "set"),
    "delete": ("target", "key"),
    "increment": ("target", "key", "field", "by"),
}
_OPTIONAL: Final[dict[str, tuple[str, ...]]] = {"increment": ("min", "max")}

_BUILTIN_LIST: Final = "insert, put, update, delete, increment"


def is_builtin(action: str) -> bool:
    """Whether ``action`` is one of the built-in actions (else it needs a custom handler)."""
    return action in BUILTIN_ACTIONS


def parse_action(
    action: str, args: Mapping[str, Any], allowed_targets: frozenset[str]
) -> BuiltinAction:
    """Check a built-in step and return it as a typed value.

    Raises :class:`BusinessRejection` (never anything else, whatever ``action``
    and ``args`` hold) when the action is not built in, an argument is missing,
    unexpected or of the wrong type, the target is not in ``allowed_targets``,
    or a name is not an :data:`IDENTIFIER`.
    """
    if not isinstance(action, str) or action not in BUILTIN_ACTIONS:
        raise BusinessRejection(
            f"unknown action {_show(action)} (built-in actions: {_BUILTIN_LIST}; "
            "custom actions need a handler)"
        )
    if not isinstance(args, Mapping):
        raise BusinessRejection(
            f"the arguments of {action} must be an object, not {_type_name(args)}"
        )
    _check_names(action, args)
    target = _target(action, args["target"], allowed_targets)
    key = _key(action, args["key"])
    if action == "insert":
        return Insert(target, key, _fields(action, "value", args["value"]))
    if action == "put":
        return Put(target, key, _fields(action, "value", args["value"]))
    if action == "update":
        return Update(target, key, _fields(action, "set", args["set"]))
    if action == "delete":
        return Delete(target, key)
    field = _identifier(action, "field", args["field"])
    by = _number(action, "by", args["by"])
    low = _number(action, "min", args["min"]) if args.get("min") is not None else None
    high = _number(action, "max", args["max"]) if args.get("max") is not None else None
    if low is not None and high is not None and low > high:
        raise BusinessRejection(f"increment has min {low} greater than max {high}")
    return Increment(target, key, field, by, low, high)


# ---------------------------------------------------------------- checks


def _check_names(action: str, args: Mapping[Any, Any]) -> None:
    required = _REQUIRED[action]
    allowed = set(required) | set(_OPTIONAL.get(action, ()))
    missing = [name for name in required if name not in args]
    if missing:
        raise BusinessRejection(
            f"{action} is missing {_plural('argument', missing)} {_names(missing)} "
            f"(it takes {_signature(action)})"
        )
    extra = sorted((name for name in args if name not in allowed), key=repr)
    if extra:
        raise BusinessRejection(
            f"{action} got unexpected {_plural('argument', extra)} {_names(extra)} "
            f"(it takes {_signature(action)})"
        )


def _target(action: str, value: Any, allowed_targets: frozenset[str]) -> str:
    target = _identifier(action, "target", value)
    if target not in allowed_targets:
        allowed = ", ".join(sorted(allowed_targets)) or "empty"
        raise BusinessRejection(
            f"target {target!r} is not in this participant's allow-list ({allowed})"
        )
    return target


def _identifier(action: str, what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise BusinessRejection(f"{action} {what} must be a string, not {_type_name(value)}")
    if not IDENTIFIER.fullmatch(value):
        raise BusinessRejection(
            f"{action} {what} {_show(value)} is not a valid name (1-63 letters, digits "
            "or _, not starting with a digit)"
        )
    return value


def _key(action: str, value: Any) -> Key:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise BusinessRejection(
            f"{action} key must be a string or an integer, not {_type_name(value)}"
        )
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise BusinessRejection(f"{action} key {value} does not fit in 64 bits")
        return value
    if not value:
        raise BusinessRejection(f"{action} key must not be empty")
    if len(value) > MAX_KEY_LENGTH:
        raise BusinessRejection(
            f"{action} key is {len(value)} characters long (at most {MAX_KEY_LENGTH})"
        )
    if any(_is_control(ch) for ch in value):
        raise BusinessRejection(f"{action} key {_show(value)} contains a control character")
    return value


def _fields(action: str, what: str, value: Any) -> dict[str, Scalar]:
    if not isinstance(value, Mapping):
        raise BusinessRejection(
            f"{action} {what} must be an object of fields, not {_type_name(value)}"
        )
    if not value:
        raise BusinessRejection(f"{action} {what} must name at least one field")
    fields: dict[str, Scalar] = {}
    for name, item in value.items():
        field = _identifier(action, f"{what} field name", name)
        fields[field] = _scalar(action, f"{what} field {field!r}", item)
    return fields


def _scalar(action: str, what: str, value: Any) -> Scalar:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise BusinessRejection(f"{action} {what} is an integer that does not fit in 64 bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise BusinessRejection(f"{action} {what} must be a finite number, not {value}")
        return value
    if isinstance(value, str):
        # Every storage but PostgreSQL takes NUL; rejecting it everywhere keeps one vocabulary.
        if "\x00" in value:
            raise BusinessRejection(f"{action} {what} contains a NUL character")
        return value
    raise BusinessRejection(
        f"{action} {what} must be a JSON scalar (string, number, boolean or null), "
        f"not {_type_name(value)}"
    )


def _number(action: str, what: str, value: Any) -> Number:
    # bool is an int subclass in Python, but ``by: true`` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BusinessRejection(f"{action} {what} must be a number, not {_type_name(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BusinessRejection(f"{action} {what} must be a finite number, not {value}")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise BusinessRejection(f"{action} {what} {value} does not fit in 64 bits")
    return value


# ---------------------------------------------------------------- wording


def _is_control(ch: str) -> bool:
    code = ord(ch)
    return code < 0x20 or 0x7F <= code <= 0x9F


def _show(value: Any, limit: int = 60) -> str:
    """``repr`` of a caller's value, cut short so a huge argument cannot flood a reason."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(value: Any) -> str:
    names = {
        type(None): "null",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        tuple: "a list",
        dict: "an object",
    }
    return names.get(type(value), type(value).__name__)


def _names(names: list[Any]) -> str:
    return ", ".join(_show(n) for n in names)


def _plural(word: str, items: list[Any]) -> str:
    return word if len(items) == 1 else word + "s"


def _signature(action: str) -> str:
    optional = [f"{name}?" for name in _OPTIONAL.get(action, ())]
    return ", ".join([*_REQUIRED[action], *optional])


class RecordOps(Protocol):
    """What a storage does to one record for each built-in action, at each isolation level.

    **``none``** writes at once. Each forward operation returns the before-image its
    compensation restores. Before a compensation, :meth:`guard` checks (in the same
    local unit, the record locked or compared-and-set) that it would not overwrite
    anyone else's work, and raises :class:`BusinessRejection` naming the record when it
    would: the step then ends ``compensation_failed`` instead of a silent overwrite.

    **``read_committed``** changes the business record only at commit. :meth:`hold`
    checks the action's precondition (``insert``: absent; ``update``/``delete``:
    present) and records that ``scope``'s saga holds the record, with the intended
    value beside it (not in it); :meth:`reserve` is escrow for ``increment``: the
    bound check counts the committed value plus every open reservation on the field in
    the direction that could break the bound, and records this one. Another saga's
    hold on the record makes either raise :class:`BusinessRejection` naming the
    holder (so do open reservations of other sagas for :meth:`hold`); reservations
    never conflict with each other. :meth:`commit` writes what was held or reserved
    and drops it; :meth:`release` drops it. Neither can fail nor break a bound, and
    both are idempotent. Holds and reservations live in the store and change in the
    same local unit as the ledger.

    Every bounded increment (either level) records its bounds on the field, so a
    later ``none`` compensation that would leave the value outside a bound a
    committed step relied on is refused by :meth:`guard`.
    """

    def insert(self, fields: Mapping[str, Any]) -> Any: ...
    def put(self, fields: Mapping[str, Any]) -> Any: ...
    def update(self, fields: Mapping[str, Any]) -> Any: ...
    def delete(self) -> Any: ...
    def increment(self, action: Increment) -> Any: ...
    def guard(self, action: BuiltinAction, before: Any) -> None: ...
    def remove(self) -> None: ...
    def restore_put(self, before: Any) -> None: ...
    def restore_fields(self, before: Any) -> None: ...
    def reinsert(self, before: Any) -> None: ...
    def increment_back(self, action: Increment, before: Any) -> None: ...
    def hold(self, scope: StepScope, action: Insert | Put | Update | Delete) -> None: ...
    def reserve(self, scope: StepScope, action: Increment) -> None: ...
    def commit(self, scope: StepScope, action: BuiltinAction) -> None: ...
    def release(self, scope: StepScope, action: BuiltinAction) -> None: ...


READ_COMMITTED_BEFORE: Final[dict[str, Any]] = {ISOLATION_KEY: str(Isolation.READ_COMMITTED)}
"""The before-image of a built-in step applied under ``read_committed``: nothing to
restore (the record did not change), only the level, so its decision is acted on
at that level."""


class BuiltinActions(Actions[NativeT]):
    """The built-in actions of one storage: validation and dispatch shared by every adapter.

    An adapter says how to reach a record in its native session (:meth:`record`); the
    returned :class:`RecordOps` does what each level asks. Unscoped (``scope`` is
    ``None``) the actions run at level ``none``; :meth:`scoped` gives the view for one
    step.
    """

    scope: StepScope | None = None

    def __init__(self, targets: Iterable[str]) -> None:
        self.targets = frozenset(targets)

    @abstractmethod
    def record(self, native: NativeT, action: BuiltinAction) -> RecordOps:
        """The record ``action`` addresses, in the storage ``native`` belongs to."""

    def scoped(self, scope: StepScope) -> BuiltinActions[NativeT]:
        view = copy.copy(self)
        view.scope = scope
        return view

    def _held_scope(self) -> StepScope | None:
        scope = self.scope
        return scope if scope is not None and scope.isolation is Isolation.READ_COMMITTED else None

    def apply(self, native: NativeT, action: str, args: Mapping[str, Any]) -> Any:
        parsed = parse_action(action, args, self.targets)
        record = self.record(native, parsed)
        held = self._held_scope()
        if held is not None:
            if isinstance(parsed, Increment):
                record.reserve(held, parsed)
            else:
                record.hold(held, parsed)
            return dict(READ_COMMITTED_BEFORE)
        if isinstance(parsed, Insert):
            return record.insert(parsed.value)
        if isinstance(parsed, Put):
            return record.put(parsed.value)
        if isinstance(parsed, Update):
            return record.update(parsed.set)
        if isinstance(parsed, Delete):
            return record.delete()
        return record.increment(parsed)

    def compensate(
        self, native: NativeT, action: str, args: Mapping[str, Any], before: Any
    ) -> None:
        parsed = parse_action(action, args, self.targets)
        record = self.record(native, parsed)
        if isolation_of(before) is Isolation.READ_COMMITTED:
            scope = self.scope
            assert scope is not None, "a read_committed step is compensated in its scope"
            record.release(scope, parsed)
            return
        record.guard(parsed, before)
        if isinstance(parsed, Insert):
            record.remove()
        elif isinstance(parsed, Put):
            record.restore_put(before)
        elif isinstance(parsed, Update):
            record.restore_fields(before)
        elif isinstance(parsed, Delete):
            record.reinsert(before)
        else:
            record.increment_back(parsed, before)

    def confirm(self, native: NativeT, action: str, args: Mapping[str, Any]) -> None:
        """Under ``read_committed``, write what the step held or reserved; else nothing."""
        held = self._held_scope()
        if held is None:
            return
        parsed = parse_action(action, args, self.targets)
        self.record(native, parsed).commit(held, parsed)

    def has_confirm(self, action: str) -> bool:
        """Under ``read_committed`` a commit writes the record (the step is confirmed and
        reported ``committed``); under ``none`` a commit leaves the step as it is."""
        return self._held_scope() is not None

    def confirms_any(self) -> bool:
        """True: any saga may run at ``read_committed``, whose commits write."""
        return True


def check_identifier(name: Any, what: str) -> None:
    """Raise :class:`~streams.ConfigurationError` unless ``name`` is an :data:`IDENTIFIER`
    (a target, ledger or schema name of a storage's configuration; ``what`` says which)."""
    if not isinstance(name, str) or not IDENTIFIER.fullmatch(name):
        raise ConfigurationError(
            f"{what} name {name!r} is not a plain name (1-63 letters, digits or _, "
            "not starting with a digit)"
        )
