"""Forged records on the real services, with signing on: every one is refused.

Issue "Trust: only the coordinator can decide, only a participant can speak for
itself". Each attack was found with a plain Kafka producer against a system
started the README's way; here it runs against real processes (``saga
coordinator run``, ``saga participant run``) with ``SAGA_KEYS_DIR`` set, a
``bank`` on PostgreSQL and a ``wallet`` on Redis. A transfer debits the bank
(``min 0``: more than the balance is a business rejection) and credits the
wallet, so a forgery that makes the wallet's credit stick without the bank's
debit shows in the stores.

A forged record is written raw, either unsigned or signed with a real key of a
principal that may not sign it (a participant's key for a decision, a status,
an abort or another participant's event). Each test checks that the record is
in the DLQ exactly once with a reason about its signature, that the stores hold
what the honest sagas alone leave, and that the saga it targeted ends as it
would have without it. A control runs ordinary sagas with signing on.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from saga.coordinator import SagaClient
from saga.coordinator._cli_client import exit_code_of
from saga.streams import (
    Decision,
    Outcome,
    SagaAbort,
    SagaState,
    SagaStatus,
    SagaTimeout,
    Step,
    StepEvent,
    StepProgress,
    StepStatus,
    encode,
)
from saga.streams._signing import HEADER_KEY_ID, HEADER_SIGNATURE, participant_principal
from saga.streams.kafka import Message, Producer
from tests._infra import Services, eventually
from tests._system import Proc, SagaSystem, engine_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PARTICIPANTS = ("bank", "wallet")
ACCOUNTS = ("alice", "bob", "carol")
OPENING = 100
TOO_MUCH = OPENING + 1  # more than any balance: the bank rejects the debit
FORGED = "forged"  # the reason of every forged decision and abort
SESSION_TIMEOUT_MS = 6000
TAKEOVER_S = SESSION_TIMEOUT_MS / 1000 + 90  # session expiry + rebalance + restore + slack
WALLET = participant_principal("wallet")
BANK = participant_principal("bank")

Snapshot = tuple[dict[str, int], dict[str, int]]


def now_ms() -> int:
    return int(time.time() * 1000)


def transfer(account: str, amount: int) -> list[Step]:
    """Debit ``amount`` at the bank (step 0), credit it to the wallet (step 1)."""
    return [
        Step(
            "bank",
            "increment",
            {"target": "accounts", "key": account, "field": "balance", "by": -amount, "min": 0},
        ),
        Step(
            "wallet",
            "increment",
            {"target": "wallets", "key": account, "field": "balance", "by": amount},
        ),
    ]


class Stores:
    """The bank's accounts (PostgreSQL) and the wallets (Redis), read directly."""

    def __init__(self, services: Services, schema: str) -> None:
        self.services = services
        self.schema = schema
        self.prefix = schema  # the Redis key prefix shares the test's token
        engine = engine_for(services)
        try:
            with engine.begin() as conn:
                conn.execute(
                    sa.text(
                        f'CREATE TABLE "{schema}".accounts (id text PRIMARY KEY, balance bigint)'
                    )
                )
                conn.execute(
                    sa.text(f'INSERT INTO "{schema}".accounts VALUES (:i, :b)'),
                    [{"i": a, "b": OPENING} for a in ACCOUNTS],
                )
        finally:
            engine.dispose()
        r = redis.Redis.from_url(services.redis_url)
        try:
            for a in ACCOUNTS:
                r.hset(f"{self.prefix}:wallets:{a}", "balance", 0)
        finally:
            r.close()

    def balances(self) -> dict[str, int]:
        engine = engine_for(self.services)
        try:
            with engine.connect() as conn:
                rows = conn.execute(sa.text(f'SELECT id, balance FROM "{self.schema}".accounts'))
                return {row[0]: int(row[1]) for row in rows}
        finally:
            engine.dispose()

    def wallets(self) -> dict[str, int]:
        r = redis.Redis.from_url(self.services.redis_url, decode_responses=True)
        try:
            return {a: int(r.hget(f"{self.prefix}:wallets:{a}", "balance") or 0) for a in ACCOUNTS}
        finally:
            r.close()

    def snapshot(self) -> Snapshot:
        return self.balances(), self.wallets()

    def cleanup(self) -> None:
        r = redis.Redis.from_url(self.services.redis_url)
        try:
            keys = list(r.scan_iter(match=f"{self.prefix}:*", count=500))
            if keys:
                r.delete(*keys)
        finally:
            r.close()


