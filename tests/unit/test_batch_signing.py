"""Batch signatures (streams._merkle, Keyring.sign_batch) and the batching signed log, no broker.

Covered: every record of a batch verifies alone, for its signer only, at every batch
size up to the signed log's (each tree shape); tampering with any part of a
batch-signed record, its proof or its signature fails it, and so does moving a
proof or a signature to another record; a verdict kept on a batch lets no forged
record through and costs one Ed25519 verification per batch; a keyring that
remembers its own batches still refuses forgeries; malformed proofs fail with a
sentence; :class:`SignedLog` producers sign each transaction or flush in batches of
at most ``BATCH_RECORDS``, keep the order, drop an aborted transaction's records,
hand records on at ``poll``, ``flush``, ``close`` and the end of a ``with`` block,
and (the linger of a producer on Kafka) without any of them.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import pytest
from nacl.signing import VerifyKey

from saga.streams import KafkaSettings, Keyring, SignedLog, TransientError
from saga.streams._merkle import MAX_LEAVES, leaf_hash, root_of, tree
from saga.streams._signed_log import BATCH_RECORDS, _SigningProducer
from saga.streams._signing import (
    COORDINATOR,
    HEADER_KEY_ID,
    HEADER_PROOF,
    HEADER_SIGNATURE,
    create_key,
)
from saga.streams.kafka import Message
from saga.streams.testing import InMemoryLog, ManualClock
from tests._infra import eventually

pytestmark = pytest.mark.unit

BANK, SHOP = "participant-bank", "participant-shop"
ONLY_COORDINATOR = frozenset({COORDINATOR})
TOPIC = "s.decisions"
Headers = list[tuple[str, bytes]]
Record = tuple[str, bytes, bytes, Headers]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    keys = tmp_path / "keys"
    for principal in (COORDINATOR, BANK, SHOP):
        create_key(keys, principal)
    return keys


def batch(keys: Keyring, n: int, topic: str = TOPIC) -> list[Record]:
    """``n`` records signed as one batch by ``keys``: (topic, key, value, headers)."""
    plain = [(topic, f"tx-{i}", f"v{i}".encode(), [("trace", f"t{i}".encode())]) for i in range(n)]
    signed = keys.sign_batch(plain)
    return [(t, k.encode(), v, h) for (t, k, v, _), h in zip(plain, signed, strict=True)]


def with_header(headers: Headers, name: str, value: bytes | None) -> Headers:
    """``headers`` with ``name`` replaced by ``value`` (removed for ``None``)."""
    kept = [(n, v) for n, v in headers if n != name]
    return kept if value is None else [*kept, (name, value)]


class Counting:
    """Counts the Ed25519 verifications made (all keyrings) while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = VerifyKey.verify

        def verify(key: VerifyKey, smessage: bytes, signature: bytes | None = None) -> bytes:
            self.calls += 1
            return real(key, smessage, signature)

        monkeypatch.setattr(VerifyKey, "verify", verify)


# ------------------------------------------------------------------ the tree


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 100])
def test_every_leaf_of_every_shape_folds_up_to_the_root(n: int) -> None:
    leaves = [leaf_hash(f"record {i}".encode()) for i in range(n)]
    root, proofs = tree(leaves)
    for i, (leaf, proof) in enumerate(zip(leaves, proofs, strict=True)):
        assert struct.unpack_from(">HH", proof) == (i, n)
        assert (len(proof) - 4) % 32 == 0 and len(proof) - 4 <= 32 * (n - 1).bit_length()
        assert root_of(leaf, proof) == (n, root)
        other = leaves[(i + 1) % n]
        assert root_of(other, proof)[1] != root  # a proof places one leaf only


