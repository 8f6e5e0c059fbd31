"""Forged records against batch signatures, on the real services: every one is refused.

The services sign what they write in batches (one Ed25519 signature over a hash
tree of a transaction's or a flush's records, each record carrying its place in
it, ``saga.proof``; see streams/_merkle.py). The attacks here are the ones that
form adds: a genuine batch signature and proof of the coordinator's moved onto a
forged decision, and a forged decision signed in a batch with a participant's
key (with its own key id, and under the coordinator's). Same rig as
``test_forgery.py``: a ``bank`` on PostgreSQL and a ``wallet`` on Redis.
"""

from __future__ import annotations

import signal

import pytest

from saga.streams import Decision, Outcome, SagaState, StepStatus, encode
from saga.streams._signing import HEADER_KEY_ID, HEADER_PROOF, HEADER_SIGNATURE
from saga.streams.kafka import Message
from tests.e2e.test_forgery import (
    FORGED,
    OPENING,
    TOO_MUCH,
    WALLET,
    Rig,
    now_ms,
    rig,
    transfer,
    wait_wallet_applied,
)

__all__ = ["rig"]  # the fixture, shared with test_forgery.py

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

_SIGNATURE_HEADERS = (HEADER_KEY_ID, HEADER_SIGNATURE, HEADER_PROOF)


def genuine_decision(rig: Rig, tx: str) -> Message:
    """The coordinator's decision record of ``tx``, as read from the topic."""
    found = [m for m in rig.system.read_messages(rig.topics.decisions) if m.key == tx.encode()]
    assert len(found) == 1, found
    return found[0]


def test_a_genuine_batch_signature_on_a_forged_decision_is_refused(rig: Rig) -> None:
    """A committed saga's decision, batch-signed by the coordinator, lends its headers
    (key id, batch signature, proof, routing) to a forged ``commit`` of a saga that must
    roll back; a wallet-signed batch forges the same commit, under the wallet's key id
    and under the coordinator's. The wallet does not commit; the saga rolls back."""
    rig.system.coordinator()
    bank = rig.bank()
    rig.wallet()
    with rig.system.client() as client:
        committed = client.submit(transfer("alice", 10), saga="transfer", timeout=120)
        assert client.result(committed, timeout=90).state is SagaState.COMMITTED
        genuine = genuine_decision(rig, committed)
        assert genuine.header(HEADER_PROOF) is not None  # signed in a batch
        bank.kill(signal.SIGTERM)  # the doomed saga's bank step must wait
        # At isolation none the wallet's credit is in the store once applied.
        doomed = client.submit(
            transfer("bob", TOO_MUCH), saga="transfer", timeout=240, isolation="none"
        )
        wait_wallet_applied(client, doomed)
        assert rig.stores.wallets()["bob"] == TOO_MUCH
        commit = encode(Decision(doomed, Outcome.COMMIT, FORGED, now_ms()))
        decisions = rig.topics.decisions
        borrowed = list(genuine.headers)  # the routing header names bank and wallet too
        wallet_batch = rig.system.keyring(WALLET).sign_batch(
            [(decisions, doomed, commit, None), (decisions, committed, commit, None)]
        )[0]
        coordinator_kid = genuine.header(HEADER_KEY_ID)
        assert coordinator_kid is not None
        claimed = [(n, coordinator_kid if n == HEADER_KEY_ID else v) for n, v in wallet_batch]
        for label, headers in (
            ("borrowed", borrowed),  # the coordinator's batch signature and proof
            ("by wallet", wallet_batch),
            ("by wallet as coordinator", claimed),
        ):
            rig.forge(label, decisions, doomed, commit, headers=headers)
        reasons = rig.dead_letters()
        rig.bank()
        final = client.result(doomed, timeout=90)
    assert "by coordinator is not valid" in reasons["borrowed"], reasons
    assert f"signed by {WALLET}, not by coordinator" in reasons["by wallet"], reasons
    assert "by coordinator is not valid" in reasons["by wallet as coordinator"], reasons
    assert final.state is SagaState.ROLLED_BACK, final
    assert [s.status for s in final.steps] == [StepStatus.COMPENSATED, StepStatus.COMPENSATED]
    assert rig.honest_decisions(doomed) == [Outcome.ROLLBACK]
    assert not any(
        e.participant == "wallet" and e.status is StepStatus.COMMITTED
        for e in rig.system.events(doomed)
    )
    assert rig.stores.balances()["bob"] == OPENING
    assert rig.stores.wallets()["bob"] == 0
    assert len(rig.all_dead_letters()) == 3
    rig.all_alive(bank)
