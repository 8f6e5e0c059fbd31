"""Signed records: who wrote a record, proven with Ed25519, checked before any effect.

Signing is on when a key folder is configured (``SAGA_KEYS_DIR`` or
``--keys-dir``). Every process then signs what it writes with its own private
key and verifies what it acts on against everyone's public keys. Without a key
folder nothing is signed or checked, and the processes say so at start-up.

Principals (one private key each): ``coordinator``, ``client``, ``operator``
and ``participant-<name>``. Who may sign what (:func:`allowed_signers`):

============================  ==========================================
record                        signed by
============================  ==========================================
request                       ``client`` or ``operator``
abort                         ``client`` or ``operator`` (``aborters``)
resolve                       ``operator``
step event of participant P   ``participant-P`` (``compensated``: also ``coordinator``)
announcement of P             ``participant-P`` (a tombstone: also ``operator``)
decision, status, dead letter ``coordinator``
============================  ==========================================

The key folder holds ``<principal>.key`` (a private key, mode 0600: in
production a host's folder holds only its own) and ``<key id>.pub`` files (every
principal's public keys). A key id is ``<principal>.<first 8 bytes of the public
key's SHA-256, hex>``. Rotation: a new key pair for a principal replaces its
``.key`` and adds a ``.pub``; records signed with the old key stay valid until
its ``.pub`` is removed (``saga keys retire``).

Headers: ``saga.kid`` (the key id, UTF-8) and ``saga.sig`` (64 bytes). What a
record's signature covers (:func:`signed_bytes`) is the topic name, the key, the
value (a tombstone is signed as such) and every other header but
``saga.replayed.*`` (what ``saga reconcile --replay`` adds to the copy it
re-publishes), sorted by name, each length-prefixed, so no part of a record can
be moved to another record, another topic or another deployment's prefix
without the signature failing. A signed record can be written again as it is (a
replay); every reader is idempotent, so a copy changes nothing.

Two forms, both accepted by every reader: a record signed alone
(:meth:`Keyring.sign`: ``saga.sig`` is the Ed25519 signature of that content),
and a record signed in a batch (:meth:`Keyring.sign_batch`, what a
:class:`~streams._signed_log.SignedLog` producer does with the records of one
transaction or flush): ``saga.sig`` signs the root of a hash tree over the
batch's contents and ``saga.proof`` places the record in it (see
:mod:`streams._merkle`). Either way a record is checked alone, and only the
holder of the private key can make it pass. A verdict on a batch's signature is
kept (:data:`VERDICTS_KEPT`), so a reader pays one Ed25519 verification per
batch, not per record.

Cost (libsodium through PyNaCl, on the 2-core machine of the README): about
25 µs to sign and 60 µs to verify one signature; about 5 µs per record to hash
it into or out of a batch. See ``docs/signing-performance.md`` for what it costs
per saga and process.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from saga.streams._errors import ConfigurationError
from saga.streams._merkle import batch_message, leaf_hash, root_of, tree
from saga.streams._records import (
    ParticipantAnnouncement,
    Record,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    StepEvent,
    StepsCommitted,
    StepStatus,
)

HEADER_KEY_ID: Final = "saga.kid"
HEADER_SIGNATURE: Final = "saga.sig"
HEADER_PROOF: Final = "saga.proof"
"""A batch-signed record's place in its batch (see :mod:`streams._merkle`)."""
_SIGNATURE_HEADERS: Final = frozenset({HEADER_KEY_ID, HEADER_SIGNATURE, HEADER_PROOF})
# Annotations a tool may add to a signed record it copies (``saga reconcile --replay``
# re-publishes the original record, signature included): not covered by signatures.
UNSIGNED_HEADER_PREFIX: Final = "saga.replayed."
_DOMAIN: Final = b"saga-record-signature-v1\x00"
_ABSENT: Final = b"\xff\xff\xff\xff"  # never the length of real bytes
NODES_KEPT: Final = 16_384
"""Inner nodes of batch trees a keyring keeps (about 3 MB, some 500 batches of 32): a
record's path mostly meets those of its batch's records read before it, so it costs
about one hash, not five."""
VERDICTS_KEPT: Final = 4096
"""Batch signatures a keyring remembers having verified (each vouches for one root, of up
to a batch of records): tens of seconds of a busy process's reading, about 1 MB."""

COORDINATOR: Final = "coordinator"
CLIENT: Final = "client"
OPERATOR: Final = "operator"
PARTICIPANT_PREFIX: Final = "participant-"


