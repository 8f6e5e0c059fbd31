"""The Redis adapter's batch path: runs of a batch's steps in one server-side script call.

Why: a step on the WATCH/MULTI/EXEC path (:mod:`participants.redis._unit`) costs three
round trips, and a participant on Redis spent most of its time waiting on them. Here a
run of consecutive steps of a batch goes to Redis as one ``EVALSHA`` of
:data:`participants.redis._script.SCRIPT` (redis-py's ``Script`` loads it once and
again when the server answers ``NOSCRIPT``), at most :data:`CHUNK` steps per call.

One barrier. The barrier stays :func:`participants._barrier.plan`, in Python
(:class:`participants.redis._plan.Planner`), and the script checks that the ledger is
what the plan assumed:

* a request is planned on a ledger that knows nothing of its transaction (no entry,
  no marker, no other fingerprint); the script checks that the transaction's hash does
  not exist, or holds only entries this same call wrote for the same request;
* a decision is planned on the transaction's hash as read, for the whole run in one
  pipelined round trip before the call (a rollback of a transaction with no step here
  gets the rollback marker, one with one step is compensated, released or closed as the
  barrier says; a commit of one ``read_committed`` step commits its reservation; more
  steps: per step); the script checks the hash still holds exactly those fields and texts
  (their count and SHA-1s). A commit that changes nothing here (steps at level ``none``)
  is answered from the hash as read, without a call.

When the check fails (a repeat, a marker, an older entry, a hash changed since it was
read, a record this path leaves to Python), the script stops there and returns what it
did so far: :class:`RedisBatch` runs that item on the per-step path (which reads the
ledger and asks the barrier with what it finds), then sends the rest.

What the script does per step, in batch order (a key touched by several steps sees the
earlier ones' effect), for ``increment`` of an integer field by an integer within signed
64 bits, with integer bounds: at level ``none`` it writes through ``HINCRBY`` (a result
outside ``[min, max]``, counting the open reservations of ``read_committed`` sagas, puts
the old text back and records that step ``failed``: it fails alone), and its
compensation subtracts ``by`` unless that crosses a bound recorded on the field
(``compensation_failed``); at ``read_committed`` it reserves (escrow: the record is
unchanged), and the decision commits or releases the reservation (see
:mod:`participants.redis._isolation` for the side hash). A record held by another saga
fails the step naming the holder; a missing record or field is a rejection too. A plan
without an effect writes its entry (deadline passed, waiting for a neighbour, a null
compensation, the rollback marker); then the ledger entry, and at the end the in-flight
set and finished sorted set of every transaction it wrote (see
:mod:`participants.redis._adapter`). Anything else (a decimal field, counter or ``by``,
float bounds, numbers past 15 digits where reservations are summed, a non-canonical or
non-numeric field text, a record key holding another type, ``HINCRBY`` overflowing 64
bits, a reservation on a record its own saga holds, the other built-in actions, custom
handlers, a neighbour's signal) runs on the per-step path, with today's number handling
and messages.

Atomicity: a script runs alone on the server, so each call is one atomic unit; the
before-image, the hold or reservation and the ledger entry are written by the same call
as the change. The
script checks the types of the in-flight and finished keys before its first write, and
of a step's keys before that step's first write, so no error stops it inside a step.
Clients on the per-step path WATCH what they read: a script that writes one of those
keys makes their ``EXEC`` fail and their step run again.

Hostile input: nothing from a record becomes script text. The script is a constant;
steps travel as ``KEYS``/``ARGV`` values, which Lua only compares, concatenates and
passes to Redis commands. JSON is built in Python (:func:`participants._ledger.entry_json`);
the script only splices in the old field text (``cjson.encode`` of a string) or the
rejection reason where Python left a marker (:data:`participants.redis._plan.SPLICE`).

Cluster: every key a call touches is passed in ``KEYS``; on Redis Cluster they must all
live on one node (one hash slot, e.g. a ``{tag}`` in the prefix), else the server
refuses the call with ``CROSSSLOT``. This adapter talks to one Redis node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, cast

import redis

from saga.participants._storage import DecisionArrived, Report, WorkItem
from saga.participants.redis._plan import SPLICE, Done, Planner, Prepared, _hash_flags
from saga.participants.redis._script import SCRIPT, WIDTH
from saga.participants.redis._session import strings
from saga.participants.redis._unit import TX_ID

CHUNK: Final = 500
"""Steps per script call: bounds one call's ``ARGV`` and how long it holds the server."""

