"""Bad input never crashes a process, never blocks a partition and never loses a record.

Two kinds of bad input:

* *poison* — a record that breaks the wire contract (not JSON, not UTF-8, failing
  the schema, of the wrong type for its topic, keyed by another transaction, a
  tombstone). It is produced raw, since the client refuses to send such records.
  The coordinator, the one transactional writer of ``<prefix>.dlq``, moves it there
  exactly once, with headers naming the error and the record's source topic,
  partition and offset; the participants skip it; nothing else happens to it.
* *business-invalid* — a valid request whose step cannot be done: an unknown
  participant, an unknown action, a target outside the participant's allow-list,
  SQL injection attempts as table, field or key. The step ends ``failed`` with a
  reason a person can read (an unknown participant cannot report anything: the
  coordinator, told the participants that exist, rolls the saga back at once), the
  saga rolls back, and its other steps are compensated.

Good sagas are interleaved with the bad records and must all commit; the database
ends exactly as the good sagas alone would leave it.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import sqlalchemy as sa

from saga.coordinator import SagaClient
from saga.streams import (
    Decision,
    InvalidRecord,
    Outcome,
    SagaState,
    Step,
    StepEvent,
    StepStatus,
    encode,
)
from saga.streams.kafka import Message, Producer
from tests._infra import Services, eventually
from tests._system import SagaSystem, engine_for
from tests._workload import (
    Transfer,
    make_transfers,
    seed,
    wait_all_final,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# Each raw record we send, and what the reason in its dead letter must say.
REASONS = {
    "invalid JSON": "is not valid JSON",
    "no steps": "steps must contain at least 1 items",
    "bad tx_id": "tx_id must match pattern",
    "unknown field": "must not contain {'evil'} properties",
    "not UTF-8": "not valid UTF-8",
    "tombstone": "value is empty (a tombstone)",
    "key differs from tx_id": "record key 'someone-else' differs from its tx_id 'p-key'",
    "participant name with SQL": "participant must match pattern",
    "action name with a space": "action must match pattern",
    "a step event on the requests topic": (
        "expected saga.request, saga.abort or saga.resolve on this topic, got saga.step"
    ),
    "invalid JSON event": "is not valid JSON",
    "event with an unknown status": "status",
    "a request on the events topic": (
        "expected saga.step or saga.committed on this topic, got saga.request"
    ),
    "event keyed by another tx": "differs from its tx_id",
    "not UTF-8 decision": "not valid UTF-8",
    "decision with an unknown outcome": "outcome",
    "decision keyed by another tx": "differs from its tx_id",
    "a step event on the decisions topic": "expected saga.decision on this topic, got saga.step",
    "invalid JSON decision": "is not valid JSON",
}
DLQ_HEADERS = ("saga.error", "saga.source.topic", "saga.source.partition", "saga.source.offset")


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    _, schema = pg_schema
    s = SagaSystem(services, tmp_path, schema, partitions=4)
    seed(s)
    engine = engine_for(services)
    try:
        with engine.begin() as conn:
            # A table for injection attempts to aim at.
            conn.execute(sa.text(f'CREATE TABLE "{schema}".x (id text PRIMARY KEY)'))
            conn.execute(sa.text(f"INSERT INTO \"{schema}\".x VALUES ('keep me')"))
    finally:
        engine.dispose()
    with s.opened():
        yield s


def running(system: SagaSystem) -> SagaSystem:
    system.coordinator(participants=["bank", "shop"])
    system.participant("bank", ["accounts"])
    system.participant("shop", ["orders"])
    return system


# ---------------------------------------------------------------- helpers


@dataclass
class Sent:
    """A raw record we produced, and where it landed."""

    label: str
    topic: str
    key: bytes | None
    value: bytes | None
    expect: str  # what the DLQ's reason must say
    partition: int = -1
    offset: int = -1

    @property
    def source(self) -> tuple[str, int, int]:
        return (self.topic, self.partition, self.offset)


class RawSender:
    """Produces raw bytes and remembers each record's partition and offset."""

    def __init__(self, system: SagaSystem) -> None:
        self.producer: Producer = system.producer()
        self.sent: list[Sent] = []
        self._lock = threading.Lock()

    def send(self, label: str, topic: str, key: str | bytes | None, value: bytes | None) -> None:
        """Produce ``value`` raw; ``label`` names it and is a key of :data:`REASONS`."""
        keyed = key.encode() if isinstance(key, str) else key
        record = Sent(label, topic, keyed, value, REASONS[label])
        self.sent.append(record)

        def delivered(error: object, message: Message) -> None:
            assert error is None, f"{label}: {error}"
            with self._lock:
                record.partition, record.offset = message.partition, message.offset

        self.producer.produce(topic, key, value, on_delivery=delivered)
        self.producer.flush(30)
        assert record.offset >= 0, f"{label} was not delivered"


