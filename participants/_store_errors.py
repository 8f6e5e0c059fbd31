"""Actions whose driver errors are judged where the step is known.

See :mod:`participants._refusals`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from typing_extensions import TypeVar

from saga.participants._refusals import StoreRefused, step_name
from saga.participants._storage import Actions, StepScope
from saga.streams import BusinessRejection

NativeT = TypeVar("NativeT", default=Any)

Classify = Callable[[BaseException, str], StoreRefused | None]
"""An adapter's judgement of an error raised by an action doing ``what``: the step's
refusal, or ``None`` (not the step's: it goes on to the storage's boundary)."""


class StoreErrors(Actions[NativeT]):
    """Runs ``inner`` (built-in and custom actions) and turns a driver error an action
    raises into the step's :class:`StoreRefused`, as ``classify`` judges it; anything it
    does not judge the step's propagates unchanged."""

    def __init__(self, inner: Actions[NativeT], classify: Classify) -> None:
        self.inner = inner
        self.classify = classify

    def apply(self, native: NativeT, action: str, args: Mapping[str, Any]) -> Any:
        with self._judged("", action, args):
            return self.inner.apply(native, action, args)

    def compensate(
        self, native: NativeT, action: str, args: Mapping[str, Any], before: Any
    ) -> None:
        with self._judged("the compensation of ", action, args):
            self.inner.compensate(native, action, args, before)

    def confirm(self, native: NativeT, action: str, args: Mapping[str, Any]) -> None:
        with self._judged("the commit of ", action, args):
            self.inner.confirm(native, action, args)

    def scoped(self, scope: StepScope) -> Actions[NativeT]:
        return StoreErrors(self.inner.scoped(scope), self.classify)

    def has_confirm(self, action: str) -> bool:
        return self.inner.has_confirm(action)

    def confirms_any(self) -> bool:
        return self.inner.confirms_any()

    @contextmanager
    def _judged(self, doing: str, action: str, args: Mapping[str, Any]) -> Iterator[None]:
        try:
            yield
        except BusinessRejection:
            raise
        except Exception as exc:
            refused = self.classify(exc, doing + step_name(action, args))
            if refused is None:
                raise
            raise refused from exc