def test_the_node_memo_changes_no_result() -> None:
    """Folding with the memo a keyring keeps gives what folding without it gives, for
    genuine and for altered proofs alike (the memo maps hash inputs to their hashes)."""
    leaves = [leaf_hash(f"record {i}".encode()) for i in range(BATCH_RECORDS)]
    _, proofs = tree(leaves)
    memo: dict[bytes, bytes] = {}
    for leaf, proof in zip(leaves, proofs, strict=True):
        altered = [
            proof,
            proof[:-1] + bytes([proof[-1] ^ 1]),
            proof[:4] + proof[36:68] + proof[4:36] + proof[68:],  # two siblings swapped
            struct.pack(">HH", struct.unpack_from(">H", proof)[0] ^ 1, BATCH_RECORDS) + proof[4:],
        ]
        for candidate in altered:
            assert root_of(leaf, candidate, memo) == root_of(leaf, candidate)
    assert len(memo) >= BATCH_RECORDS - 1  # every inner node of the tree, at least


def test_malformed_proofs_fail_with_a_sentence() -> None:
    leaves = [leaf_hash(bytes([i])) for i in range(5)]
    _root, proofs = tree(leaves)
    proof = proofs[2]
    bad = {
        "empty": b"",
        "short head": proof[:3],
        "index past the count": struct.pack(">HH", 5, 5) + proof[4:],
        "count too large": struct.pack(">HH", 0, MAX_LEAVES + 1) + proof[4:],
        "a sibling cut short": proof[:-1],
        "a sibling missing": proof[:-32],
        "a sibling too many": proof + bytes(32),
    }
    for label, value in bad.items():
        try:
            root_of(leaves[2], value)
        except ValueError as exc:
            assert str(exc).startswith("the batch proof"), label
        else:
            pytest.fail(f"{label}: accepted")
    with pytest.raises(ValueError, match="a batch signs 2 to"):
        tree(leaves[:1])


# ------------------------------------------------------------------ batch signatures


@pytest.mark.parametrize("n", [2, 3, 5, BATCH_RECORDS - 1, BATCH_RECORDS])
def test_each_record_of_a_batch_verifies_alone_for_its_signer_only(folder: Path, n: int) -> None:
    records = batch(Keyring.load(folder, COORDINATOR), n)
    signatures = {dict(h)[HEADER_SIGNATURE] for *_, h in records}
    assert len(signatures) == 1  # one Ed25519 signature for the batch
    for topic, key, value, headers in records:
        fresh = Keyring.load(folder)  # no verdict kept: each record checked on its own
        assert fresh.check(topic, key, value, headers, ONLY_COORDINATOR) is None
        reason = fresh.check(topic, key, value, headers, frozenset({BANK}))
        assert reason == f"record is signed by coordinator, not by {BANK}"


def test_sign_batch_of_one_is_sign(folder: Path) -> None:
    keys = Keyring.load(folder, COORDINATOR)
    (headers,) = keys.sign_batch([(TOPIC, "tx-1", b"v", [("trace", b"t")])])
    assert headers == keys.sign(TOPIC, "tx-1", b"v", [("trace", b"t")])  # Ed25519: deterministic
    assert HEADER_PROOF not in dict(headers)
    assert keys.sign_batch([]) == []


def tampered(record: Record, other: Record) -> dict[str, Record]:
    """Every way to change ``record`` (``other``: another record of its batch)."""
    topic, key, value, headers = record
    proof = dict(headers)[HEADER_PROOF]
    signature = dict(headers)[HEADER_SIGNATURE]
    flipped_sibling = proof[:-1] + bytes([proof[-1] ^ 1])
    index, count = struct.unpack_from(">HH", proof)
    return {
        "another topic": ("s.status", key, value, headers),
        "another deployment's prefix": ("t.decisions", key, value, headers),
        "another key": (topic, b"tx-99", value, headers),
        "no key": (topic, None, value, headers),  # type: ignore[dict-item]
        "another value": (topic, key, value + b"!", headers),
        "made a tombstone": (topic, key, None, headers),  # type: ignore[dict-item]
        "a header changed": (topic, key, value, with_header(headers, "trace", b"x")),
        "a header added": (topic, key, value, [*headers, ("more", b"x")]),
        "a header dropped": (topic, key, value, with_header(headers, "trace", None)),
        "a sibling flipped": (
            topic,
            key,
            value,
            with_header(headers, HEADER_PROOF, flipped_sibling),
        ),
        "another index": (
            topic,
            key,
            value,
            with_header(headers, HEADER_PROOF, struct.pack(">HH", index ^ 1, count) + proof[4:]),
        ),
        "another count": (
            topic,
            key,
            value,
            with_header(headers, HEADER_PROOF, struct.pack(">HH", index, count + 1) + proof[4:]),
        ),
        "the proof dropped": (topic, key, value, with_header(headers, HEADER_PROOF, None)),
        "the other record's proof": (
            topic,
            key,
            value,
            with_header(headers, HEADER_PROOF, dict(other[3])[HEADER_PROOF]),
        ),
        "the signature flipped": (
            topic,
            key,
            value,
            with_header(headers, HEADER_SIGNATURE, bytes([signature[0] ^ 1]) + signature[1:]),
        ),
        "the signature cut": (
            topic,
            key,
            value,
            with_header(headers, HEADER_SIGNATURE, signature[:10]),
        ),
    }


