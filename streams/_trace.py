"""W3C trace context in record headers: one trace from the client through every process.

A saga's records carry the W3C ``traceparent`` header (and ``tracestate`` when the
trace has one), so a tracing backend shows one trace per saga: the client starts it
when it submits the request; each participant continues it on its step events (same
trace id, a span id of its own); the coordinator on its decisions and status records.

Header values come from the log, so they are hostile until parsed: :func:`parse`
accepts only a well-formed ``traceparent`` (version ``00`` exactly as specified,
lower-case hex, ids not all zeros; a later version's first 55 characters as the
specification allows) and a ``tracestate`` of printable ASCII within the length
limit; anything else is ignored, never raised. A record with several
``traceparent`` headers has none.

Spans are exported only with OpenTelemetry (see :mod:`streams._otel`); without it
the ids are generated here, so the context still flows and still links the
records of one saga in the logs.
"""

from __future__ import annotations

import os
import random
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Final

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"

# Ids must be unique, not secret: the specification asks for randomness, not for a
# cryptographic source, and ids are made for every record a service writes. A private
# generator, seeded from the OS (again in a forked child), so that an application
# seeding the global one for its own reasons does not make every run's ids the same.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)

_MAX_TRACESTATE = 512  # the specification's limit for what a vendor must propagate
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
# Printable ASCII only (the specification's list-members are a subset): no control
# characters, so a hostile tracestate cannot break a log line or another header.
_TRACESTATE = re.compile(r"[\x20-\x7e]*")
SAMPLED: Final = 0x01


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A position in a trace: ``trace_id`` (32 hex), ``span_id`` (16 hex), ``flags``.

    ``state`` is the vendor ``tracestate`` carried along unchanged (or ``None``).
    """

    trace_id: str
    span_id: str
    flags: int = SAMPLED
    state: str | None = None

    @property
    def traceparent(self) -> str:
        """The ``traceparent`` header value (version 00)."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def child(self) -> TraceContext:
        """The same trace, a new span id (for a record sent on behalf of this one)."""
        return replace(self, span_id=_new_id(8))

    def headers(self) -> list[tuple[str, bytes]]:
        """The record headers that carry this context."""
        out = [(TRACEPARENT, self.traceparent.encode("ascii"))]
        if self.state:
            out.append((TRACESTATE, self.state.encode("ascii")))
        return out


def _new_id(n_bytes: int) -> str:
    while True:
        value = _ids.getrandbits(8 * n_bytes)
        if value:  # all zeros is the specification's "invalid"
            return f"{value:0{2 * n_bytes}x}"


def new_trace(flags: int = SAMPLED) -> TraceContext:
    """A new trace with a random trace id and span id."""
    return TraceContext(_new_id(16), _new_id(8), flags)


def parse_traceparent(value: bytes | str | None) -> TraceContext | None:
    """The context in a ``traceparent`` value, or ``None`` when it is not well formed."""
    if value is None:
        return None
    if isinstance(value, bytes):
        if len(value) > 256:
            return None
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if len(value) < 55 or len(value) > 256:
        return None
    match = _TRACEPARENT.fullmatch(value[:55])
    if match is None:
        return None
    version, trace_id, span_id, flags = match.groups()
    if version == "ff":
        return None
    if version == "00" and len(value) != 55:
        return None
    if version != "00" and len(value) > 55 and value[55] != "-":
        return None
    if not trace_id.strip("0") or not span_id.strip("0"):
        return None
    return TraceContext(trace_id, span_id, int(flags, 16))


def _tracestate(value: bytes) -> str | None:
    if not value or len(value) > _MAX_TRACESTATE:
        return None
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if _TRACESTATE.fullmatch(text) and text.strip() else None


def parse(headers: Iterable[tuple[str, bytes]]) -> TraceContext | None:
    """The trace context in a record's headers, or ``None`` (absent or malformed).

    Never raises: header bytes come from anyone who can write to the topics.
    """
    parents: list[bytes] = []
    states: list[bytes] = []
    for name, value in headers:
        if name == TRACEPARENT:
            parents.append(value)
        elif name == TRACESTATE:
            states.append(value)
    if len(parents) != 1:
        return None
    context = parse_traceparent(parents[0])
    if context is None:
        return None
    if len(states) == 1 and (state := _tracestate(states[0])) is not None:
        context = replace(context, state=state)
    return context


class TraceMemory:
    """The latest trace context seen per transaction, the ``limit`` most recent kept.

    A service remembers the context of a transaction's request (or of the records
    it reads for it) to continue the trace on what it writes later; the bound keeps
    memory flat however many transactions pass.
    """

    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self._contexts: OrderedDict[str, TraceContext] = OrderedDict()

    def remember(self, tx_id: str, context: TraceContext, *, replace_known: bool = True) -> None:
        if not replace_known and tx_id in self._contexts:
            return
        self._contexts[tx_id] = context
        self._contexts.move_to_end(tx_id)
        while len(self._contexts) > self.limit:
            self._contexts.popitem(last=False)

    def get(self, tx_id: str) -> TraceContext | None:
        return self._contexts.get(tx_id)

    def forget(self, tx_id: str) -> None:
        self._contexts.pop(tx_id, None)

    def __len__(self) -> int:
        return len(self._contexts)


__all__ = [
    "SAMPLED",
    "TRACEPARENT",
    "TRACESTATE",
    "TraceContext",
    "TraceMemory",
    "new_trace",
    "parse",
    "parse_traceparent",
]
