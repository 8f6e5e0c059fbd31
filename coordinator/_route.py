"""Who must read a record the coordinator writes: the values of its routing headers.

See :mod:`streams._routing`. A participant skips, undecoded, a decision that does not
name it and a step event whose ``saga.for`` does not name it, so these lists must
never leave out a participant that acts on the record; naming one too many only
costs that participant a decode.
"""

from __future__ import annotations

from saga.coordinator._machine import UNKNOWN_PARTICIPANT, Saga
from saga.streams import Decision, Outcome, StepEvent
from saga.streams._routing import Headers, decision_headers, event_headers


def decision_route(decision: Decision, saga: Saga | None) -> Headers:
    """The routing headers of ``decision`` of ``saga`` (its state after the decision).

    Every participant with a step acts on a rollback (compensation, or the marker that
    closes a step whose request comes late). On a commit only the participants of steps
    with something to confirm act (``Saga.confirm_of``: an ``applied`` event that said
    ``confirm`` is answered by a ``committed`` one), and a saga with none names nobody. When the
    request was not seen, the steps are not known: no list.
    """
    if saga is None or not saga.request_seen or UNKNOWN_PARTICIPANT in saga.participants:
        return decision_headers(decision, None)
    acting = saga.participants
    if decision.outcome is Outcome.COMMIT:
        acting = tuple(p for i, p in enumerate(acting) if saga.confirm_of(i))
    return decision_headers(decision, tuple(dict.fromkeys(acting)))


def event_route(event: StepEvent, saga: Saga | None) -> Headers:
    """The routing headers of a step event the coordinator writes on a participant's behalf.

    Those are ``compensated`` events of sequential sagas' unknown participants: the
    predecessor's participant compensates on it. Unknown steps: no list.
    """
    if saga is None or event.step >= len(saga.participants):
        return event_headers(None)
    if event.step == 0:
        return event_headers(())
    return event_headers((saga.participants[event.step - 1],))


def changed_saga(changed: dict[str, tuple[int, Saga]], tx_id: str) -> Saga | None:
    """The state of ``tx_id`` a batch of the service changed, if it did."""
    found = changed.get(tx_id)
    return None if found is None else found[1]
