"""What signing costs per saga, counted: Ed25519 signatures and verifications per process.

The bench's saga (a parallel transfer of three steps: ``bank``, ``wallet``,
``rewards``, each a real participant runtime on SQLite) runs with keys on the
in-memory log, one poll per service per round, 200 sagas sent at once (the bench's
closed loop keeps 1,000 in flight). Each Ed25519 signature made and verification
done is counted against the process that made it, as is each record checked.

What holds: every record a process checks is checked once; with the services
signing in batches, each process makes at most a fraction of an Ed25519
operation per saga (one per batch of up to ``BATCH_RECORDS``), where signing
each record alone cost 11 signatures and 14 verifications per saga; a request
signed alone (as ``saga bench``'s client does) costs every participant and the
coordinator one verification each. ``python -m tests.unit.test_signing_costs``
prints the tables (docs/signing-performance.md quotes them).
"""

from __future__ import annotations

import random
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from nacl.signing import SigningKey, VerifyKey

from saga.coordinator import CoordinatorService
from saga.participants import ParticipantRuntime, open_storage
from saga.streams import (
    KafkaSettings,
    Keyring,
    Mode,
    SagaRequest,
    SignedLog,
    Step,
    encode,
)
from saga.streams._routing import request_headers
from saga.streams._signing import CLIENT, COORDINATOR, OPERATOR, create_key
from saga.streams.testing import InMemoryLog, ManualClock, Stepper

pytestmark = pytest.mark.unit

SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="cost")
TOPICS = SETTINGS.topics
SAGAS = 200
STORES = {
    "bank": ("accounts", "balance"),
    "wallet": ("wallets", "balance"),
    "rewards": ("points", "points"),
}
PRINCIPALS = (COORDINATOR, CLIENT, *(f"participant-{name}" for name in STORES))


class Costs:
    """Ed25519 operations and records checked, per principal (the process doing them)."""

    def __init__(self) -> None:
        self.signatures: Counter[str] = Counter()
        self.verifications: Counter[str] = Counter()
        self.checked: Counter[tuple[str, str]] = Counter()  # (principal, topic)
        self.checks: Counter[tuple[str, bytes, bytes]] = Counter()  # (principal, sig, proof)
        self._who = threading.local()

    def who(self) -> str:
        return getattr(self._who, "principal", "?")

    @contextmanager
    def installed(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[Costs]:
        real_sign, real_verify = SigningKey.sign, VerifyKey.verify
        real_signer = Keyring.signer
        real_keyring_sign, real_sign_batch = Keyring.sign, Keyring.sign_batch
        costs = self

        def as_principal(method: Callable[..., Any]) -> Callable[..., Any]:
            def run(keys: Keyring, *args: Any, **kwargs: Any) -> Any:
                before = getattr(costs._who, "principal", None)
                costs._who.principal = keys.principal or "?"
                try:
                    return method(keys, *args, **kwargs)
                finally:
                    costs._who.principal = before

            return run

        def signer(keys: Keyring, topic: str, key: Any, value: Any, headers: Any) -> str:
            named = dict(headers)
            principal = keys.principal or "?"
            self.checked[(principal, topic.rsplit(".", 1)[-1])] += 1
            self.checks[(principal, named.get("saga.sig", b""), named.get("saga.proof", b""))] += 1
            return as_principal(real_signer)(keys, topic, key, value, headers)  # type: ignore[no-any-return]

        def sign(key: SigningKey, message: bytes, encoder: Any = None) -> Any:
            self.signatures[self.who()] += 1
            return real_sign(key, message)

        def verify(
            key: VerifyKey, smessage: bytes, signature: Any = None, encoder: Any = None
        ) -> Any:
            self.verifications[self.who()] += 1
            return real_verify(key, smessage, signature)

        monkeypatch.setattr(SigningKey, "sign", sign)
        monkeypatch.setattr(VerifyKey, "verify", verify)
        monkeypatch.setattr(Keyring, "signer", signer)
        monkeypatch.setattr(Keyring, "sign", as_principal(real_keyring_sign))
        monkeypatch.setattr(Keyring, "sign_batch", as_principal(real_sign_batch))
        yield self

    def per_saga(self) -> dict[str, tuple[float, float]]:
        return {p: (self.signatures[p] / SAGAS, self.verifications[p] / SAGAS) for p in PRINCIPALS}

    def table(self, title: str) -> str:
        lines = [
            title,
            f"{'process':22s} {'Ed25519 signs':>14s} {'verifications':>14s}  records checked",
        ]
        for principal, (signs, verifications) in self.per_saga().items():
            topics = ", ".join(
                f"{topic} {n / SAGAS:.1f}"
                for (p, topic), n in sorted(self.checked.items())
                if p == principal
            )
            lines.append(f"{principal:22s} {signs:14.3f} {verifications:14.3f}  {topics}")
        return "\n".join(lines)


def _database(folder: Path, name: str) -> str:
    url = f"sqlite:///{folder / (name + '.db')}"
    target, field = STORES[name]
    engine = sa.create_engine(url)
    metadata = sa.MetaData()
    table = sa.Table(
        target,
        metadata,
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column(field, sa.Integer, nullable=False),
    )
    metadata.create_all(engine)
    with engine.begin() as connection:
        connection.execute(table.insert(), [{"id": f"a{i}", field: 10_000} for i in range(50)])
    engine.dispose()
    return url


def run_sagas(folder: Path, *, requests_alone: bool) -> None:
    """``SAGAS`` transfers with keys; the client signs its requests in batches, or alone."""
    keys_dir = folder / "keys"
    for principal in (*PRINCIPALS, OPERATOR):
        create_key(keys_dir, principal)
    keys = {p: Keyring.load(keys_dir, p) for p in PRINCIPALS}
    clock = ManualClock()
    log = InMemoryLog(SETTINGS, clock=clock)
    log.create_topics(2)
    coordinator = CoordinatorService(
        SETTINGS, instance_id="a", clock=clock, log=log, keys=keys[COORDINATOR]
    )
    steppers = [Stepper(log, coordinator.run, stop=coordinator.stop).start()]
    for name, (target, _) in STORES.items():
        storage = open_storage("sql", name=name, url=_database(folder, name), targets=[target])
        runtime = ParticipantRuntime(
            name,
            storage,
            SETTINGS,
            log=log,
            clock=clock,
            event_window_ms=10_000,
            keys=keys[f"participant-{name}"],
        )
        steppers.append(Stepper(log, runtime.run, stop=runtime.stop).start())
    rng = random.Random(7)
    client = keys[CLIENT]
    source = log if requests_alone else SignedLog(log, client)
    with source.producer() as producer:
        for n in range(SAGAS):
            steps = tuple(
                Step(name, "increment", {"target": t, "key": account, "field": f, "by": 1})
                for name, (t, f) in STORES.items()
                for account in (f"a{rng.randrange(50)}",)
            )
            deadline = clock() + 600_000
            request = SagaRequest(f"tx-{n}", "transfer", Mode.PARALLEL, steps, deadline, clock())
            value, headers = encode(request), request_headers(request)
            if requests_alone:  # as saga bench's client does
                headers = client.sign(TOPICS.requests, request.tx_id, value, headers)
            producer.produce(TOPICS.requests, request.tx_id, value, headers=headers)

    def latest() -> dict[bytes | None, Any]:
        return {m.key: m for m in log.records(TOPICS.status)}

    try:
        for _ in range(50):
            finals = [m for m in latest().values() if m.value and b'"committed"' in m.value]
            if len(finals) == SAGAS:
                break
            for stepper in steppers:
                stepper.step()
        else:
            pytest.fail("the sagas did not all commit")
        for m in latest().values():  # the client's result(): the final status, checked
            assert (
                client.check(m.topic, m.key, m.value, m.headers, frozenset({COORDINATOR})) is None
            )
    finally:
        for stepper in steppers:
            stepper.stop()


@pytest.fixture
def costs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Costs]:
    with Costs().installed(monkeypatch) as counted:
        yield counted


