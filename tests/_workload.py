"""The transfer workload of the crash, scale-out and bad-input tests, and its invariant checks.

``bank`` owns ``accounts`` (a few accounts with a starting balance) and ``shop``
owns ``orders``. A transfer saga moves ``amount`` from one account to another and
records an order named after the transaction::

    0 bank  increment accounts/src balance -amount (min 0)
    1 bank  increment accounts/dst balance +amount
    2 shop  insert    orders/o-<tx_id> {item: "transfer", qty: amount}

Sagas designed to fail do so at the bank (the source account does not exist:
the credit is applied and must be compensated) or at the shop (the order already
exists: both bank steps were applied and must be compensated). They fail the
same way whatever runs concurrently. (An amount larger than the source's balance
would depend on the other sagas in flight, whose reservations count in the bound's
check; before isolation, another failing saga's credit, visible until it was
compensated, could cover it: the test suite found exactly that while it was being
written.) Some transfers run in sequential mode. Every saga runs at the default
isolation, ``read_committed``: its built-in steps hold or reserve at apply and write
on commit.

:func:`check_invariants` reads the stores and the log after the load and checks
docs/architecture.md §6 for it: every saga final, one decision per transaction that agrees
with its status, money conserved and every balance equal to its start plus the
committed transfers (a step applied twice or compensated twice would show
here), the orders exactly those of committed sagas, and one ledger row per step
whose status agrees with the outcome.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from saga.coordinator import SagaClient
from saga.streams import Decision, Outcome, SagaRequest, SagaState, SagaStatus, Step
from tests._infra import Services, eventually
from tests._system import SagaSystem, balances, bank_schema, engine_for

ACCOUNTS = ("acc0", "acc1", "acc2", "acc3", "acc4")
START_BALANCE = 1000
TOTAL = START_BALANCE * len(ACCOUNTS)
DUPLICATE_ORDER = "o-taken"
"""An order that exists from the start: inserting it again is a business rejection."""
MISSING_ACCOUNT = "acc-missing"
"""An account that never exists: debiting it is a business rejection."""


@dataclass(frozen=True)
class Transfer:
    tx_id: str
    src: str
    dst: str
    amount: int
    fails: str | None  # None, "bank" (step 0 rejected) or "shop" (step 2 rejected)
    mode: str = "parallel"

    @property
    def order(self) -> str:
        return DUPLICATE_ORDER if self.fails == "shop" else f"o-{self.tx_id}"

    def steps(self) -> list[Step]:
        return [
            Step(
                "bank",
                "increment",
                {
                    "target": "accounts",
                    "key": MISSING_ACCOUNT if self.fails == "bank" else self.src,
                    "field": "balance",
                    "by": -self.amount,
                    "min": 0,
                },
            ),
            Step(
                "bank",
                "increment",
                {"target": "accounts", "key": self.dst, "field": "balance", "by": self.amount},
            ),
            Step(
                "shop",
                "insert",
                {
                    "target": "orders",
                    "key": self.order,
                    "value": {"item": "transfer", "qty": self.amount},
                },
            ),
        ]


def seed(system: SagaSystem) -> None:
    """Create the tables in the system's schema and the starting rows."""
    engine = engine_for(system.services)
    try:
        bank_schema(engine, system.schema)
        with engine.begin() as conn:
            conn.execute(
                sa.text(f'INSERT INTO "{system.schema}".accounts VALUES (:i, :b)'),
                [{"i": a, "b": START_BALANCE} for a in ACCOUNTS],
            )
            conn.execute(
                sa.text(f"INSERT INTO \"{system.schema}\".orders VALUES (:i, 'seed', 1)"),
                {"i": DUPLICATE_ORDER},
            )
    finally:
        engine.dispose()


def make_transfers(
    n: int, *, tag: str, fail_every: int = 7, sequential_every: int = 0
) -> list[Transfer]:
    """``n`` transfers; every ``fail_every``-th fails, alternately at the bank and the
    shop; every ``sequential_every``-th (if not 0) runs in sequential mode."""
    rnd = random.Random(tag)
    out = []
    for i in range(n):
        src, dst = rnd.sample(ACCOUNTS, 2)
        fails: str | None = None
        if fail_every and i % fail_every == fail_every - 1:
            fails = "bank" if (i // fail_every) % 2 == 0 else "shop"
        sequential = sequential_every and i % sequential_every == sequential_every // 2
        mode = "sequential" if sequential else "parallel"
        out.append(Transfer(f"{tag}-{i:04d}", src, dst, rnd.randint(1, 20), fails, mode))
    return out


def submit_all(
    client: SagaClient, transfers: Iterable[Transfer], *, timeout: float = 120
) -> list[SagaRequest]:
    """Send every transfer (one flush at the end); returns the requests."""
    requests = []
    for t in transfers:
        request = client.build(
            t.steps(), saga="transfer", mode=t.mode, timeout=timeout, tx_id=t.tx_id
        )
        client.send(request, wait_delivery=False)
        requests.append(request)
    client.flush(30)
    return requests


def final_count(client: SagaClient, tx_ids: Iterable[str]) -> int:
    snap = client.statuses()
    return sum(1 for tx in tx_ids if (s := snap.get(tx)) is not None and s.state.final)


def wait_all_final(
    client: SagaClient, tx_ids: Iterable[str], timeout: float, what: str = "sagas"
) -> dict[str, SagaStatus]:
    """Wait until every transaction has a final status; returns them."""
    wanted = list(tx_ids)

    def done() -> dict[str, SagaStatus] | None:
        snap = client.statuses()
        found = {tx: snap[tx] for tx in wanted if tx in snap and snap[tx].state.final}
        return found if len(found) == len(wanted) else None

    def left() -> str:
        snap = client.statuses()
        stuck = [
            f"{tx}: {snap[tx].state.value if tx in snap else 'unseen'}"
            for tx in wanted
            if tx not in snap or not snap[tx].state.final
        ]
        return f"{len(stuck)} {what} not final, e.g. {stuck[:5]}"

    try:
        found = eventually(done, timeout=timeout, interval=0.25, message=f"not all {what} final")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {left()}") from None
    assert found is not None
    return found


# ---------------------------------------------------------------- reading the stores


def orders(system: SagaSystem) -> set[str]:
    engine = engine_for(system.services)
    try:
        with engine.connect() as conn:
            return {r[0] for r in conn.execute(sa.text(f'SELECT id FROM "{system.schema}".orders'))}
    finally:
        engine.dispose()


def ledger_rows(system: SagaSystem) -> list[tuple[str, str, int, str, bool]]:
    """``(participant, tx_id, step, status, effect)`` of every step entry (not markers)."""
    engine = engine_for(system.services)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    f"SELECT participant, tx_id, step, status, effect "
                    f'FROM "{system.schema}".saga_ledger WHERE step >= 0'
                )
            )
            return [(r[0], r[1], int(r[2]), r[3], bool(r[4])) for r in rows]
    finally:
        engine.dispose()