def test_tampering_with_any_part_of_a_batch_signed_record_fails_it(folder: Path) -> None:
    records = batch(Keyring.load(folder, COORDINATOR), 5)
    for label, (topic, key, value, headers) in tampered(records[2], records[3]).items():
        reason = Keyring.load(folder).check(topic, key, value, headers, ONLY_COORDINATOR)
        assert reason is not None and "not valid" in reason, label


def test_a_verdict_kept_lets_no_forgery_through_and_costs_one_verification_per_batch(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = batch(Keyring.load(folder, COORDINATOR), BATCH_RECORDS)
    second = batch(Keyring.load(folder, COORDINATOR), 3, topic="s.status")
    verifier = Keyring.load(folder)
    counting = Counting(monkeypatch)
    for topic, key, value, headers in [*first, *second]:
        assert verifier.check(topic, key, value, headers, ONLY_COORDINATOR) is None
    assert counting.calls == 2
    # Each forgery carries a batch signature already verified here: still refused.
    for label, (topic, key, value, headers) in tampered(first[7], first[8]).items():
        reason = verifier.check(topic, key, value, headers, ONLY_COORDINATOR)
        assert reason is not None and "not valid" in reason, label
    # The bank's key signs a batch presented under the coordinator's key id: refused.
    bank_batch = batch(Keyring.load(folder, BANK), 4)
    coordinator_kid = dict(first[0][3])[HEADER_KEY_ID]
    for topic, key, value, headers in bank_batch:
        assert verifier.check(topic, key, value, headers, frozenset({BANK})) is None
        claimed = with_header(headers, HEADER_KEY_ID, coordinator_kid)
        reason = verifier.check(topic, key, value, claimed, ONLY_COORDINATOR)
        assert reason is not None and "not valid" in reason
    # Records of the verified batches still pass, without another verification.
    calls = counting.calls
    for topic, key, value, headers in reversed(first):
        assert verifier.check(topic, key, value, headers, ONLY_COORDINATOR) is None
    assert counting.calls == calls


def test_a_participant_batch_signs_no_coordinator_record(folder: Path) -> None:
    records = batch(Keyring.load(folder, SHOP), 4)
    verifier = Keyring.load(folder)
    for topic, key, value, headers in records:
        reason = verifier.check(topic, key, value, headers, ONLY_COORDINATOR)
        assert reason == f"record is signed by {SHOP}, not by coordinator"


def test_a_keyring_that_remembers_its_own_batches_still_refuses_every_forgery(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator = Keyring.load(folder, COORDINATOR)
    coordinator.remember_own(10)
    records = batch(coordinator, 6)
    counting = Counting(monkeypatch)
    for topic, key, value, headers in records:
        assert coordinator.check(topic, key, value, headers, ONLY_COORDINATOR) is None
    assert counting.calls == 0  # its own batch: recognised on a digest of the root
    for label, (topic, key, value, headers) in tampered(records[1], records[0]).items():
        reason = coordinator.check(topic, key, value, headers, ONLY_COORDINATOR)
        assert reason is not None and "not valid" in reason, label
    # An old own batch the memory forgot is verified (and valid).
    forgetful = Keyring.load(folder, COORDINATOR)
    forgetful.remember_own(1)
    old, new = batch(forgetful, 2), batch(forgetful, 2, topic="s.status")
    calls = counting.calls
    assert forgetful.check(*new[0], ONLY_COORDINATOR) is None
    assert counting.calls == calls
    assert forgetful.check(*old[0], ONLY_COORDINATOR) is None
    assert counting.calls == calls + 1


# ------------------------------------------------------------------ the signed log


class Recorder:
    """A LogProducer that keeps what it is handed, and by which thread."""

    def __init__(self) -> None:
        self.produced: list[tuple[str, bytes | str | None, bytes | None, Headers]] = []
        self.threads: set[str] = set()
        self.polls = self.flushes = 0
        self.closed = False

    def produce(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        on_delivery: object = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        self.produced.append((topic, key, value, list(headers or ())))
        self.threads.add(threading.current_thread().name)

    def poll(self, timeout: float = 0.0) -> int:
        self.polls += 1
        return 0

    def flush(self, timeout: float = 30.0) -> int:
        self.flushes += 1
        return 0

    def close(self, timeout: float = 10.0) -> None:
        self.closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def proofs_of(headers: Headers) -> tuple[int, int] | None:
    proof = dict(headers).get(HEADER_PROOF)
    return None if proof is None else struct.unpack_from(">HH", proof)


def test_a_plain_signed_producer_batches_what_it_is_given_between_flushes(folder: Path) -> None:
    keys = Keyring.load(folder, BANK)
    inner = Recorder()
    producer = _SigningProducer(inner, keys, linger_s=None)
    for i in range(BATCH_RECORDS + 3):
        producer.produce("s.events", f"tx-{i}", f"{i}".encode())
    # A full batch is handed on at once; the rest waits for a poll, flush or close.
    assert len(inner.produced) == BATCH_RECORDS
    assert {proofs_of(h)[1] for *_, h in inner.produced} == {BATCH_RECORDS}  # type: ignore[index]
    producer.poll(0)
    assert len(inner.produced) == BATCH_RECORDS + 3 and inner.polls == 1
    assert [v for _, _, v, _ in inner.produced] == [f"{i}".encode() for i in range(35)]
    assert [proofs_of(h) for *_, h in inner.produced[BATCH_RECORDS:]] == [(0, 3), (1, 3), (2, 3)]
    producer.produce("s.events", "tx-x", b"alone")
    producer.flush(1)
    assert proofs_of(inner.produced[-1][3]) is None  # a batch of one: signed alone
    producer.produce("s.events", "tx-y", b"last")
    producer.close(1)
    assert inner.closed and inner.produced[-1][2] == b"last"
    verifier = Keyring.load(folder)
    for topic, key, value, headers in inner.produced:
        raw = key.encode() if isinstance(key, str) else key
        assert verifier.check(topic, raw, value, headers, frozenset({BANK})) is None
    with _SigningProducer(Recorder(), keys, linger_s=None) as scoped:
        scoped.produce("s.events", "tx-z", b"in a with block")
        held = scoped._inner.produced  # type: ignore[attr-defined]
        assert held == []
    assert [v for _, _, v, _ in held] == [b"in a with block"]


def test_a_closed_signed_producer_refuses_a_record_as_the_wrapped_one_does(folder: Path) -> None:
    settings = KafkaSettings(bootstrap="memory:9092", prefix="s")
    memory = InMemoryLog(settings, clock=ManualClock())
    memory.create_topics(1)
    producer = SignedLog(memory, Keyring.load(folder, BANK)).producer()
    producer.close()
    with pytest.raises(TransientError, match="is closed"):
        producer.produce(settings.topics.events, "tx-1", b"late")


def test_a_plain_signed_producer_on_kafka_hands_records_on_without_a_flush(folder: Path) -> None:
    inner = Recorder()
    producer = _SigningProducer(inner, Keyring.load(folder, BANK), linger_s=0.01)
    producer.produce("s.events", "tx-1", b"1")
    producer.produce("s.events", "tx-2", b"2")
    eventually(lambda: len(inner.produced) == 2, timeout=10, interval=0.01)
    assert inner.threads == {"saga-signing-linger"} and inner.flushes == 0
    assert [proofs_of(h) for *_, h in inner.produced] == [(0, 2), (1, 2)]
    producer.close(1)


class Refusing(Recorder):
    """A Recorder whose ``produce`` raises while ``refusing`` (Kafka away, a fatal error)."""

    def __init__(self) -> None:
        super().__init__()
        self.refusing = True
        self.attempts = 0
        self.refuse_from = 0  # records accepted before refusing starts (per refusing spell)

    def produce(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None = None,
        on_delivery: object = None,
        partition: int | None = None,
        timestamp_ms: int | None = None,
    ) -> None:
        self.attempts += 1
        if self.refusing and self.refuse_from <= 0:
            raise TransientError("the producer's queue stayed full for 30s")
        self.refuse_from -= 1
        super().produce(topic, key, value, headers)


def test_a_refused_hand_on_keeps_the_records_and_never_locks_the_producer_up(
    folder: Path,
) -> None:
    """The linger thread meets a refusing Kafka: it stops (no retry loop holding the lock),
    the caller can still produce, its flush raises, and once Kafka takes records again each
    record is handed on exactly once, in order (a batch cut short is signed again)."""
    inner = Refusing()
    inner.refuse_from = 1  # the first record goes through, then Kafka refuses
    producer = _SigningProducer(inner, Keyring.load(folder, BANK), linger_s=0.01)
    producer.produce("s.events", "tx-0", b"0")
    producer.produce("s.events", "tx-1", b"1")
    eventually(lambda: inner.attempts >= 2, timeout=10, interval=0.01)
    attempts = inner.attempts
    done = threading.Event()

    def more() -> None:  # the caller's thread must not wait on the linger thread
        producer.produce("s.events", "tx-2", b"2")
        done.set()

    threading.Thread(target=more, daemon=True).start()
    assert done.wait(5), "produce blocked behind the linger thread"
    with pytest.raises(TransientError):
        producer.flush(1)
    assert inner.attempts == attempts + 1  # the flush's one try; the linger thread is idle
    inner.refusing = False
    producer.flush(1)
    assert [v for _, _, v, _ in inner.produced] == [b"0", b"1", b"2"]
    verifier = Keyring.load(folder)
    for topic, key, value, headers in inner.produced:
        raw = key.encode() if isinstance(key, str) else key
        assert verifier.check(topic, raw, value, headers, frozenset({BANK})) is None
    producer.close(1)


def test_a_signed_transaction_is_signed_in_batches_and_an_aborted_one_is_dropped(
    folder: Path,
) -> None:
    settings = KafkaSettings(bootstrap="memory:9092", prefix="s")
    memory = InMemoryLog(settings, clock=ManualClock())
    memory.create_topics(2)
    signed_log = SignedLog(memory, Keyring.load(folder, COORDINATOR))
    producer = signed_log.transactional_producer("s.test")
    producer.init()
    producer.begin()
    producer.produce(settings.topics.status, "dropped", b"x")
    producer.abort()
    producer.begin()
    delivered: list[Message] = []
    total = 2 * BATCH_RECORDS + 1
    for i in range(total):
        producer.produce(
            settings.topics.status,
            f"tx-{i}",
            f"{i}".encode(),
            on_delivery=lambda error, m: delivered.append(m),
        )
    producer.commit()
    producer.close()
    found = memory.records(settings.topics.status)
    assert sorted(m.value or b"" for m in found) == sorted(f"{i}".encode() for i in range(total))
    assert len(delivered) == total
    batches: dict[bytes, int] = {}
    verifier = Keyring.load(folder)
    for m in found:
        assert verifier.check(m.topic, m.key, m.value, m.headers, ONLY_COORDINATOR) is None
        signature = m.header(HEADER_SIGNATURE)
        assert signature is not None
        batches[signature] = batches.get(signature, 0) + 1
    assert sorted(batches.values()) == [1, BATCH_RECORDS, BATCH_RECORDS]
