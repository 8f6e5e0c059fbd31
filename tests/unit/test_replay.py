"""Replay tests: recorded sagas fed through the pure cores must give what was recorded.

Each file in ``tests/fixtures/histories/`` holds the records of one transaction
as a real run wrote them to the log (requests, step events, decisions, status
records and dead letters, with their partition, offset, Kafka timestamp and
headers). Two replays run on it, with no services:

* **coordinator** -- the fixture's ``coordinator`` list gives the batches in
  which the coordinator handled the transaction's inputs: which records of the
  requests and events topics (in offset order per topic), the clock reading
  ``at_ms`` of the batch, whether a deadline tick followed, and which records
  the batch published. Each input goes through :func:`coordinator._machine.decide`;
  the decisions, the batch's last status record (the service publishes one per
  transaction per batch) and the dead letters of ignored requests must equal,
  field for field, the ones the run published.
* **barrier** -- for every participant that reported on the transaction, the
  fixture's ``participants`` lists its batches the same way: which records it
  consumed (requests, decisions, step events), at which clock reading, and which
  events it emitted. The records become work items as ``participants._runtime``
  makes them and go through :func:`participants._barrier.plan` against an
  in-memory ledger, as ``participants._storage.run_item`` drives it; the events
  that come out must be the ones the participant emitted. What the storage itself
  answers (the action succeeds, or it is a business rejection) is the recording's:
  a step whose first report is ``failed`` was rejected by its storage.

When a replay diverges the test fails with a unified diff of the recorded and
the replayed outputs, one line per output, so the first changed line shows where
the code now decides differently from the run that was recorded. A divergence
means either a behaviour change that breaks compatibility with logs written by
earlier versions (a restarted coordinator or participant would act differently
on them), or an intended change; in the second case record the fixtures again.

How to record a new fixture
---------------------------

With the local services up (``make infra-up``, then
``eval "$(infra/services.sh env)"``)::

    .venv/bin/python -m tests.fixtures.histories.record            # every scenario
    .venv/bin/python -m tests.fixtures.histories.record commit-parallel

``tests/fixtures/histories/record.py`` starts a real coordinator and real SQL
participants on fresh topics and a fresh PostgreSQL schema, runs the scenarios
listed in its ``SCENARIOS`` (add one there: a function that submits sagas with
the client and returns the transaction ids to keep), reads the five topics back,
derives the coordinator's input order from the published statuses and writes
one ``<scenario>.json`` per transaction. It replays each history with the
functions below before writing it and refuses to write one that does not replay.

Why not the chaos suite's ``history.jsonl``: it keeps one line per submission
(the transfer and the outcome the client saw), not the records of the topics,
and the suite deletes its topics when it ends; the recorder reads the topics
before they go.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from saga.coordinator._machine import (
    AbortRequested,
    Ignored,
    Input,
    RequestReceived,
    ResolveRequested,
    Saga,
    StepReported,
    Tick,
    decide,
)
from saga.participants._barrier import (
    Decided,
    Effect,
    LedgerEntry,
    LedgerStatus,
    PredecessorApplied,
    Requested,
    Signal,
    SuccessorCompensated,
    plan,
)
from saga.streams import (
    Decision,
    Mode,
    Outcome,
    Record,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    SagaStatus,
    StepEvent,
    StepStatus,
    decode_keyed,
    to_dict,
)

pytestmark = pytest.mark.unit

HISTORIES = Path(__file__).resolve().parent.parent / "fixtures" / "histories"

INJECTED_HEADER = "saga.fixture.injected"
"""Header on the records a recording scenario wrote by hand (duplicates, a conflicting
resubmission), as opposed to the client, the coordinator or a participant."""


# ---------------------------------------------------------------- reading a fixture


def fixture_paths() -> list[Path]:
    return sorted(HISTORIES.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def decoded(rec: Mapping[str, Any]) -> Record:
    """The record as a consumer of its topic reads it, through the real codec."""
    kinds: tuple[type[Record], ...] = {
        "requests": (SagaRequest, SagaAbort, SagaResolve),
        "events": (StepEvent,),
        "decisions": (Decision,),
        "status": (SagaStatus,),
    }[rec["topic"]]
    value = json.dumps(rec["value"], separators=(",", ":"), ensure_ascii=False).encode()
    return decode_keyed(rec["key"].encode(), value, *kinds)


def injected(rec: Mapping[str, Any]) -> bool:
    return INJECTED_HEADER in rec.get("headers", {})


def _line(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False)


def _diff(what: str, recorded: Sequence[str], replayed: Sequence[str]) -> str:
    return "\n".join(
        [
            f"{what}: the replay diverges from the recording",
            *difflib.unified_diff(
                list(recorded), list(replayed), "recorded", "replayed", lineterm="", n=2
            ),
        ]
    )


# ---------------------------------------------------------------- coordinator replay


def coordinator_input(fx: Mapping[str, Any], index: int, at_ms: int) -> Input:
    """The machine input the service makes of record ``index``, read at ``at_ms``."""
    rec = fx["records"][index]
    record = decoded(rec)
    known = fx.get("known_participants")
    if isinstance(record, SagaRequest):
        return RequestReceived(record, at_ms, frozenset(known) if known else None)
    if isinstance(record, SagaAbort):
        return AbortRequested(record)
    if isinstance(record, SagaResolve):
        return ResolveRequested(record)
    assert isinstance(record, StepEvent), f"not a coordinator input: {rec}"
    return StepReported(record, at_ms)


def run_batch(
    fx: Mapping[str, Any], saga: Saga | None, batch: Mapping[str, Any]
) -> tuple[Saga | None, list[str]]:
    """One coordinator batch, as ``coordinator._service`` runs it; (state, output lines).

    Every input of the batch is read at the batch's ``at_ms``; the deadline tick, if
    the batch had one, comes after them. What is published: the decisions, the
    *last* status of the batch (the service writes one per transaction per batch),
    and a dead letter for each request the machine ignored. Ignored step events
    are only logged by the service, so they are not compared.
    """
    at_ms = int(batch["at_ms"])
    inputs = [(coordinator_input(fx, i, at_ms), fx["records"][i]["topic"]) for i in batch["inputs"]]
    if batch.get("tick"):
        inputs.append((Tick(at_ms), "clock"))
    decisions: list[str] = []
    status: list[str] = []
    dead: list[str] = []
    for inp, topic in inputs:
        saga, outs = decide(saga, inp)
        for out in outs:
            if isinstance(out, Decision):
                decisions.append(f"  decisions: {_line(to_dict(out))}")
            elif isinstance(out, SagaStatus):
                status = [f"  status: {_line(to_dict(out))}"]
            elif isinstance(out, Ignored) and topic == "requests":
                dead.append(f"  dlq: {out.reason}")
    return saga, decisions + status + dead


def recorded_outputs(fx: Mapping[str, Any], outputs: Sequence[int]) -> list[str]:
    """The recorded outputs of a batch, in the order :func:`run_batch` lists them."""
    lines: dict[str, list[str]] = {"decisions": [], "status": [], "dlq": []}
    for i in outputs:
        rec = fx["records"][i]
        if rec["topic"] == "dlq":
            lines["dlq"].append(f"  dlq: {rec['headers'].get('saga.error', '')}")
        else:
            lines[rec["topic"]].append(f"  {rec['topic']}: {_line(to_dict(decoded(rec)))}")
    return lines["decisions"] + lines["status"] + lines["dlq"]


def _batch_head(fx: Mapping[str, Any], batch: Mapping[str, Any]) -> str:
    names = [
        f"{fx['records'][i]['topic']}@{fx['records'][i]['offset']} "
        f"{fx['records'][i]['value'].get('type')}"
        for i in batch["inputs"]
    ]
    if batch.get("tick"):
        names.append("deadline tick")
    return f"batch at {batch['at_ms']}: {', '.join(names)}"


def replay_coordinator(fx: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """Run the fixture's coordinator batches through ``decide``; (recorded, replayed) lines."""
    recorded: list[str] = []
    replayed: list[str] = []
    saga: Saga | None = None
    for batch in fx["coordinator"]:
        head = _batch_head(fx, batch)
        saga, lines = run_batch(fx, saga, batch)
        recorded += [head, *recorded_outputs(fx, batch["outputs"])]
        replayed += [head, *lines]
    return recorded, replayed