def participant_principal(name: str) -> str:
    """The principal of participant ``name``: ``participant-<name>``."""
    return f"{PARTICIPANT_PREFIX}{name}"


def check_principal(principal: str) -> str:
    """``principal`` if it is a well-formed principal name, else ConfigurationError."""
    if principal in (COORDINATOR, CLIENT, OPERATOR):
        return principal
    name = principal.removeprefix(PARTICIPANT_PREFIX)
    if (
        principal.startswith(PARTICIPANT_PREFIX)
        and name
        and all(c.isalnum() or c in "_-" for c in name)
    ):
        return principal
    raise ConfigurationError(
        f"{principal!r} is not a principal: use coordinator, client, operator or "
        "participant-<name> (letters, digits, '_' and '-')"
    )


def allowed_signers(
    record: Record, *, aborters: frozenset[str] = frozenset({CLIENT, OPERATOR})
) -> frozenset[str]:
    """The principals whose signature makes ``record`` acceptable."""
    if isinstance(record, SagaRequest):
        return frozenset({CLIENT, OPERATOR})
    if isinstance(record, SagaAbort):
        return aborters
    if isinstance(record, SagaResolve):
        return frozenset({OPERATOR})
    if isinstance(record, StepEvent):
        if record.status is StepStatus.COMPENSATED:
            # The coordinator reports a step of a participant that never announced itself
            # as compensated (nothing to undo), so that its sequential predecessor, which
            # waits for that event, compensates. It could roll the saga back anyway.
            return frozenset({participant_principal(record.participant), COORDINATOR})
        return frozenset({participant_principal(record.participant)})
    if isinstance(record, StepsCommitted):
        return frozenset({participant_principal(record.participant)})
    if isinstance(record, ParticipantAnnouncement):
        return frozenset({participant_principal(record.name)})
    return frozenset({COORDINATOR})


def key_id(principal: str, public: bytes) -> str:
    """The id of ``principal``'s public key ``public`` (32 bytes)."""
    return f"{principal}.{hashlib.sha256(public).hexdigest()[:16]}"


def signed_bytes(
    topic: str,
    key: str | bytes | None,
    value: bytes | None,
    headers: Iterable[tuple[str, bytes | str | None]],
) -> bytes:
    """What a record's signature covers (see the module docstring)."""
    # Read for every record signed or checked: built in one join, no per-field packing.
    name = topic.encode()
    parts = [_DOMAIN, len(name).to_bytes(4, "big"), name]
    for data in (key.encode() if isinstance(key, str) else key, value):
        if data is None:  # 0xFFFFFFFF marks "absent" (a null key, a tombstone)
            parts.append(_ABSENT)
        else:
            parts += (len(data).to_bytes(4, "big"), data)
    kept: list[tuple[str, bytes]] = []
    for header, given in headers:
        if header in _SIGNATURE_HEADERS or header.startswith(UNSIGNED_HEADER_PREFIX):
            continue
        kept.append((header, given if given.__class__ is bytes else _as_bytes(given) or b""))
    kept.sort()
    for header, header_value in kept:
        name = header.encode()
        parts += (len(name).to_bytes(4, "big"), name, len(header_value).to_bytes(4, "big"))
        parts.append(header_value)
    return b"".join(parts)


def _as_bytes(data: str | bytes | None) -> bytes | None:
    return data.encode() if isinstance(data, str) else data


@dataclass(frozen=True, slots=True)
class PublicKey:
    principal: str
    kid: str
    key: VerifyKey