OPENING_STORES: Snapshot = ({a: OPENING for a in ACCOUNTS}, {a: 0 for a in ACCOUNTS})


def after(*transfers: tuple[str, int]) -> Snapshot:
    """The stores once the committed ``(account, amount)`` transfers took effect."""
    balances, wallets = dict(OPENING_STORES[0]), dict(OPENING_STORES[1])
    for account, amount in transfers:
        balances[account] -= amount
        wallets[account] += amount
    return balances, wallets


@dataclass
class Forged:
    """One record written by the forger, and where it landed."""

    label: str
    topic: str
    key: str
    value: bytes
    headers: list[tuple[str, bytes]]
    partition: int = -1
    offset: int = -1

    @property
    def source(self) -> tuple[str, int, int]:
        return (self.topic, self.partition, self.offset)


class Rig:
    """A signing system with a bank and a wallet, and a forger with a plain producer."""

    def __init__(self, system: SagaSystem, stores: Stores) -> None:
        self.system = system
        self.stores = stores
        self.topics = system.settings.topics
        self.producer = Producer(system.settings, client_id="forger")
        self.forged: list[Forged] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------ processes

    def bank(self) -> Proc:
        return self.system.start(
            f"participant-bank-{len(self.system.procs)}",
            [
                "participant", "run", "--name", "bank", "--storage", "sql",
                "--url", self.system.services.postgres_url, "--schema", self.stores.schema,
                "--targets", "accounts",
            ],
        )  # fmt: skip

    def wallet(self) -> Proc:
        return self.system.start(
            f"participant-wallet-{len(self.system.procs)}",
            [
                "participant", "run", "--name", "wallet", "--storage", "redis",
                "--url", self.system.services.redis_url, "--schema", self.stores.prefix,
                "--targets", "wallets",
            ],
        )  # fmt: skip

    # ------------------------------------------------------------ forging

    def forge(
        self,
        label: str,
        topic: str,
        tx_id: str,
        value: bytes,
        *,
        signer: str | None = None,
        claimed_kid: str | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> Forged:
        """Write ``value`` raw to ``topic``: unsigned, or signed with ``signer``'s real key
        (and, with ``claimed_kid``, presented under another principal's key id), or with
        ``headers`` as given."""
        headers = list(headers or ())
        if signer is not None:
            headers = self.system.keyring(signer).sign(topic, tx_id, value)
        if claimed_kid is not None:
            headers = [(n, claimed_kid.encode() if n == HEADER_KEY_ID else v) for n, v in headers]
        record = Forged(label, topic, tx_id, value, headers)

        def delivered(error: object, message: Message) -> None:
            assert error is None, f"{label}: {error}"
            with self._lock:
                record.partition, record.offset = message.partition, message.offset

        self.producer.produce(topic, tx_id, value, headers=headers or None, on_delivery=delivered)
        self.producer.flush(30)
        assert record.offset >= 0, f"{label} was not delivered"
        self.forged.append(record)
        return record

    def kid_of(self, principal: str) -> str:
        """A public key id of ``principal`` (public: the names of the .pub files)."""
        (path,) = self.system.keys_dir.glob(f"{principal}.*.pub")
        return path.name.removesuffix(".pub")

    # ------------------------------------------------------------ checks

    def dead_letters(self, records: list[Forged] | None = None) -> dict[str, str]:
        """Wait until each forged record (default: all so far) is in the DLQ; each exactly
        once, with its key and value as sent; returns label -> reason (``saga.error``)."""
        wanted = records if records is not None else self.forged

        def letters() -> dict[tuple[str, int, int], list[Message]] | None:
            found: dict[tuple[str, int, int], list[Message]] = {}
            for m in self.system.read_messages(self.topics.dlq):
                source = (
                    (m.header("saga.source.topic") or b"").decode(),
                    int(m.header("saga.source.partition") or b"-1"),
                    int(m.header("saga.source.offset") or b"-1"),
                )
                found.setdefault(source, []).append(m)
            return found if all(f.source in found for f in wanted) else None

        found = eventually(
            letters,
            timeout=60,
            interval=0.5,
            message=f"not every forged record is in the DLQ: {[f.label for f in wanted]}",
        )
        assert found is not None
        reasons: dict[str, str] = {}
        for f in wanted:
            copies = found[f.source]
            assert len(copies) == 1, (f.label, copies)
            (letter,) = copies
            assert (letter.key, letter.value) == (f.key.encode(), f.value), f.label
            reason = (letter.header("saga.error") or b"").decode()
            assert "sign" in reason, (f.label, reason)  # refused for its signature
            reasons[f.label] = reason
        return reasons

    def all_dead_letters(self) -> list[Message]:
        return self.system.read_messages(self.topics.dlq)

    def honest_decisions(self, tx_id: str) -> list[Outcome]:
        """The outcomes of the decisions on the topic for ``tx_id`` that were not forged."""
        return [d.outcome for d in self.system.decisions(tx_id) if d.reason != FORGED]

    def cli_status(self, tx_id: str) -> dict[str, Any]:
        """``saga status TX`` as an operator runs it, with SAGA_KEYS_DIR: the JSON printed."""
        done = subprocess.run(
            [sys.executable, "-m", "coordinator", "status", tx_id],
            env=self.system.env(),
            capture_output=True,
            timeout=120,
            check=False,
        )
        shown = (done.stdout + done.stderr).decode(errors="replace")
        printed: dict[str, Any] = json.loads(done.stdout)
        # The exit status follows the state (README "Command line": 3 rolled back, 4 pending).
        assert done.returncode == exit_code_of(SagaState(printed["state"])), shown
        return printed

    def all_alive(self, *stopped: Proc) -> None:
        """Every process is up but those the test ``stopped`` itself."""
        dead = [
            (p.name, p.log()[-3000:])
            for p in self.system.procs
            if not p.alive and all(p is not s for s in stopped)
        ]
        assert not dead, dead


@pytest.fixture
def rig(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[Rig]:
    _, schema = pg_schema
    stores = Stores(services, schema)
    system = SagaSystem(services, tmp_path, schema, signing=PARTICIPANTS)
    system.extra_env["SAGA_KAFKA_SESSION_TIMEOUT_MS"] = str(SESSION_TIMEOUT_MS)
    system.create_topics()
    r = Rig(system, stores)
    try:
        yield r
    finally:
        r.producer.close()
        system.stop_all()
        system.delete_topics()
        stores.cleanup()


def wait_wallet_applied(client: SagaClient, tx_id: str) -> SagaStatus:
    """The status of ``tx_id`` once the wallet's credit (step 1) is applied, undecided."""

    def applied() -> SagaStatus | None:
        s = client.status(tx_id)
        if s is not None and len(s.steps) == 2 and s.steps[1].status is StepStatus.APPLIED:
            return s
        return None

    status = eventually(applied, timeout=90, interval=0.2, message="the wallet did not apply")
    assert status is not None
    assert status.state is SagaState.PENDING, status
    return status


# ------------------------------------------------------------------ control


def test_with_signing_on_sagas_commit_roll_back_and_abort_as_usual(rig: Rig) -> None:
    """Honest records pass: a client abort, a commit, a rejection; every record on the
    topics carries the signature of the principal that may write it, and the DLQ is empty."""
    rig.system.coordinator()
    rig.wallet()
    with rig.system.client() as client:
        aborted = client.submit(transfer("bob", 5), saga="transfer", timeout=120)
        wait_wallet_applied(client, aborted)
        client.abort(aborted, "changed my mind")  # signed with the client's key
        eventually(
            lambda: (s := client.status(aborted)) is not None and s.state is SagaState.ROLLING_BACK,
            timeout=60,
            message="the client's abort was not honoured",
        )
        rig.bank()  # compensates its step, never applied
        final = client.result(aborted, timeout=90)
        assert final.state is SagaState.ROLLED_BACK, final
        assert final.reason is not None and "changed my mind" in final.reason
        committed = client.submit(transfer("alice", 30), saga="transfer", timeout=120)
        rejected = client.submit(transfer("carol", TOO_MUCH), saga="transfer", timeout=120)
        assert client.result(committed, timeout=90).state is SagaState.COMMITTED
        final = client.result(rejected, timeout=90)
        assert final.state is SagaState.ROLLED_BACK, final
        assert final.reason is not None and final.reason.startswith("step 0 failed"), final
    assert rig.stores.snapshot() == after(("alice", 30))
    assert rig.honest_decisions(committed) == [Outcome.COMMIT]
    assert rig.honest_decisions(rejected) == [Outcome.ROLLBACK]
    assert rig.honest_decisions(aborted) == [Outcome.ROLLBACK]

    expected = {
        rig.topics.requests: "client",
        rig.topics.decisions: "coordinator",
        rig.topics.status: "coordinator",
    }
    for topic, principal in expected.items():
        records = rig.system.read_messages(topic)
        assert records, topic
        for m in records:
            kid = (m.header(HEADER_KEY_ID) or b"").decode()
            assert kid.startswith(f"{principal}."), (topic, m.key, kid)
            assert m.header(HEADER_SIGNATURE) is not None, (topic, m.key)
    events = rig.system.read_messages(rig.topics.events)
    assert {m.key for m in events} >= {tx.encode() for tx in (aborted, committed, rejected)}
    for m in events:
        assert m.value is not None
        participant = json.loads(m.value)["participant"]
        kid = (m.header(HEADER_KEY_ID) or b"").decode()
        assert kid.startswith(f"{participant_principal(participant)}."), (m.key, kid)
    assert rig.all_dead_letters() == []
    rig.all_alive()


# ------------------------------------------------------------------ forged applied


def test_a_forged_applied_event_does_not_make_a_rejected_saga_commit(rig: Rig) -> None:
    """``bank applied`` for step 0, forged before the request whose bank debit is
    rejected: unsigned, signed with the wallet's key, and signed with the wallet's key
    under the bank's key id. The saga rolls back; the wallet's credit does not stay."""
    rig.system.coordinator()
    rig.bank()
    rig.wallet()
    with rig.system.client() as client:
        request = client.build(transfer("alice", TOO_MUCH), saga="transfer", timeout=120)
        tx = request.tx_id
        applied = encode(StepEvent(tx, 0, "bank", StepStatus.APPLIED, now_ms()))
        events = rig.topics.events
        rig.forge("unsigned applied", events, tx, applied)
        rig.forge("bank's applied signed by wallet", events, tx, applied, signer=WALLET)
        rig.forge(
            "bank's applied signed by wallet under bank's key id",
            events,
            tx,
            applied,
            signer=WALLET,
            claimed_kid=rig.kid_of(BANK),
        )
        # The forgeries are refused before the request is sent: no race decides the test.
        reasons = rig.dead_letters()
        client.send(request)
        final = client.result(tx, timeout=90)
    assert "not signed" in reasons["unsigned applied"], reasons
    assert WALLET in reasons["bank's applied signed by wallet"], reasons
    assert "not valid" in reasons["bank's applied signed by wallet under bank's key id"], reasons
    assert final.state is SagaState.ROLLED_BACK, final
    assert final.reason is not None and final.reason.startswith("step 0 failed"), final
    assert [s.status for s in final.steps] == [StepStatus.COMPENSATED, StepStatus.COMPENSATED]
    assert rig.honest_decisions(tx) == [Outcome.ROLLBACK]
    assert rig.stores.snapshot() == OPENING_STORES
    assert len(rig.all_dead_letters()) == 3
    rig.all_alive()


# ------------------------------------------------------------------ forged decision


def test_a_forged_commit_decision_is_not_obeyed(rig: Rig) -> None:
    """The wallet has applied its credit and the bank (not running yet) will reject its
    debit; ``commit`` decisions are forged, unsigned and signed with the wallet's key.
    The wallet does not commit, and the coordinator's rollback compensates the credit."""
    rig.system.coordinator()
    rig.wallet()
    with rig.system.client() as client:
        # A debit the bank will reject: the saga must roll back. At isolation none the
        # wallet's credit is in the store once applied, which a forged commit would keep.
        tx = client.submit(
            transfer("bob", TOO_MUCH), saga="transfer", timeout=120, isolation="none"
        )
        wait_wallet_applied(client, tx)
        assert rig.stores.wallets()["bob"] == TOO_MUCH  # the credit a commit would keep
        commit = encode(Decision(tx, Outcome.COMMIT, FORGED, now_ms()))
        decisions = rig.topics.decisions
        rig.forge("unsigned commit", decisions, tx, commit)
        rig.forge("commit signed by wallet", decisions, tx, commit, signer=WALLET)
        reasons = rig.dead_letters()
        # The wallet reads the decisions partition in order: the forgeries come before
        # the real decision, which only the bank's rejection can bring about.
        rig.bank()
        final = client.result(tx, timeout=90)
    assert "not signed" in reasons["unsigned commit"], reasons
    assert WALLET in reasons["commit signed by wallet"], reasons
    assert final.state is SagaState.ROLLED_BACK, final
    assert [s.status for s in final.steps] == [StepStatus.COMPENSATED, StepStatus.COMPENSATED]
    assert rig.honest_decisions(tx) == [Outcome.ROLLBACK]
    assert not any(
        e.participant == "wallet" and e.status is StepStatus.COMMITTED
        for e in rig.system.events(tx)
    )
    assert rig.stores.snapshot()[0]["bob"] == OPENING
    assert rig.stores.wallets()["bob"] == 0
    assert len(rig.all_dead_letters()) == 2
    rig.all_alive()


# ------------------------------------------------------------------ forged status


def forged_committed(real: SagaStatus) -> bytes:
    """``real`` as if every step had committed."""
    return encode(
        replace(
            real,
            state=SagaState.COMMITTED,
            steps=tuple(StepProgress(s.participant, StepStatus.COMMITTED) for s in real.steps),
            reason=None,
            updated_ms=now_ms(),
        )
    )


def test_a_forged_committed_status_is_believed_by_no_one(rig: Rig) -> None:
    """``committed`` status records are forged (unsigned, then signed with the wallet's
    key) for a saga that rolled back and for one still pending. The client library and
    ``saga status`` report the coordinator's state; a coordinator killed with -9 and
    started again restores its own status and rolls the pending saga back."""
    coordinator = rig.system.coordinator()
    bank = rig.bank()
    rig.wallet()
    with rig.system.client() as client:
        rolled_back = client.submit(transfer("alice", TOO_MUCH), saga="transfer", timeout=120)
        real_rolled_back = client.result(rolled_back, timeout=90)
        assert real_rolled_back.state is SagaState.ROLLED_BACK, real_rolled_back
        bank.kill(signal.SIGTERM)  # the pending saga's bank step must wait
        pending = client.submit(transfer("bob", TOO_MUCH), saga="transfer", timeout=240)
        real_pending = wait_wallet_applied(client, pending)
    status_topic = rig.topics.status
    for tx, real in ((rolled_back, real_rolled_back), (pending, real_pending)):
        value = forged_committed(real)
        rig.forge(f"unsigned committed status of {tx}", status_topic, tx, value)
        rig.forge(
            f"committed status of {tx} signed by wallet", status_topic, tx, value, signer=WALLET
        )

    # A client started after the forgeries reads them, the newest last: it believes neither.
    with rig.system.client() as client:
        assert client.wait_caught_up(60)
        assert client.result(rolled_back, timeout=10).state is SagaState.ROLLED_BACK
        seen = client.status(pending)
        assert seen is not None and seen.state is SagaState.PENDING, seen
        with pytest.raises(SagaTimeout):
            client.result(pending, timeout=2)
    assert rig.cli_status(rolled_back)["state"] == "rolled_back"
    assert rig.cli_status(pending)["state"] == "pending"

    # kill -9 and start again: the restore finds the real status on top.
    coordinator.kill()
    rig.system.coordinator()
    rig.bank()
    with rig.system.client() as client:
        final = client.result(pending, timeout=TAKEOVER_S)
        assert final.state is SagaState.ROLLED_BACK, final
        assert final.reason is not None and final.reason.startswith("step 0 failed"), final
        assert [s.status for s in final.steps] == [StepStatus.COMPENSATED] * 2
        again = client.status(rolled_back)
        assert again is not None and again.state is SagaState.ROLLED_BACK, again
    assert rig.honest_decisions(pending) == [Outcome.ROLLBACK]
    assert rig.honest_decisions(rolled_back) == [Outcome.ROLLBACK]
    assert all(d.reason != FORGED for d in rig.system.decisions(pending))
    assert rig.stores.snapshot() == OPENING_STORES
    assert rig.cli_status(rolled_back)["state"] == "rolled_back"
    assert rig.cli_status(pending)["state"] == "rolled_back"
    # The coordinator reads the status topic too: each forged status record is in the
    # DLQ once, with the reason, and the real status was published again on top of it.
    reasons = rig.dead_letters()
    assert all("sign" in reason for reason in reasons.values()), reasons
    assert len(rig.all_dead_letters()) == 4
    rig.all_alive(coordinator, bank)


# ------------------------------------------------------------------ stranger abort


def test_a_strangers_abort_or_rollback_blocks_no_saga(rig: Rig) -> None:
    """Aborts forged by a stranger (unsigned) and by a participant (the wallet's key)
    for a pending saga, and aborts and ``rollback`` decisions forged for a tx_id a client
    uses later: all go to the DLQ, and both sagas commit."""
    rig.system.coordinator()
    rig.wallet()
    later = f"later-{rig.system.prefix}"
    with rig.system.client() as client:
        pending = client.submit(transfer("alice", 10), saga="transfer", timeout=180)
        wait_wallet_applied(client, pending)
        requests, decisions = rig.topics.requests, rig.topics.decisions
        for tx in (pending, later):
            abort = encode(SagaAbort(tx, FORGED, now_ms()))
            rig.forge(f"unsigned abort of {tx}", requests, tx, abort)
            rig.forge(f"abort of {tx} signed by wallet", requests, tx, abort, signer=WALLET)
        rollback = encode(Decision(later, Outcome.ROLLBACK, FORGED, now_ms()))
        rig.forge("unsigned rollback of later", decisions, later, rollback)
        rig.forge("rollback of later signed by wallet", decisions, later, rollback, signer=WALLET)
        reasons = rig.dead_letters()
        assert client.status(later) is None  # the forgeries made no saga of it
        rig.bank()
        first = client.result(pending, timeout=90)
        client.submit(transfer("bob", 20), saga="transfer", timeout=120, tx_id=later)
        second = client.result(later, timeout=90)
    assert "not signed" in reasons[f"unsigned abort of {pending}"], reasons
    assert WALLET in reasons[f"abort of {later} signed by wallet"], reasons
    assert first.state is SagaState.COMMITTED, first
    assert second.state is SagaState.COMMITTED, second
    assert rig.honest_decisions(pending) == [Outcome.COMMIT]
    assert rig.honest_decisions(later) == [Outcome.COMMIT]
    assert rig.stores.snapshot() == after(("alice", 10), ("bob", 20))
    assert len(rig.all_dead_letters()) == len(rig.forged) == 6
    rig.all_alive()