def snapshot(system: SagaSystem) -> dict[str, Any]:
    """Every business table of the schema, row by row (the ledger is not business data)."""
    engine = engine_for(system.services)
    try:
        with engine.connect() as conn:
            tables = sorted(
                r[0]
                for r in conn.execute(
                    sa.text(
                        "SELECT table_name FROM information_schema.tables WHERE table_schema = :s"
                    ),
                    {"s": system.schema},
                )
            )
            # The ledger is the participants' (created when they start), not business data.
            # The ledger and its holds (read_committed) are the product's, not business data.
            ours = {"saga_ledger", "saga_ledger_holds"}
            found: dict[str, Any] = {"tables": [t for t in tables if t not in ours]}
            for table in ("accounts", "orders", "x"):
                rows = conn.execute(sa.text(f'SELECT * FROM "{system.schema}".{table}'))
                found[table] = sorted(tuple(r) for r in rows)
            return found
    finally:
        engine.dispose()


def expected_after(before: dict[str, Any], good: list[Transfer]) -> dict[str, Any]:
    balances = dict(before["accounts"])
    for t in good:
        balances[t.src] -= t.amount
        balances[t.dst] += t.amount
    orders = sorted([*before["orders"], *((t.order, "transfer", t.amount) for t in good)])
    return {**before, "accounts": sorted(balances.items()), "orders": orders}


def request_dict(client: SagaClient, steps: list[Step], tx_id: str) -> dict[str, Any]:
    """A valid request as a JSON object, to be broken on purpose."""
    data: dict[str, Any] = orjson.loads(encode(client.build(steps, tx_id=tx_id, timeout=60)))
    return data


def debit(key: str = "acc0", amount: int = 5, **extra: Any) -> Step:
    args = {"target": "accounts", "key": key, "field": "balance", "by": -amount, **extra}
    return Step("bank", "increment", args)


def dead_letters(system: SagaSystem) -> dict[tuple[str, int, int], list[Message]]:
    """The DLQ's records by the source they name; each has the four headers."""
    found: dict[tuple[str, int, int], list[Message]] = defaultdict(list)
    for m in system.read_messages(system.settings.topics.dlq):
        headers = {name: m.header(name) for name in DLQ_HEADERS}
        assert all(v for v in headers.values()), m
        source = (
            (m.header("saga.source.topic") or b"").decode(),
            int(m.header("saga.source.partition") or b"-1"),
            int(m.header("saga.source.offset") or b"-1"),
        )
        found[source].append(m)
    return found


def check_dead_letters(system: SagaSystem, sent: list[Sent]) -> dict[str, str]:
    """Each raw record is in the DLQ exactly once, unchanged, with a readable reason, and
    nothing else is there; returns the reason per label."""
    wanted = {s.source for s in sent}

    def all_there() -> dict[tuple[str, int, int], list[Message]] | None:
        found = dead_letters(system)
        return found if wanted <= set(found) else None

    letters = eventually(
        all_there,
        timeout=60,
        interval=0.5,
        message="not every poison record reached the DLQ",
    )
    assert letters is not None
    reasons = {}
    for s in sent:
        got = letters[s.source]
        assert len(got) == 1, (s, got)
        assert (got[0].key, got[0].value) == (s.key, s.value), (s, got)
        reason = (got[0].header("saga.error") or b"").decode()
        # one sentence a person can read: words, one line, bounded, no traceback
        assert 10 <= len(reason) <= 500 and " " in reason and "\n" not in reason, reason
        assert "Traceback" not in reason, reason
        assert s.expect in reason, (s.label, reason)
        reasons[s.label] = reason
    assert sum(len(v) for v in letters.values()) == len(sent), letters
    return reasons


# ---------------------------------------------------------------- requests topic