class Keyring:
    """One process's private key (if it signs) and everyone's public keys.

    :meth:`load` reads a key folder; :meth:`sign` and :meth:`sign_batch` return the
    headers to send with records; :meth:`check` says why a record is not
    acceptable, or ``None``. Safe to share between threads.
    """

    def __init__(
        self,
        public_keys: Iterable[PublicKey],
        *,
        principal: str | None = None,
        private: SigningKey | None = None,
    ) -> None:
        self._public = {k.kid: k for k in public_keys}
        self.principal = principal
        self._private = private
        self._kid: bytes | None = None
        if private is not None:
            if principal is None:
                raise ConfigurationError("a private key needs its principal")
            self._kid = key_id(principal, bytes(private.verify_key)).encode()
        # Digests of what this keyring signed lately (see remember_own), oldest first. An
        # OrderedDict: dropping a plain dict's first key scans the slots freed before it.
        self._own: OrderedDict[bytes, None] | None = None
        self._own_limit = 0
        # Batch signatures verified here: signature -> (key id, signed message).
        self._verdicts: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        # Inner nodes of batch trees folded here lately (see streams._merkle.root_of).
        self._nodes: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    @classmethod
    def load(cls, directory: str | os.PathLike[str], principal: str | None = None) -> Keyring:
        """Everyone's public keys from ``directory``, and ``principal``'s private key.

        ``principal=None`` loads no private key (a process that only verifies).
        """
        folder = Path(directory)
        if not folder.is_dir():
            raise ConfigurationError(
                f"the key folder {folder} does not exist: create it with `saga keys create`"
            )
        public = [_read_public(path) for path in sorted(folder.glob("*.pub"))]
        if not public:
            raise ConfigurationError(
                f"the key folder {folder} holds no public key: create them with `saga keys create`"
            )
        private: SigningKey | None = None
        if principal is not None:
            check_principal(principal)
            path = folder / f"{principal}.key"
            if not path.exists():
                raise ConfigurationError(
                    f"no private key for {principal} in {folder}: create one with "
                    f"`saga keys create --dir {folder} ...`"
                )
            private = _read_private(path, principal)
        return cls(public, principal=principal, private=private)

    def remember_own(self, limit: int) -> None:
        """Recognise the last ``limit`` signatures made here without verifying them.

        For a process that reads back what it wrote (the coordinator screens its own
        decisions and status records): a record whose signed content (or, signed in
        a batch, whose batch root) and signature are those of a signature made here
        is accepted on a 16-byte digest, not an Ed25519 verification, which is what
        that verification would say. Anything else, a record of this key not in the
        memory included, is verified. A batch's signature counts once.
        """
        self._own = OrderedDict()
        self._own_limit = max(1, limit)

    def _digest(self, content: bytes, signature: bytes) -> bytes:
        return hashlib.blake2b(content + signature, digest_size=16).digest()

    def _remember(self, content: bytes, signature: bytes) -> None:
        own = self._own
        if own is None:
            return
        with self._lock:
            own[self._digest(content, signature)] = None
            if len(own) > self._own_limit:
                own.popitem(last=False)

    @property
    def signs(self) -> bool:
        """Whether this keyring holds a private key."""
        return self._private is not None

    def principals(self) -> frozenset[str]:
        """The principals with at least one public key."""
        return frozenset(k.principal for k in self._public.values())

    def _signing_key(self) -> tuple[SigningKey, bytes]:
        if self._private is None or self._kid is None:
            raise ConfigurationError("this process has no private key to sign with")
        return self._private, self._kid

    def sign(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None = None,
    ) -> list[tuple[str, bytes]]:
        """``headers`` plus the key id and the signature of the record (signed alone)."""
        private, kid = self._signing_key()
        own = [(n, v) for n, v in (headers or ()) if n not in _SIGNATURE_HEADERS]
        content = signed_bytes(topic, key, value, own)
        signature = private.sign(content).signature
        self._remember(content, signature)
        return [*own, (HEADER_KEY_ID, kid), (HEADER_SIGNATURE, signature)]

    def sign_batch(
        self,
        records: Sequence[
            tuple[str, str | bytes | None, bytes | None, Sequence[tuple[str, bytes]] | None]
        ],
    ) -> list[list[tuple[str, bytes]]]:
        """The headers of each ``(topic, key, value, headers)`` record, signed as one batch.

        One Ed25519 signature for all of them (up to :data:`streams._merkle.MAX_LEAVES`);
        each record is still checked alone (:meth:`check`). A single record is
        signed alone, as :meth:`sign` does.
        """
        if len(records) <= 1:
            return [self.sign(*record) for record in records]
        private, kid = self._signing_key()
        owns = [[(n, v) for n, v in (h or ()) if n not in _SIGNATURE_HEADERS] for *_, h in records]
        leaves = [
            leaf_hash(signed_bytes(topic, key, value, own))
            for (topic, key, value, _), own in zip(records, owns, strict=True)
        ]
        root, proofs = tree(leaves)
        message = batch_message(len(leaves), root)
        signature = private.sign(message).signature
        self._remember(message, signature)
        return [
            [*own, (HEADER_KEY_ID, kid), (HEADER_SIGNATURE, signature), (HEADER_PROOF, proof)]
            for own, proof in zip(owns, proofs, strict=True)
        ]

    def signer(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]],
    ) -> str:
        """The principal whose valid signature the record carries; else ValueError(reason)."""
        kid: bytes | None = None
        signature: bytes | None = None
        proof: bytes | None = None
        for name, header_value in headers:
            if name == HEADER_KEY_ID:
                kid = header_value
            elif name == HEADER_SIGNATURE:
                signature = header_value
            elif name == HEADER_PROOF:
                proof = header_value
        if kid is None or signature is None:
            raise ValueError("record is not signed")
        public = self._public.get(kid.decode("utf-8", "replace"))
        if public is None:
            raise ValueError(f"record is signed with an unknown key {kid[:80]!r}")
        message = signed_bytes(topic, key, value, headers)
        if proof is not None:
            nodes = self._nodes
            try:
                message = batch_message(*root_of(leaf_hash(message), proof, nodes))
            except ValueError:
                raise ValueError(f"record's signature by {public.principal} is not valid") from None
            if len(nodes) > NODES_KEPT:
                with self._lock:  # the oldest half goes
                    for stale in list(itertools.islice(nodes, len(nodes) - NODES_KEPT // 2)):
                        nodes.pop(stale, None)
            if self._verdicts.get(signature) == (kid, message):
                # This batch's signature of this very root was verified here: the verdict
                # is the one a verification would give (Ed25519 is deterministic).
                return public.principal
        if (
            self._own is None
            or kid != self._kid
            or self._digest(message, signature) not in self._own
        ):
            try:
                public.key.verify(message, signature)
            except (BadSignatureError, ValueError, TypeError):
                raise ValueError(f"record's signature by {public.principal} is not valid") from None
        # else: signed here, content (or batch root) and signature unchanged
        if proof is not None:
            with self._lock:
                verdicts = self._verdicts
                verdicts[signature] = (kid, message)
                if len(verdicts) > VERDICTS_KEPT:
                    verdicts.popitem(last=False)
        return public.principal

    def check(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]],
        allowed: frozenset[str],
    ) -> str | None:
        """Why the record may not be acted on (one sentence), or ``None``: it may."""
        try:
            who = self.signer(topic, key, value, headers)
        except ValueError as exc:
            return f"{exc}: expected a signature by {_either(allowed)}"
        if who not in allowed:
            return f"record is signed by {who}, not by {_either(allowed)}"
        return None