# ---------------------------------------------------------------- barrier replay


@dataclass
class ParticipantState:
    """What one participant keeps of the transaction: its ledger and the runtime's memory.

    The ledger side mirrors ``participants._storage.run_item`` (step entries, the
    rollback marker, the seen marker); the runtime side mirrors
    ``participants._runtime`` (which sagas are sequential, which neighbours were
    seen applied or compensated before their step's request).
    """

    name: str
    entries: dict[int, LedgerEntry] = field(default_factory=dict)
    rolled_back: bool = False
    seen: str | None = None  # fingerprint of the transaction-level seen marker
    sequential: bool = False
    applied_seen: set[int] = field(default_factory=set)
    compensated_seen: set[int] = field(default_factory=set)

    def known_fingerprint(self) -> str | None:
        for e in self.entries.values():
            if e.fingerprint is not None:
                return e.fingerprint
        return self.seen


Item = Signal | SagaRequest | Decision


def participant_items(state: ParticipantState, rec: Mapping[str, Any], now: int) -> list[Item]:
    """The work one consumed record makes for the participant (``_runtime._work_items``).

    A :class:`SagaRequest` stands for a request without a step here (the seen
    marker), a :class:`Decision` for the decision before the storage splits it
    into one signal per step it knows.
    """
    record = decoded(rec)
    if isinstance(record, SagaRequest):
        mine = [i for i, s in enumerate(record.steps) if s.participant == state.name]
        sequential = record.mode is Mode.SEQUENTIAL
        if sequential and mine:
            state.sequential = True
        items: list[Item] = [
            Requested(
                tx_id=record.tx_id,
                step=i,
                action=record.steps[i].action,
                args=record.steps[i].args,
                mode=record.mode,
                n_steps=len(record.steps),
                deadline_ms=record.deadline_ms,
                now_ms=now,
                predecessor_applied=i - 1 in state.applied_seen,
                successor_compensated=sequential and i + 1 in state.compensated_seen,
                fingerprint=record.fingerprint(),
            )
            for i in mine
        ]
        return items or [record]
    if isinstance(record, Decision):
        return [replace(record, at_ms=now)]
    if isinstance(record, StepEvent):
        if record.status is StepStatus.APPLIED:
            state.applied_seen.add(record.step)
            if state.sequential:
                return [PredecessorApplied(record.tx_id, record.step + 1, now)]
        elif record.status is StepStatus.COMPENSATED and record.step > 0:
            state.compensated_seen.add(record.step)
            if state.sequential:
                return [SuccessorCompensated(record.tx_id, record.step - 1, now)]
    return []


