"""Routing headers: what a reader may learn of a record without decoding its value.

Every transaction record the product writes carries a few small record headers
(bytes, not JSON) that say which participants must read it, so a participant can
pass over a record meant for others without parsing or validating the JSON body.
The JSON value stays the wire contract: the headers are optional, a record
without them (a foreign producer's) is decoded and handled exactly as before,
and a reader that ignores them loses nothing but speed.

=================  ===================  ==================================================
header             on                   value
=================  ===================  ==================================================
``saga.type``      requests topic       the record's ``type`` (``saga.request`` ...)
``saga.parts``     request              the participants of its steps, in step order,
                                        comma-separated (a name may repeat)
``saga.parts``     decision             the participants that must act on it (every
                                        participant with a step, for a rollback; those
                                        with a step to confirm, for a commit)
``saga.outcome``   decision             ``commit`` or ``rollback``
``saga.fp``        request              its fingerprint (32 hex digits)
``saga.deadline``  request              its ``deadline_ms``, in decimal digits
``saga.for``       step event           the participants that act on it, comma-separated;
                                        empty: none (the coordinator reads every event)
=================  ===================  ==================================================

The events and decisions topics hold one record type each, so their records carry
no ``saga.type``. Participant names and transaction ids never hold a comma (the schemas' patterns),
so a comma-separated list is unambiguous. A header is written only when its
producer knows its value for sure; absent, a reader decodes the record.

Trust: the headers are part of what a record's signature covers (see
:mod:`streams._signing`), so a signed record's headers are its signer's word. A
reader acts on a header only to *not read* the record that carries it, with one
exception: a request skipped by a participant without a step in it still leaves
that participant's *seen* marker (fingerprint and deadline from the headers), and
that is recorded only once the record's signature is checked, as a decoded
request would be. A forged record with lying headers can therefore make a
participant skip that record and nothing else (README, *Security*).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Final

from saga.streams._records import Decision, SagaAbort, SagaRequest, SagaResolve

__all__ = [
    "DEADLINE",
    "FINGERPRINT",
    "FOR",
    "OUTCOME",
    "PARTS",
    "TYPE",
    "Headers",
    "decision_headers",
    "event_headers",
    "header",
    "names",
    "request_headers",
    "seen_fields",
    "type_headers",
]

Headers = list[tuple[str, bytes]]

TYPE: Final = "saga.type"
PARTS: Final = "saga.parts"
OUTCOME: Final = "saga.outcome"
FINGERPRINT: Final = "saga.fp"
DEADLINE: Final = "saga.deadline"
FOR: Final = "saga.for"

_FINGERPRINT_BYTES: Final = re.compile(rb"[0-9a-f]{32}")
_DEADLINE_BYTES: Final = re.compile(rb"[0-9]{1,18}")  # below 2**63: a valid deadline_ms
_TX_ID_BYTES: Final = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def _joined(participants: Iterable[str]) -> bytes:
    return ",".join(participants).encode()


def request_headers(request: SagaRequest) -> Headers:
    """The routing headers of ``request``: type, participants, fingerprint, deadline."""
    return [
        (TYPE, SagaRequest.TYPE.encode()),
        (PARTS, _joined(s.participant for s in request.steps)),
        (FINGERPRINT, request.fingerprint().encode()),
        (DEADLINE, str(request.deadline_ms).encode()),
    ]


def type_headers(record: SagaAbort | SagaResolve) -> Headers:
    """The routing header of an abort or a resolve: its type (no participant acts on it)."""
    return [(TYPE, record.TYPE.encode())]


def decision_headers(decision: Decision, acting: Sequence[str] | None) -> Headers:
    """The routing headers of ``decision``; ``acting``: who must act on it (None: unknown)."""
    out = [(OUTCOME, str(decision.outcome).encode())]
    if acting is not None:
        out.append((PARTS, _joined(acting)))
    return out


def event_headers(readers: Sequence[str] | None) -> Headers:
    """The routing headers of a step event; ``readers``: who acts on it (None: unknown)."""
    return [] if readers is None else [(FOR, _joined(readers))]


def header(headers: Sequence[tuple[str, bytes]], name: str) -> bytes | None:
    """The value of the last header called ``name`` (as :meth:`Message.header`), or None."""
    found: bytes | None = None
    for key, value in headers:
        if key == name:
            found = value
    return found


def names(value: bytes) -> list[bytes]:
    """The names of a ``saga.parts`` or ``saga.for`` value (empty value: none)."""
    return value.split(b",") if value else []


def seen_fields(
    key: bytes | None, headers: Sequence[tuple[str, bytes]]
) -> tuple[str, str, int] | None:
    """``(tx_id, fingerprint, deadline_ms)`` of a request, from its key and headers.

    ``None`` when any of them is missing or malformed: the caller decodes the record.
    Whatever the bytes, nothing is raised.
    """
    fingerprint = header(headers, FINGERPRINT)
    deadline = header(headers, DEADLINE)
    if (
        key is None
        or fingerprint is None
        or deadline is None
        or _TX_ID_BYTES.fullmatch(key) is None
        or _FINGERPRINT_BYTES.fullmatch(fingerprint) is None
        or _DEADLINE_BYTES.fullmatch(deadline) is None
    ):
        return None
    return key.decode("ascii"), fingerprint.decode("ascii"), int(deadline)
