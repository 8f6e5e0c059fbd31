"""Custom actions: user handlers with ``try``, optional ``confirm``, and ``cancel``.

A handler module is named by a dotted path (``--handlers mycompany.saga_handlers``)
and exposes a mapping ``HANDLERS`` from action name to :class:`Handler`::

    from saga.participants import Handler, Reject

    def reserve(session, args):
        row = session.execute(...)            # the storage's native session/connection
        if row is None:
            raise Reject(f"seat {args['seat']} is taken")
        return {"seat": args["seat"]}          # kept in the ledger, handed to cancel

    def release(session, args, before):
        session.execute(...)

    HANDLERS = {"reserve_seat": Handler(try_=reserve, cancel=release)}

Every function runs inside the same local transaction as the step's ledger
record, with the storage's native session (an SQLAlchemy ``Connection``, a
pymongo ``ClientSession``-bound database, a Redis pipeline). ``try_`` returns
what ``cancel`` needs (JSON-serialisable) and raises :class:`Reject` for a
business rejection. Any other exception is a bug in the handler: the step's local
transaction is rolled back and the step fails with the exception as its reason
(the saga rolls back), and the participant goes on with its other work -- a record
that triggers the bug must not stop it for good.

A handler runs the same at every isolation level; it gets ``read_committed`` itself by
holding in ``try_``, writing in ``confirm`` and releasing in ``cancel``, naming the
holder by :func:`current_step` (the saga's ``tx_id`` and the step), as
``examples/isolated_handler.py`` shows.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from saga.participants._actions import is_builtin
from saga.participants._storage import Actions, NativeT, StepScope
from saga.streams import BusinessRejection, ConfigurationError

Reject = BusinessRejection
"""Raise ``Reject("why")`` in a handler's ``try_`` to fail the step (the saga rolls back)."""


_STEP: ContextVar[StepScope | None] = ContextVar("saga_handler_step", default=None)


def current_step() -> StepScope:
    """The step the running handler function acts for: its saga's ``tx_id``, the step's
    index, the saga's isolation level and deadline (a holder's name, for a handler that
    holds records until its saga's decision).

    Raises :class:`RuntimeError` outside a handler's ``try_``, ``confirm`` or ``cancel``.
    """
    scope = _STEP.get()
    if scope is None:
        raise RuntimeError(
            "current_step() is only known inside a handler's try_, confirm or cancel"
        )
    return scope


@contextmanager
def _running(scope: StepScope | None) -> Iterator[None]:
    token = _STEP.set(scope)
    try:
        yield
    finally:
        _STEP.reset(token)


@dataclass(frozen=True, slots=True)
class Handler:
    """One custom action: ``try_(native, args) -> before``, ``cancel(native, args, before)``,
    and optionally ``confirm(native, args)`` on commit."""

    try_: Callable[[Any, Mapping[str, Any]], Any]
    cancel: Callable[[Any, Mapping[str, Any], Any], None]
    confirm: Callable[[Any, Mapping[str, Any]], None] | None = None


def load_handlers(dotted: str) -> dict[str, Handler]:
    """Import ``dotted`` and return its ``HANDLERS`` mapping, checked."""
    try:
        module = importlib.import_module(dotted)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import handler module {dotted!r} ({exc}); "
            "check the dotted path and that the module is on PYTHONPATH"
        ) from exc
    handlers = getattr(module, "HANDLERS", None)
    if not isinstance(handlers, Mapping):
        raise ConfigurationError(
            f"handler module {dotted!r} has no HANDLERS mapping of action name to Handler"
        )
    checked: dict[str, Handler] = {}
    for name, handler in handlers.items():
        if not isinstance(name, str) or not isinstance(handler, Handler):
            raise ConfigurationError(
                f"HANDLERS in {dotted!r} must map action names to Handler objects; "
                f"{name!r} maps to {type(handler).__name__}"
            )
        checked[name] = handler
    return checked


class WithHandlers(Actions[NativeT]):
    """Custom handlers first, then the storage's built-in actions."""

    scope: StepScope | None = None

    def __init__(self, handlers: Mapping[str, Handler], builtin: Actions[NativeT]) -> None:
        self.handlers = dict(handlers)
        self.builtin = builtin

    def scoped(self, scope: StepScope) -> Actions[NativeT]:
        view = WithHandlers.__new__(WithHandlers)
        view.handlers = self.handlers
        view.builtin = self.builtin.scoped(scope)
        view.scope = scope
        return view

    def apply(self, native: NativeT, action: str, args: Mapping[str, Any]) -> Any:
        handler = self.handlers.get(action)
        if handler is None:
            return self.builtin.apply(native, action, args)
        with _running(self.scope):
            return handler.try_(native, args)

    def compensate(
        self, native: NativeT, action: str, args: Mapping[str, Any], before: Any
    ) -> None:
        handler = self.handlers.get(action)
        if handler is None:
            self.builtin.compensate(native, action, args, before)
        else:
            with _running(self.scope):
                handler.cancel(native, args, before)

    def confirm(self, native: NativeT, action: str, args: Mapping[str, Any]) -> None:
        handler = self.handlers.get(action)
        if handler is None:
            self.builtin.confirm(native, action, args)
        elif handler.confirm is not None:
            with _running(self.scope):
                handler.confirm(native, args)

    def has_confirm(self, action: str) -> bool:
        """A handler has something to confirm when it has a ``confirm`` function."""
        handler = self.handlers.get(action)
        if handler is None:
            return self.builtin.has_confirm(action)
        return handler.confirm is not None

    def confirms_any(self) -> bool:
        return self.builtin.confirms_any() or any(
            h.confirm is not None for h in self.handlers.values()
        )


class BuiltinsFirst(Actions[NativeT]):
    """Built-in action names run built in; every other name goes to ``custom``."""

    def __init__(self, builtin: Actions[NativeT], custom: Actions[Any]) -> None:
        self.builtin = builtin
        self.custom = custom

    def scoped(self, scope: StepScope) -> Actions[NativeT]:
        return BuiltinsFirst(self.builtin.scoped(scope), self.custom.scoped(scope))

    def _for(self, action: str) -> Actions[Any]:
        return self.builtin if is_builtin(action) else self.custom

    def apply(self, native: NativeT, action: str, args: Mapping[str, Any]) -> Any:
        return self._for(action).apply(native, action, args)

    def compensate(
        self, native: NativeT, action: str, args: Mapping[str, Any], before: Any
    ) -> None:
        self._for(action).compensate(native, action, args, before)

    def confirm(self, native: NativeT, action: str, args: Mapping[str, Any]) -> None:
        self._for(action).confirm(native, action, args)

    def has_confirm(self, action: str) -> bool:
        return self._for(action).has_confirm(action)

    def confirms_any(self) -> bool:
        return self.builtin.confirms_any() or self.custom.confirms_any()


def combine(
    builtin: Actions[NativeT], handlers: Actions[Any] | Mapping[str, Handler] | None
) -> Actions[NativeT]:
    """A storage's actions: its built-ins plus custom handlers, however they were given.

    A mapping of :class:`Handler` may also replace a built-in name; an
    :class:`Actions` object only receives the names that are not built in.
    """
    if handlers is None:
        return builtin
    if isinstance(handlers, Actions):
        return BuiltinsFirst(builtin, handlers)
    return WithHandlers(handlers, builtin)