def test_poison_and_invalid_requests(system: SagaSystem) -> None:
    running(system)
    requests = system.settings.topics.requests
    raw = RawSender(system)
    before = snapshot(system)
    good = make_transfers(14, tag="good", fail_every=0)
    good_iter = iter(good)

    with system.client() as client:

        def good_saga() -> None:
            t = next(good_iter)
            client.submit(t.steps(), saga="transfer", tx_id=t.tx_id, timeout=60)

        # ---- poison: the client refuses each of these, so they go out raw
        valid = request_dict(client, [debit()], "poison-base")

        good_saga()
        raw.send("invalid JSON", requests, "p-json", b'{"v": 1, "type": "saga.request", "tx_')
        good_saga()
        with pytest.raises(InvalidRecord):
            client.build([], tx_id="p-nosteps")
        raw.send(
            "no steps",
            requests,
            "p-nosteps",
            orjson.dumps({**valid, "tx_id": "p-nosteps", "steps": []}),
        )
        good_saga()
        with pytest.raises(InvalidRecord):
            client.build([debit()], tx_id="bad id; DROP TABLE x")
        raw.send(
            "bad tx_id",
            requests,
            "bad id; DROP TABLE x",
            orjson.dumps({**valid, "tx_id": "bad id; DROP TABLE x"}),
        )
        raw.send(
            "unknown field",
            requests,
            "p-field",
            orjson.dumps({**valid, "tx_id": "p-field", "evil": 1}),
        )
        good_saga()
        raw.send("not UTF-8", requests, "p-utf8", b"\xff\xfe\xfa\x00\x80 not text \xc3\x28")
        raw.send("tombstone", requests, "p-tomb", None)
        good_saga()
        # A valid request that moves money, keyed by another transaction: it must not
        # take effect anywhere (its partition is not its transaction's).
        raw.send(
            "key differs from tx_id",
            requests,
            "someone-else",
            orjson.dumps({**valid, "tx_id": "p-key"}),
        )
        good_saga()
        with pytest.raises(InvalidRecord):
            client.build([Step("bank; DROP TABLE accounts", "increment", {})], tx_id="p-part")
        bad_step = {"participant": "bank; DROP TABLE accounts", "action": "increment", "args": {}}
        raw.send(
            "participant name with SQL",
            requests,
            "p-part",
            orjson.dumps({**valid, "tx_id": "p-part", "steps": [bad_step]}),
        )
        with pytest.raises(InvalidRecord):
            client.build([Step("bank", "drop table", {})], tx_id="p-act")
        raw.send(
            "action name with a space",
            requests,
            "p-act",
            orjson.dumps(
                {
                    **valid,
                    "tx_id": "p-act",
                    "steps": [{"participant": "bank", "action": "drop table"}],
                }
            ),
        )
        step_event = StepEvent("p-type", 0, "bank", StepStatus.APPLIED, 1)
        raw.send("a step event on the requests topic", requests, "p-type", encode(step_event))
        good_saga()

        # ---- business-invalid: valid on the wire, refused by the participant (or the
        # coordinator); each saga debits acc0 first, which must be compensated.
        invalid: dict[str, tuple[list[Step], int, str]] = {
            "b-ghost": (
                [
                    debit(),
                    Step("ghost", "insert", {"target": "orders", "key": "g", "value": {"qty": 1}}),
                ],
                1,
                "unknown participant(s): ghost",
            ),
            "b-action": (
                [debit(), Step("shop", "transmogrify", {"target": "orders", "key": "t"})],
                1,
                "unknown action 'transmogrify'",
            ),
            "b-allow": (
                [
                    debit(),
                    Step("bank", "insert", {"target": "x", "key": "k", "value": {"id": "k"}}),
                ],
                1,
                "target 'x' is not in this participant's allow-list (accounts)",
            ),
            "b-target": (
                [
                    debit(),
                    Step(
                        "bank",
                        "increment",
                        {
                            "target": "accounts; DROP TABLE accounts",
                            "key": "acc1",
                            "field": "balance",
                            "by": 1,
                        },
                    ),
                ],
                1,
                "target 'accounts; DROP TABLE accounts' is not a valid name",
            ),
            "b-field": (
                [
                    debit(),
                    Step(
                        "bank",
                        "increment",
                        {"target": "accounts", "key": "acc1", "field": "balance = 0 --", "by": 1},
                    ),
                ],
                1,
                "field 'balance = 0 --' is not a valid name",
            ),
            "b-key": (
                [debit(), debit("'; DROP TABLE x; --", 1)],
                1,
                "accounts/'; DROP TABLE x; -- does not exist",
            ),
            "b-column": (
                [
                    debit(),
                    Step(
                        "shop",
                        "insert",
                        {
                            "target": "orders",
                            "key": "o-inj",
                            "value": {"item; DROP TABLE orders": 1},
                        },
                    ),
                ],
                1,
                "'item; DROP TABLE orders' is not a valid name",
            ),
        }
        for tx_id, (steps, _, _) in invalid.items():
            client.submit(steps, saga="invalid", tx_id=tx_id, timeout=60)
            good_saga()
        assert next(good_iter, None) is None  # every good saga was sent

        finals = wait_all_final(client, [*invalid, *(t.tx_id for t in good)], timeout=90)

    # Every good saga committed.
    for t in good:
        assert finals[t.tx_id].state is SagaState.COMMITTED, finals[t.tx_id]

    # Every business-invalid saga rolled back, for a reason a person can read; the step
    # that was refused reported `failed` with that reason; the debit was compensated.
    all_events = system.step_events()
    all_decisions = system.read_topic(system.settings.topics.decisions)
    for tx_id, (_, bad, phrase) in invalid.items():
        final = finals[tx_id]
        assert final.state is SagaState.ROLLED_BACK, final
        assert final.reason is not None and phrase in final.reason, (phrase, final.reason)
        assert [s.status for s in final.steps] == [StepStatus.COMPENSATED] * 2, final
        events = [e for e in all_events if e.tx_id == tx_id]
        if tx_id == "b-ghost":  # nobody can answer for a participant that does not exist
            assert final.reason.startswith(f"step {bad} names unknown participant"), final.reason
            assert not [e for e in events if e.step == bad], events
        else:
            assert final.reason.startswith(f"step {bad} failed: "), final.reason
            failed = [e for e in events if e.step == bad and e.status is StepStatus.FAILED]
            assert failed and all(e.reason and phrase in e.reason for e in failed), events
        decisions = [d for d in all_decisions if isinstance(d, Decision) and d.tx_id == tx_id]
        assert [d.outcome for d in decisions] == [Outcome.ROLLBACK], decisions

    # Each poison record is in the DLQ exactly once, unchanged, with its source and a
    # reason; nothing else is there (no valid record: I6).
    check_dead_letters(system, raw.sent)
    raw.producer.close()

    # No poison record reached a decision.
    decided = {d.tx_id for d in all_decisions if isinstance(d, Decision)}
    assert not decided & {"p-json", "p-nosteps", "p-field", "p-key", "p-part", "p-act", "p-type"}

    # The database is as the good sagas alone leave it: the bad ones changed nothing.
    assert snapshot(system) == expected_after(before, good)
    assert all(p.alive for p in system.procs), [(p.name, p.log()[-2000:]) for p in system.procs]