_SPLICE: Final = SPLICE  # the tests' name for it

__all__ = ["CHUNK", "Done", "Planner", "Prepared", "RedisBatch", "_hash_flags"]


class RedisBatch:
    """Runs a batch's items in order: runs of :class:`Prepared` steps as script calls,
    the rest (and every step a call leaves) through ``slow``, the per-step path."""

    def __init__(self, client: redis.Redis, planner: Planner) -> None:
        self.client = client
        self.planner = planner
        self.script = client.register_script(SCRIPT)

    def run(
        self, items: Sequence[WorkItem], slow: Callable[[WorkItem], list[Report]]
    ) -> list[Report]:
        steps = self._plan(items)
        reports: list[Report] = []
        at = 0
        while at < len(steps):
            step = steps[at]
            if isinstance(step, Done):
                reports.extend(step.reports)
                at += 1
                continue
            if not isinstance(step, Prepared):
                reports.extend(slow(step))
                at += 1
                continue
            run: list[Prepared] = []
            for each in steps[at : at + CHUNK]:
                if not isinstance(each, Prepared):
                    break
                run.append(each)
            done = self._call(run)
            for each, (code, text) in zip(run, done, strict=False):
                reports.extend(_outcome(each, code, text))
            at += len(done)
            if len(done) < len(run):
                reports.extend(slow(run[len(done)].item))  # the script left it: per step
                at += 1
        return reports

    def _plan(self, items: Sequence[WorkItem]) -> list[Prepared | Done | WorkItem]:
        """Each item planned, or left as it is for the per-step path. Decisions are
        planned on their ledger hashes, read in one pipelined round trip."""
        decisions = sorted(
            {
                item.tx_id
                for item in items
                if isinstance(item, DecisionArrived)
                and isinstance(item.tx_id, str)
                and TX_ID.fullmatch(item.tx_id)
            }
        )
        read: dict[str, dict[str, str]] = {}
        if decisions:
            pipe = self.client.pipeline(transaction=False)
            for tx_id in decisions:
                pipe.hgetall(self.planner.keys.tx(tx_id))
            try:
                found = pipe.execute()
            except redis.exceptions.ResponseError:
                found = None  # a ledger key of another type: the per-step path says so
            if found is not None:
                read = {tx: strings(raw) for tx, raw in zip(decisions, found, strict=True)}
        steps: list[Prepared | Done | WorkItem] = []
        earlier: set[str] = set()
        for item in items:
            ready: Prepared | Done | None
            if isinstance(item, DecisionArrived):
                fields = read.get(item.tx_id)
                ready = None if fields is None else self.planner.decision(item, fields)
                if isinstance(ready, Done) and item.tx_id in earlier:
                    ready = None  # the hash was read before an earlier item of this batch
            else:
                ready = self.planner.request(item)
            earlier.add(item.tx_id)
            steps.append(item if ready is None else ready)
        return steps

    def _call(self, chunk: Sequence[Prepared]) -> list[tuple[str, str]]:
        keys = [self.planner.keys.in_flight, self.planner.keys.finished]
        args: list[str | int] = [len(chunk), WIDTH]
        for step in chunk:
            keys.extend(step.keys)
            args.extend(step.args)
        raw = cast(list[str], self.script(keys=keys, args=args))
        return list(zip(raw[::2], raw[1::2], strict=True))


def _outcome(step: Prepared, code: str, text: str) -> list[Report]:
    if code == "r":
        return [Report(step.tx_id, step.step, step.rejected, text)]
    return [] if step.emit is None else [step.emit]
