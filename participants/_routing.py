"""What a participant learns from routing headers: records to skip, and its events' readers.

:mod:`streams._routing` defines the headers. Reading, a participant passes over,
before decoding anything:

* a request whose ``saga.parts`` does not name it: it needs only the transaction's
  *seen* marker (one payload per transaction, :mod:`participants._barrier`), made of
  the key and the ``saga.fp`` and ``saga.deadline`` headers, and, with keys, only
  once the record's signature is checked (:meth:`Router.seen`), as for a decoded
  request;
* an abort or a resolve (``saga.type``): the coordinator's business;
* a decision whose ``saga.parts`` does not name it: it has no step to confirm or to
  compensate, and no request of that transaction holds a step for it; and, with
  ``skip_commits``, every ``commit`` (``saga.outcome``): for a participant that has
  nothing to confirm, once a commit leaves unconfirmed steps untouched (the
  ``confirm`` flag of the step events; until then a commit confirms every step and
  must be read);
* a step event whose ``saga.for`` does not name it: parallel sagas' events, and
  sequential ones that are neither its predecessor's ``applied`` nor its
  successor's ``compensated``.

A record without the headers, or with a malformed one, is decoded as before.
Writing, a participant names in ``saga.for`` the participant that acts on its step
event, when it knows the saga's mode and steps from its request (remembered for the
latest ``limit`` transactions; after a restart an event may go without the header,
which only makes its readers decode it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

from saga.participants._storage import RequestSeen
from saga.streams import Mode, Outcome, SagaRequest, StepStatus, Topics
from saga.streams._routing import (
    FOR,
    OUTCOME,
    PARTS,
    TYPE,
    Headers,
    event_headers,
    names,
    seen_fields,
)
from saga.streams._signing import CLIENT, OPERATOR, Keyring
from saga.streams.kafka import Message, partition_for

_REQUEST_TYPE = SagaRequest.TYPE.encode()
_COMMIT = str(Outcome.COMMIT).encode()
_REQUESTERS = frozenset({CLIENT, OPERATOR})  # who may sign a request (allowed_signers)
DEFAULT_ROUTES_KEPT = 100_000


class Verdict(Enum):
    """What to do with a record, from its headers alone."""

    DECODE = "decode"
    SKIP = "skip"
    SEEN = "seen"  # a request without a step here: record the seen marker from the headers


@dataclass(frozen=True, slots=True)
class Seen:
    """The seen marker's fields of a request skipped undecoded."""

    tx_id: str
    fingerprint: str
    deadline_ms: int


class Router:
    """Routing headers, as participant ``name`` reads and writes them."""

    def __init__(
        self,
        name: str,
        topics: Topics,
        keys: Keyring | None = None,
        limit: int = DEFAULT_ROUTES_KEPT,
        *,
        skip_commits: bool = False,
    ) -> None:
        self._name = name.encode()
        self._keys = keys
        self._skip_commits = skip_commits
        self._topics = topics
        self._limit = max(1, limit)
        # tx_id -> (mode, the participants of its steps), for transactions with a step here
        self._routes: OrderedDict[str, tuple[Mode, tuple[str, ...]]] = OrderedDict()

    def screen(self, m: Message) -> Verdict | Seen:
        """:data:`Verdict.SKIP` for a record not meant for this participant, a :class:`Seen`
        for a request without a step here, else :data:`Verdict.DECODE`."""
        headers = m.headers
        if not headers:
            return Verdict.DECODE
        if m.topic == self._topics.events:
            readers = m.header(FOR)
            if readers is None or self._name in names(readers):
                return Verdict.DECODE
            return Verdict.SKIP
        if m.topic == self._topics.decisions:
            if self._skip_commits and m.header(OUTCOME) == _COMMIT:
                return Verdict.SKIP  # nothing here is ever confirmed
            acting = m.header(PARTS)
            if acting is None or self._name in names(acting):
                return Verdict.DECODE
            return Verdict.SKIP
        kind = m.header(TYPE)
        if kind is None:
            return Verdict.DECODE
        if kind != _REQUEST_TYPE:
            # An abort, a resolve (or a type this version does not know): read, never acted
            # on here. A record whose body is of another type than the header says is
            # still not acted on by this participant; the coordinator decodes it.
            return Verdict.SKIP
        parts = m.header(PARTS)
        if parts is None or self._name in names(parts):
            return Verdict.DECODE
        fields = seen_fields(m.key, headers)
        return Verdict.DECODE if fields is None else Seen(*fields)

    def seen(self, m: Message, seen: Seen, partitions: int, now: int) -> RequestSeen | str | None:
        """The seen marker of request ``m`` skipped undecoded, as a decoded one would leave it.

        ``None`` when the record is not on its key's partition (the coordinator moves it
        to the DLQ); with keys, the reason (one sentence) when it is not signed by a
        client or an operator: a forged request leaves no marker.
        """
        if partition_for(m.key or b"", partitions) != m.partition:
            return None
        if self._keys is not None:
            reason = self._keys.check(m.topic, m.key, m.value, m.headers, _REQUESTERS)
            if reason is not None:
                return f"request of {seen.tx_id}: {reason}"
        return RequestSeen(seen.tx_id, seen.fingerprint, seen.deadline_ms, now)

    def remember(self, request: SagaRequest) -> None:
        """Note the mode and steps of ``request`` (it has a step here) for its events."""
        self._routes[request.tx_id] = (request.mode, tuple(s.participant for s in request.steps))
        self._routes.move_to_end(request.tx_id)
        while len(self._routes) > self._limit:
            self._routes.popitem(last=False)

    def event_route(self, tx_id: str, step: int, status: StepStatus) -> Headers:
        """The routing headers of this participant's event of ``step`` of ``tx_id``.

        Only the predecessor's ``applied`` and the successor's ``compensated`` of a
        sequential saga are acted on by another participant (see the runtime's
        ``_neighbour``); every other event has no reader but the coordinator.
        """
        if status is not StepStatus.APPLIED and status is not StepStatus.COMPENSATED:
            return event_headers(())
        route = self._routes.get(tx_id)
        if route is None:
            return event_headers(None)  # not known here: let every reader decode it
        mode, owners = route
        if mode is Mode.PARALLEL:
            return event_headers(())
        neighbour = step + 1 if status is StepStatus.APPLIED else step - 1
        if 0 <= neighbour < len(owners):
            return event_headers((owners[neighbour],))
        return event_headers(())