def _item_key(item: Item) -> tuple[object, ...]:
    # participants._storage.unique: exact repeats inside one batch are dropped
    return (
        type(item).__name__,
        getattr(item, "step", None),
        getattr(item, "outcome", None),
    )


def rejected_steps(fx: Mapping[str, Any], participant: str) -> dict[int, str | None]:
    """Steps the storage rejected (business rejection): their first report is ``failed``.

    The barrier decides *whether* to apply; whether the action succeeds is the
    storage's answer, which the recording holds.
    """
    first: dict[int, Mapping[str, Any]] = {}
    for r in emitted(fx, participant):
        first.setdefault(int(r["value"]["step"]), r["value"])
    return {s: v.get("reason") for s, v in first.items() if v["status"] == StepStatus.FAILED}


def confirmed_steps(fx: Mapping[str, Any], participant: str) -> set[int]:
    """Steps whose action has something to confirm: their ``applied`` event said so.

    Like a rejection, that is the storage's answer (its configured actions), which the
    recording holds; the barrier then decides what a commit does to the step.
    """
    return {
        int(r["value"]["step"])
        for r in emitted(fx, participant)
        if r["value"]["status"] == StepStatus.APPLIED and r["value"].get("confirm")
    }


def run_participant_batch(
    fx: Mapping[str, Any], state: ParticipantState, batch: Mapping[str, Any]
) -> list[str]:
    """One participant batch through ``plan``; the events it emits, one line each."""
    now = int(batch["at_ms"])
    rejected = rejected_steps(fx, state.name)
    confirms = confirmed_steps(fx, state.name)
    items: list[Item] = []
    keys: set[tuple[object, ...]] = set()
    for i in batch["inputs"]:
        for item in participant_items(state, fx["records"][i], now):
            if _item_key(item) not in keys:
                keys.add(_item_key(item))
                items.append(item)
    lines: list[str] = []

    def run(signal: Signal) -> None:
        entry = state.entries.get(signal.step)
        rolled_back = isinstance(signal, Requested) and entry is None and state.rolled_back
        known = state.known_fingerprint() if isinstance(signal, Requested) else None
        p = plan(entry, rolled_back, signal, known)
        new, emit = p.entry, p.emit
        if p.effect is Effect.APPLY and signal.step in rejected:
            assert new is not None
            reason = rejected[signal.step]
            new = replace(new, status=LedgerStatus.FAILED, effect=False, reason=reason)
            emit = StepStatus.FAILED
        if new is not None:
            state.entries[signal.step] = new
        if emit is not None:
            lines.append(f"  step {signal.step}: {emit}")

    for item in items:
        if isinstance(item, SagaRequest):
            if state.known_fingerprint() is None and not state.entries:
                state.seen = item.fingerprint()
        elif isinstance(item, Decision):
            if not state.entries and item.outcome is Outcome.ROLLBACK:
                state.rolled_back = True
            for step in sorted(state.entries):
                run(Decided(item.tx_id, step, item.outcome, now, step in confirms))
        else:
            run(item)
    return lines


def emitted(fx: Mapping[str, Any], participant: str) -> list[Mapping[str, Any]]:
    """The events ``participant`` itself wrote, in log order."""
    return sorted(
        (
            r
            for r in fx["records"]
            if r["topic"] == "events"
            and r["value"]["participant"] == participant
            and not injected(r)
        ),
        key=lambda r: int(r["offset"]),
    )


