"""Routing headers on the real broker, written and read by real processes.

``bank`` and ``shop`` (SQL, one schema) and the coordinator run as processes. One
saga has steps for ``bank`` only, one for both. The records on Kafka carry the
routing headers the producers wrote (the client's request, the participants' step
events, the coordinator's decisions; a third saga is rejected, so its rollback
decision names both), and ``shop``, which skips the ``bank``-only
request undecoded, still leaves its seen marker (taken from the headers) in the ledger.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from saga.participants._ledger import SEEN_STEP
from saga.streams import SagaRequest, SagaState, Step, decode
from saga.streams._routing import DEADLINE, FINGERPRINT, FOR, OUTCOME, PARTS, TYPE, names
from tests._infra import Services
from tests._system import SagaSystem, bank_system, engine_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with bank_system(services, pg_schema, tmp_path, {"alice": 100, "bob": 50}) as s:
        yield s


def move(key: str, by: int) -> Step:
    return Step(
        "bank", "increment", {"target": "accounts", "key": key, "field": "balance", "by": by}
    )


def headers_by_tx(system: SagaSystem, topic: str) -> dict[str, list[dict[str, bytes]]]:
    out: dict[str, list[dict[str, bytes]]] = {}
    for m in system.read_messages(topic):
        out.setdefault((m.key or b"").decode(), []).append(dict(m.headers))
    return out


def test_records_carry_routing_headers_and_a_skipped_request_leaves_its_seen_marker(
    system: SagaSystem,
) -> None:
    system.coordinator()
    system.participant("bank", ["accounts"])
    system.participant("shop", ["orders"])
    order = Step("shop", "insert", {"target": "orders", "key": "o-1", "value": {"qty": 1}})
    with system.client() as client:
        only_bank = client.submit([move("alice", -10), move("bob", 10)], saga="t", timeout=60)
        both = client.submit([move("alice", -5), order], saga="t", timeout=60)
        overdraw = Step(
            "bank",
            "increment",
            {"target": "accounts", "key": "bob", "field": "balance", "by": -1000, "min": 0},
        )
        order_2 = Step("shop", "insert", {"target": "orders", "key": "o-2", "value": {"qty": 1}})
        rejected = client.submit([overdraw, order_2], saga="t", timeout=60)
        for tx in (only_bank, both):
            assert client.result(tx, timeout=90).state is SagaState.COMMITTED
        assert client.result(rejected, timeout=90).state is SagaState.ROLLED_BACK

    topics = system.settings.topics
    requests = {
        r.tx_id: r for r in system.read_topic(topics.requests) if isinstance(r, SagaRequest)
    }
    for tx, parts in ((only_bank, b"bank,bank"), (both, b"bank,shop")):
        (request,) = headers_by_tx(system, topics.requests)[tx]
        assert request[TYPE] == b"saga.request" and request[PARTS] == parts
        assert request[FINGERPRINT] == requests[tx].fingerprint().encode()
        assert request[DEADLINE] == str(requests[tx].deadline_ms).encode()
    decisions = headers_by_tx(system, topics.decisions)
    for tx in (only_bank, both):
        (decision,) = decisions[tx]
        # A commit names the participants with a step to confirm: none of the built-in
        # steps has one once the coordinator knows it (the commit path), else all.
        assert decision[OUTCOME] == b"commit" and PARTS in decision
        assert set(names(decision[PARTS])) <= {b"bank", b"shop"}
    (decision,) = decisions[rejected]
    assert decision[OUTCOME] == b"rollback" and decision[PARTS] == b"bank,shop"
    # Parallel sagas: no participant acts on another's event.
    events = headers_by_tx(system, topics.events)
    readers = [h[FOR] for tx in (only_bank, both, rejected) for h in events[tx]]
    assert len(readers) >= 5 and set(readers) == {b""}
    for m in system.read_messages(topics.events):
        decode(m.value)  # the bodies are the wire contract, unchanged

    engine = engine_for(system.services)
    try:
        with engine.connect() as conn:
            seen = conn.execute(
                sa.text(
                    f'SELECT fingerprint FROM "{system.schema}".saga_ledger '
                    "WHERE tx_id = :t AND participant = 'shop' AND step = :s"
                ),
                {"t": only_bank, "s": SEEN_STEP},
            ).scalar_one()
    finally:
        engine.dispose()
    assert seen == requests[only_bank].fingerprint()
