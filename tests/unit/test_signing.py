"""Record signatures (streams._signing) and the signing log (streams._signed_log), no broker.

Covered: a signed record verifies for the principals allowed and for no one else;
tampering with its topic, key, value, a header or the signature fails it; an
unsigned record and an unknown key fail with a sentence; rotation (two keys of one
principal both valid, the new one signs) and retirement; private key files are
0600; broken or missing key files give one sentence; who may sign what; and
:class:`SignedLog` signs every record its producers write, transactional ones and
tombstones included.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from nacl.signing import VerifyKey

from saga.streams import (
    ConfigurationError,
    Decision,
    KafkaSettings,
    Keyring,
    Mode,
    Outcome,
    SagaAbort,
    SagaRequest,
    SagaState,
    SagaStatus,
    SignedLog,
    Step,
    StepEvent,
    StepStatus,
)
from saga.streams._signing import (
    CLIENT,
    COORDINATOR,
    OPERATOR,
    allowed_signers,
    check_principal,
    create_key,
    retire_key,
)
from saga.streams.testing import InMemoryLog, ManualClock

pytestmark = pytest.mark.unit

ONLY_COORDINATOR = frozenset({COORDINATOR})
TOPIC = "s.decisions"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    keys = tmp_path / "keys"
    for principal in (COORDINATOR, CLIENT, OPERATOR, "participant-bank", "participant-shop"):
        create_key(keys, principal)
    return keys


def signed(
    keys: Keyring, *, value: bytes | None = b"v", key: str = "tx-1"
) -> list[tuple[str, bytes]]:
    return keys.sign(TOPIC, key, value, [("trace", b"abc")])


def test_a_signed_record_verifies_for_its_signer_only(folder: Path) -> None:
    coordinator = Keyring.load(folder, COORDINATOR)
    verifier = Keyring.load(folder)
    assert coordinator.signs and not verifier.signs
    headers = signed(coordinator)
    assert dict(headers)["saga.kid"].decode().startswith("coordinator.")
    assert len(dict(headers)["saga.sig"]) == 64
    assert verifier.check(TOPIC, b"tx-1", b"v", headers, ONLY_COORDINATOR) is None
    reason = verifier.check(TOPIC, b"tx-1", b"v", headers, frozenset({"participant-bank"}))
    assert reason == "record is signed by coordinator, not by participant-bank"


@pytest.mark.parametrize(
    ("topic", "key", "value", "extra"),
    [
        ("s.status", b"tx-1", b"v", []),  # another topic
        ("t.decisions", b"tx-1", b"v", []),  # another deployment's prefix
        (TOPIC, b"tx-2", b"v", []),  # another key
        (TOPIC, None, b"v", []),  # no key
        (TOPIC, b"tx-1", b"w", []),  # another value
        (TOPIC, b"tx-1", None, []),  # made a tombstone
        (TOPIC, b"tx-1", b"v", [("trace", b"abd")]),  # a header changed
        (TOPIC, b"tx-1", b"v", [("more", b"x")]),  # a header added
    ],
)
def test_tampering_with_any_part_fails_the_signature(
    folder: Path,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    extra: list[tuple[str, bytes]],
) -> None:
    headers = signed(Keyring.load(folder, COORDINATOR))
    changed = [h for h in headers if h[0] not in {n for n, _ in extra}] + extra
    reason = Keyring.load(folder).check(topic, key, value, changed, ONLY_COORDINATOR)
    assert reason == (
        "record's signature by coordinator is not valid: expected a signature by coordinator"
    )


def test_a_dropped_header_or_a_changed_signature_fails(folder: Path) -> None:
    verifier = Keyring.load(folder)
    headers = signed(Keyring.load(folder, COORDINATOR))
    dropped = [h for h in headers if h[0] != "trace"]
    assert verifier.check(TOPIC, b"tx-1", b"v", dropped, ONLY_COORDINATOR) is not None
    flipped = [(n, bytes([v[0] ^ 1]) + v[1:]) if n == "saga.sig" else (n, v) for n, v in headers]
    assert verifier.check(TOPIC, b"tx-1", b"v", flipped, ONLY_COORDINATOR) is not None
    short = [(n, v[:10]) if n == "saga.sig" else (n, v) for n, v in headers]
    assert verifier.check(TOPIC, b"tx-1", b"v", short, ONLY_COORDINATOR) is not None


def test_a_tombstone_and_a_null_key_are_signed_as_such(folder: Path) -> None:
    coordinator, verifier = Keyring.load(folder, COORDINATOR), Keyring.load(folder)
    tombstone = coordinator.sign(TOPIC, "tx-1", None)
    assert verifier.check(TOPIC, b"tx-1", None, tombstone, ONLY_COORDINATOR) is None
    assert verifier.check(TOPIC, b"tx-1", b"", tombstone, ONLY_COORDINATOR) is not None
    keyless = coordinator.sign(TOPIC, None, b"v")
    assert verifier.check(TOPIC, None, b"v", keyless, ONLY_COORDINATOR) is None
    assert verifier.check(TOPIC, b"", b"v", keyless, ONLY_COORDINATOR) is not None


def test_an_unsigned_record_and_an_unknown_key_are_refused_with_a_sentence(
    folder: Path, tmp_path: Path
) -> None:
    verifier = Keyring.load(folder)
    assert verifier.check(TOPIC, b"tx-1", b"v", [], ONLY_COORDINATOR) == (
        "record is not signed: expected a signature by coordinator"
    )
    other = tmp_path / "other"
    create_key(other, COORDINATOR)  # a coordinator of another deployment
    headers = signed(Keyring.load(other, COORDINATOR))
    reason = verifier.check(TOPIC, b"tx-1", b"v", headers, ONLY_COORDINATOR)
    assert reason is not None and reason.startswith("record is signed with an unknown key")
    assert reason.endswith("expected a signature by coordinator")


def test_resigning_replaces_a_previous_signature(folder: Path) -> None:
    bank = Keyring.load(folder, "participant-bank")
    coordinator = Keyring.load(folder, COORDINATOR)
    twice = coordinator.sign(TOPIC, "tx-1", b"v", bank.sign(TOPIC, "tx-1", b"v"))
    assert [n for n, _ in twice].count("saga.sig") == 1
    assert Keyring.load(folder).check(TOPIC, b"tx-1", b"v", twice, ONLY_COORDINATOR) is None


def test_replay_annotations_are_outside_the_signature(folder: Path) -> None:
    headers = signed(Keyring.load(folder, COORDINATOR))
    copied = [*headers, ("saga.replayed.at_ms", b"123")]
    assert Keyring.load(folder).check(TOPIC, b"tx-1", b"v", copied, ONLY_COORDINATOR) is None


def test_rotation_keeps_the_old_key_valid_until_it_is_retired(folder: Path) -> None:
    old_signer = Keyring.load(folder, "participant-bank")
    old = old_signer.sign(TOPIC, "tx-1", b"v")
    new_kid = create_key(folder, "participant-bank")  # rotation
    new_signer = Keyring.load(folder, "participant-bank")
    new = new_signer.sign(TOPIC, "tx-1", b"v")
    assert dict(new)["saga.kid"].decode() == new_kid != dict(old)["saga.kid"].decode()
    allowed = frozenset({"participant-bank"})
    verifier = Keyring.load(folder)
    assert verifier.check(TOPIC, b"tx-1", b"v", old, allowed) is None
    assert verifier.check(TOPIC, b"tx-1", b"v", new, allowed) is None
    retire_key(folder, dict(old)["saga.kid"].decode())
    after = Keyring.load(folder)
    reason = after.check(TOPIC, b"tx-1", b"v", old, allowed)
    assert reason is not None and "unknown key" in reason
    assert after.check(TOPIC, b"tx-1", b"v", new, allowed) is None
    with pytest.raises(ConfigurationError, match="there is no public key"):
        retire_key(folder, dict(old)["saga.kid"].decode())
    for bad in ("../coordinator.key", "coordinator", "participant-bank.zz", "x/y.00"):
        with pytest.raises(ConfigurationError, match="is not a key id"):
            retire_key(folder, bad)


def test_private_key_files_are_readable_by_their_owner_only(folder: Path) -> None:
    keys = sorted(folder.glob("*.key"))
    assert len(keys) == 5
    for path in keys:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_missing_or_broken_key_files_give_one_sentence(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="does not exist: create it with `saga keys"):
        Keyring.load(tmp_path / "nowhere", COORDINATOR)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigurationError, match="holds no public key"):
        Keyring.load(empty)
    with pytest.raises(ConfigurationError, match="no private key for participant-x in"):
        Keyring.load(folder, "participant-x")
    with pytest.raises(ConfigurationError, match="is not a principal"):
        Keyring.load(folder, "root")
    (folder / "operator.key").write_text((folder / "client.key").read_text())
    with pytest.raises(ConfigurationError, match="is not operator's private key file"):
        Keyring.load(folder, OPERATOR)
    (folder / "junk.pub").write_text("{not json")
    with pytest.raises(ConfigurationError, match=r"junk\.pub is not a saga public key file") as err:
        Keyring.load(folder)
    assert "\n" not in str(err.value)


def test_who_may_sign_what() -> None:
    request = SagaRequest(
        "tx-1", "s", Mode.PARALLEL, (Step("bank", "a", {}),), deadline_ms=2, created_ms=1
    )
    assert allowed_signers(request) == {CLIENT, OPERATOR}
    abort = SagaAbort("tx-1", "r", 1)
    assert allowed_signers(abort) == {CLIENT, OPERATOR}
    assert allowed_signers(abort, aborters=frozenset({OPERATOR})) == {OPERATOR}
    event = StepEvent("tx-1", 0, "bank", StepStatus.APPLIED, 1, None)
    assert allowed_signers(event) == {"participant-bank"}
    assert allowed_signers(Decision("tx-1", Outcome.COMMIT, "all applied", 1)) == {COORDINATOR}
    status = SagaStatus("tx-1", "s", SagaState.PENDING, (), None, 1, 1, 2)
    assert allowed_signers(status) == {COORDINATOR}
    assert check_principal("participant-a_b-1") == "participant-a_b-1"
    for bad in ("participant-", "participant-a.b", "admin", "participant-a/b"):
        with pytest.raises(ConfigurationError):
            check_principal(bad)


def test_a_keyring_without_a_private_key_cannot_sign(folder: Path) -> None:
    with pytest.raises(ConfigurationError, match="no private key to sign with"):
        Keyring.load(folder).sign(TOPIC, "tx-1", b"v")
    with pytest.raises(ConfigurationError, match="needs a keyring with a private key"):
        SignedLog(
            InMemoryLog(KafkaSettings(bootstrap="memory:9092", prefix="s")), Keyring.load(folder)
        )


def test_the_signed_log_signs_every_record_its_producers_write(folder: Path) -> None:
    settings = KafkaSettings(bootstrap="memory:9092", prefix="s")
    memory = InMemoryLog(settings, clock=ManualClock())
    memory.create_topics(1)
    signed_log = SignedLog(memory, Keyring.load(folder, COORDINATOR))
    assert signed_log.settings is settings and signed_log.inner is memory
    with signed_log.producer() as producer:
        producer.produce(settings.topics.requests, "tx-1", b"plain", headers=[("h", b"1")])
    transactional = signed_log.transactional_producer("s.test")
    transactional.init()
    transactional.begin()
    transactional.produce(settings.topics.status, "tx-1", b"status")
    transactional.produce(settings.topics.status, "tx-1", None)  # a tombstone
    transactional.commit()
    transactional.close()
    verifier = Keyring.load(folder)
    found = [
        *memory.records(settings.topics.requests),
        *memory.records(settings.topics.status),
    ]
    assert [m.value for m in found] == [b"plain", b"status", None]
    for m in found:
        assert verifier.check(m.topic, m.key, m.value, m.headers, ONLY_COORDINATOR) is None
    assert found[0].header("h") == b"1"


def test_a_keyring_that_remembers_its_own_records_still_refuses_every_forgery(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coordinator = Keyring.load(folder, COORDINATOR)
    coordinator.remember_own(2)
    first, second, third = (
        coordinator.sign(TOPIC, "tx-1", b"v1"),
        coordinator.sign(TOPIC, "tx-2", b"v2"),
        coordinator.sign(TOPIC, "tx-3", b"v3"),
    )
    verified: list[bytes] = []
    real_verify = VerifyKey.verify

    def counting(self: VerifyKey, smessage: bytes, signature: bytes) -> bytes:
        verified.append(signature)
        return real_verify(self, smessage, signature)

    monkeypatch.setattr(VerifyKey, "verify", counting)
    # Its two latest records pass without a verification ...
    assert coordinator.check(TOPIC, b"tx-3", b"v3", third, ONLY_COORDINATOR) is None
    assert coordinator.check(TOPIC, b"tx-2", b"v2", second, ONLY_COORDINATOR) is None
    assert verified == []
    # ... an older one (forgotten: the memory holds two) is verified, and valid ...
    assert coordinator.check(TOPIC, b"tx-1", b"v1", first, ONLY_COORDINATOR) is None
    assert len(verified) == 1
    # ... and its signature moved onto other content is verified, and refused.
    for topic, key, value in ((TOPIC, b"tx-3", b"v4"), ("s.status", b"tx-3", b"v3")):
        reason = coordinator.check(topic, key, value, third, ONLY_COORDINATOR)
        assert reason is not None and "not valid" in reason
    assert len(verified) == 3
    # A retired own key is refused even for a record in the memory.
    kid = dict(third)["saga.kid"].decode()
    (folder / f"{kid}.pub").unlink()
    reloaded = Keyring.load(folder, COORDINATOR)
    reloaded.remember_own(10)
    headers = reloaded.sign(TOPIC, "tx-9", b"v")
    assert reloaded.check(TOPIC, b"tx-9", b"v", headers, ONLY_COORDINATOR) is not None