def recorded_events(fx: Mapping[str, Any], emits: Sequence[int]) -> list[str]:
    return [
        f"  step {fx['records'][i]['value']['step']}: {fx['records'][i]['value']['status']}"
        for i in emits
    ]


def replay_participant(fx: Mapping[str, Any], participant: str) -> tuple[list[str], list[str]]:
    """Run the participant's recorded batches through ``plan``; (recorded, replayed) lines."""
    state = ParticipantState(participant)
    recorded: list[str] = []
    replayed: list[str] = []
    for batch in fx["participants"][participant]:
        records = [fx["records"][i] for i in batch["inputs"]]
        head = f"batch at {batch['at_ms']}: " + ", ".join(
            f"{r['topic']}@{r['offset']}" for r in records
        )
        recorded += [head, *recorded_events(fx, batch["emits"])]
        replayed += [head, *run_participant_batch(fx, state, batch)]
    return recorded, replayed


def reporting_participants(fx: Mapping[str, Any]) -> list[str]:
    return sorted(
        {
            r["value"]["participant"]
            for r in fx["records"]
            if r["topic"] == "events" and not injected(r)
        }
    )


# ---------------------------------------------------------------- the tests


PATHS = fixture_paths()


def test_there_are_recorded_histories() -> None:
    assert len(PATHS) >= 5, f"expected the recorded histories in {HISTORIES}"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_the_coordinator_decides_as_recorded(path: Path) -> None:
    fx = load(path)
    recorded, replayed = replay_coordinator(fx)
    assert replayed == recorded, _diff(f"{path.name}, coordinator", recorded, replayed)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_each_participant_reports_as_recorded(path: Path) -> None:
    fx = load(path)
    participants = reporting_participants(fx)
    assert participants, f"{path.name}: no participant reported"
    for name in participants:
        recorded, replayed = replay_participant(fx, name)
        assert replayed == recorded, _diff(f"{path.name}, participant {name}", recorded, replayed)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_the_history_is_complete(path: Path) -> None:
    """Every coordinator input and output of the log is accounted for once, in log order."""
    fx = load(path)
    records = fx["records"]
    used_inputs = [i for e in fx["coordinator"] for i in e["inputs"]]
    used_outputs = [i for e in fx["coordinator"] for i in e.get("outputs", [])]
    inputs = [i for i, r in enumerate(records) if r["topic"] in ("requests", "events")]
    outputs = [
        i
        for i, r in enumerate(records)
        if r["topic"] in ("decisions", "status", "dlq") and not injected(r)
    ]
    assert sorted(used_inputs) == inputs
    assert sorted(used_outputs) == outputs
    for topic in ("requests", "events"):
        offsets = [records[i]["offset"] for i in used_inputs if records[i]["topic"] == topic]
        assert offsets == sorted(offsets), f"{topic} must be read in offset order"
    offsets = [records[i]["offset"] for i in used_outputs if records[i]["topic"] == "status"]
    assert offsets == sorted(offsets), "status records must be published in offset order"


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.stem)
def test_each_participant_history_is_complete(path: Path) -> None:
    """Every event a participant emitted is in one of its batches, after what caused it."""
    fx = load(path)
    records = fx["records"]
    assert sorted(fx["participants"]) == reporting_participants(fx)
    for name, batches in fx["participants"].items():
        emits = [i for b in batches for i in b["emits"]]
        assert [records[i] for i in emits] == emitted(fx, name)
        for b in batches:
            assert all(records[i]["timestamp_ms"] <= b["at_ms"] for i in b["inputs"])
            assert all(records[i]["value"]["at_ms"] == b["at_ms"] for i in b["emits"])
        for topic in ("requests", "events", "decisions"):
            offsets = [
                records[i]["offset"]
                for b in batches
                for i in b["inputs"]
                if records[i]["topic"] == topic
            ]
            assert offsets == sorted(offsets), f"{name} reads {topic} in offset order"


def test_a_divergence_reads_as_a_diff() -> None:
    """The failure message points at the output that changed, not at the whole history."""
    path = PATHS[0]
    fx = load(path)
    recorded, _ = replay_coordinator(fx)
    entry = next(e for e in fx["coordinator"] if e.get("outputs"))
    out = fx["records"][entry["outputs"][-1]]
    tampered = {**out, "value": {**out["value"], "reason": "tampered"}}
    fx2 = {**fx, "records": [tampered if r is out else r for r in fx["records"]]}
    recorded2, replayed2 = replay_coordinator(fx2)
    assert recorded2 != replayed2
    message = _diff(path.name, recorded2, replayed2)
    assert "-  status:" in message or "-  decisions:" in message, message
    assert '"tampered"' in message
    assert len([ln for ln in message.splitlines() if ln.startswith(("-", "+"))]) <= 4
    assert recorded == replayed2