def test_batch_signing_costs_a_fraction_of_an_ed25519_operation_per_saga_and_process(
    costs: Costs, tmp_path: Path
) -> None:
    run_sagas(tmp_path, requests_alone=False)
    for principal, (signs, verifications) in costs.per_saga().items():
        assert signs <= 0.2, costs.table(principal)
        assert verifications <= 0.35, costs.table(principal)
    # Each record a process checks is checked once.
    assert all(n == 1 for n in costs.checks.values()), costs.table("repeated checks")
    # What is checked: the coordinator, its inputs (its own status records and decisions,
    # read back, are known by the places their delivery reports named: coordinator._own);
    # each participant its request and its decision; the client its final status. The
    # events: 3 `applied` per saga, and the `committed` ones together (saga.committed:
    # one record per participant batch and partition).
    assert 3 * SAGAS < costs.checked[(COORDINATOR, "events")] <= 3 * SAGAS + SAGAS // 10
    assert costs.checked[(COORDINATOR, "requests")] == SAGAS
    assert costs.checked[(COORDINATOR, "status")] == 0
    assert costs.checked[(COORDINATOR, "decisions")] == 0
    assert costs.checked[("participant-bank", "requests")] == SAGAS
    assert costs.checked[("participant-bank", "decisions")] == SAGAS


def test_a_request_signed_alone_costs_each_of_its_readers_one_verification(
    costs: Costs, tmp_path: Path
) -> None:
    run_sagas(tmp_path, requests_alone=True)
    per_saga = costs.per_saga()
    assert per_saga[CLIENT][0] == 1.0
    for name in STORES:
        assert 1.0 <= per_saga[f"participant-{name}"][1] <= 1.35
    assert 1.0 <= per_saga[COORDINATOR][1] <= 1.35


if __name__ == "__main__":  # python -m tests.unit.test_signing_costs
    import tempfile

    for alone in (False, True):
        with pytest.MonkeyPatch.context() as patch, Costs().installed(patch) as counted:
            run_sagas(Path(tempfile.mkdtemp()), requests_alone=alone)
        title = "requests signed alone (saga bench's client)" if alone else "requests in batches"
        print(counted.table(f"\nper saga, {SAGAS} sagas, {title}"), file=sys.stdout)