# ---------------------------------------------------------------- events and decisions topics


def test_poison_on_events_and_decisions_topics(system: SagaSystem) -> None:
    running(system)
    topics = system.settings.topics
    raw = RawSender(system)
    before = snapshot(system)
    good = make_transfers(6, tag="good", fail_every=0)

    with system.client() as client:
        for i, t in enumerate(good):
            client.submit(t.steps(), saga="transfer", tx_id=t.tx_id, timeout=60)
            if i == 0:
                raw.send("invalid JSON event", topics.events, "e-json", b"{not json")
                raw.send(
                    "event with an unknown status",
                    topics.events,
                    "e-status",
                    orjson.dumps(
                        {
                            "v": 1,
                            "type": "saga.step",
                            "tx_id": "e-status",
                            "step": 0,
                            "participant": "bank",
                            "status": "exploded",
                            "at_ms": 1,
                        }
                    ),
                )
            elif i == 1:
                request = client.build([debit()], tx_id="e-type", timeout=60)
                raw.send("a request on the events topic", topics.events, "e-type", encode(request))
                forged = StepEvent(good[0].tx_id, 0, "bank", StepStatus.FAILED, 1, "forged")
                raw.send("event keyed by another tx", topics.events, "someone-else", encode(forged))
            elif i == 2:
                raw.send("not UTF-8 decision", topics.decisions, "d-utf8", b"\x80\x81\x82\xff")
                raw.send(
                    "decision with an unknown outcome",
                    topics.decisions,
                    "d-maybe",
                    orjson.dumps(
                        {
                            "v": 1,
                            "type": "saga.decision",
                            "tx_id": "d-maybe",
                            "outcome": "maybe",
                            "reason": "x",
                            "at_ms": 1,
                        }
                    ),
                )
            elif i == 3:
                # A rollback for the last good saga, sent before its request and keyed by
                # another transaction: acted upon, it would close that saga's steps.
                forged_decision = Decision(good[-1].tx_id, Outcome.ROLLBACK, "forged", 1)
                raw.send(
                    "decision keyed by another tx",
                    topics.decisions,
                    "someone-else",
                    encode(forged_decision),
                )
                event = StepEvent("d-type", 0, "bank", StepStatus.APPLIED, 1)
                raw.send(
                    "a step event on the decisions topic", topics.decisions, "d-type", encode(event)
                )
                raw.send("invalid JSON decision", topics.decisions, "d-json", b'{"v": 1,')
        finals = wait_all_final(client, [t.tx_id for t in good], timeout=90)

    for t in good:
        assert finals[t.tx_id].state is SagaState.COMMITTED, finals[t.tx_id]
    check_dead_letters(system, raw.sent)
    raw.producer.close()
    assert snapshot(system) == expected_after(before, good)
    assert all(p.alive for p in system.procs), [(p.name, p.log()[-2000:]) for p in system.procs]