def _either(principals: frozenset[str]) -> str:
    names = sorted(principals)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


# ------------------------------------------------------------------ key files


def _read_public(path: Path) -> PublicKey:
    try:
        data = json.loads(path.read_text())
        principal = check_principal(str(data["principal"]))
        raw = base64.b64decode(data["public"], validate=True)
        key = VerifyKey(raw)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(f"{path} is not a saga public key file: {exc}") from None
    return PublicKey(principal, key_id(principal, raw), key)


def _read_private(path: Path, principal: str) -> SigningKey:
    try:
        data = json.loads(path.read_text())
        if data["principal"] != principal:
            raise ValueError(f"it holds the key of {data['principal']}")
        return SigningKey(base64.b64decode(data["seed"], validate=True))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(f"{path} is not {principal}'s private key file: {exc}") from None


def create_key(directory: str | os.PathLike[str], principal: str) -> str:
    """Make a new key pair for ``principal`` in ``directory``; returns its key id.

    The private key replaces ``<principal>.key`` (mode 0600); the public key is
    added as ``<key id>.pub``, next to the principal's older ones (rotation).
    """
    check_principal(principal)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    private = SigningKey.generate()
    public = bytes(private.verify_key)
    kid = key_id(principal, public)
    seed = base64.b64encode(bytes(private)).decode()
    path = folder / f"{principal}.key"
    tmp = folder / f".{principal}.key.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"principal": principal, "kid": kid, "seed": seed}, out)
        out.write("\n")
    os.replace(tmp, path)
    pub = {"principal": principal, "kid": kid, "public": base64.b64encode(public).decode()}
    (folder / f"{kid}.pub").write_text(json.dumps(pub) + "\n")
    return kid


def retire_key(directory: str | os.PathLike[str], kid: str) -> None:
    """Remove public key ``kid``: records signed with it are no longer accepted."""
    principal, _, digest = kid.rpartition(".")
    try:
        check_principal(principal)
        bytes.fromhex(digest)
    except (ConfigurationError, ValueError):
        raise ConfigurationError(
            f"{kid!r} is not a key id (<principal>.<16 hex digits>; see `saga keys list`)"
        ) from None
    path = Path(directory) / f"{kid}.pub"
    if not path.exists():
        raise ConfigurationError(f"there is no public key {kid} in {directory}")
    path.unlink()