def decisions_by_tx(system: SagaSystem) -> dict[str, list[Decision]]:
    """The committed decision records per transaction (read_committed), not counting the
    copies a coordinator re-drives (header ``saga.replayed.by``, coordinator._chores)."""
    found: dict[str, list[Decision]] = defaultdict(list)
    for r in system.read_topic(system.settings.topics.decisions, unless="saga.replayed.by"):
        if isinstance(r, Decision):
            found[r.tx_id].append(r)
    return found


# ---------------------------------------------------------------- the invariants


def check_invariants(
    system: SagaSystem, transfers: list[Transfer], finals: dict[str, SagaStatus]
) -> Counter[str]:
    """Check the invariants (docs/architecture.md §6) of the transfer workload at quiescence.

    Returns the count per state.
    """
    states: Counter[str] = Counter(finals[t.tx_id].state.value for t in transfers)

    # I1: exactly one decision per transaction (transactions + read_committed), and it
    # agrees with the final state.
    decisions = decisions_by_tx(system)
    for t in transfers:
        got = decisions.get(t.tx_id, [])
        assert len({d.outcome for d in got}) == 1, f"{t.tx_id}: decisions {got}"
        assert len(got) == 1, f"{t.tx_id}: {len(got)} decision records {got}"
        outcome = (
            Outcome.COMMIT if finals[t.tx_id].state is SagaState.COMMITTED else Outcome.ROLLBACK
        )
        assert got[0].outcome is outcome, (t, got, finals[t.tx_id])

    # Designed failures roll back; nothing needs an operator.
    for t in transfers:
        final = finals[t.tx_id]
        assert final.state in (SagaState.COMMITTED, SagaState.ROLLED_BACK), final
        if t.fails is not None:
            assert final.state is SagaState.ROLLED_BACK, (t, final)
            assert final.reason is not None and "failed" in final.reason, final

    committed = [t for t in transfers if finals[t.tx_id].state is SagaState.COMMITTED]

    # I4 + I5: each step took effect once: balances are the start plus the committed
    # transfers exactly; money is conserved and never negative.
    expected = dict.fromkeys(ACCOUNTS, START_BALANCE)
    for t in committed:
        expected[t.src] -= t.amount
        expected[t.dst] += t.amount
    actual = balances(system)
    assert sum(actual.values()) == TOTAL, actual
    assert all(v >= 0 for v in actual.values()), actual
    assert actual == expected, {"actual": actual, "expected": expected}
    assert orders(system) == {DUPLICATE_ORDER} | {t.order for t in committed}

    # The ledgers agree with the log: one entry per step (the primary key allows no
    # more), committed with effect for committed sagas (built-in steps at read_committed
    # are confirmed: the commit writes what they held); compensated or failed otherwise.
    rows: dict[str, dict[int, tuple[str, str, bool]]] = defaultdict(dict)
    for participant, tx_id, step, status, effect in ledger_rows(system):
        assert step not in rows[tx_id], f"{tx_id} step {step} has two ledger entries"
        rows[tx_id][step] = (participant, status, effect)
    for t in transfers:
        entries = rows.get(t.tx_id, {})
        assert sorted(entries) == [0, 1, 2], f"{t.tx_id}: ledger steps {entries}"
        assert [entries[i][0] for i in range(3)] == ["bank", "bank", "shop"], entries
        if finals[t.tx_id].state is SagaState.COMMITTED:
            assert all(e[1:] == ("committed", True) for e in entries.values()), entries
        else:
            for _, status, effect in entries.values():
                assert status in ("compensated", "failed"), (t, entries)
                assert not (status == "failed" and effect), (t, entries)
            if t.fails == "shop":
                assert entries[2][1:] in (("failed", False), ("compensated", False)), entries
    return states


SESSION_TIMEOUT_MS = 6000  # the broker's group.min.session.timeout.ms


@contextmanager
def seeded_system(
    services: Services, schema: str, tmp: Path, partitions: int = 4
) -> Iterator[SagaSystem]:
    """A SagaSystem with the transfer tables seeded, 4 partitions (unless told) and a short
    session timeout (so a killed process's partitions move quickly); topics removed after."""
    s = SagaSystem(
        services,
        tmp,
        schema,
        partitions=partitions,
        extra_env={"SAGA_KAFKA_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS)},
    )
    seed(s)
    with s.opened():
        yield s
