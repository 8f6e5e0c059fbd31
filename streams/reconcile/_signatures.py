"""Signed records in the audit: who wrote each record, checked in Spark, once per key.

With a key folder (``--keys-dir`` / ``SAGA_KEYS_DIR``) a record counts only when it
carries a valid signature (:mod:`streams._signing`) of a principal allowed to
write it: requests and aborts ``client`` or ``operator``, a step event or a
``saga.committed`` of participant P ``participant-P``, a decision ``coordinator``.
Any other record is ``invalid``, exactly like one that breaks the wire contract:
left out of the audit, never stuck, never replayed.

How it runs: the public key files (never a private key) are broadcast once; a
Python UDF gives each record's signer (``NULL``: unsigned, unknown key or bad
signature) and the SQL of :mod:`._parse` compares it with the principals allowed
for the record. Each Python worker builds the keyring from the broadcast once and
keeps it, so a record costs one Ed25519 verification (about 55 µs).

The dead letters are few and are checked here in the driver (:class:`Verifier`).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

from saga.streams._errors import ConfigurationError
from saga.streams._records import Record
from saga.streams._signing import COORDINATOR, Keyring, allowed_signers
from saga.streams.reconcile._spark import ReconcileError

__all__ = [
    "REQUEST_SIGNERS",
    "SignerColumn",
    "Verifier",
    "signer_column",
]

REQUEST_SIGNERS: Final = ("client", "operator")
"""Who may write requests and aborts (the coordinator's default aborters)."""

SignerColumn = Callable[[Any, Any, Any, Any], Any]
"""``(topic, key, value, headers) -> Column``: the record's valid signer, or NULL."""

# One keyring per key set per Python worker: built on the first record, kept.
_RINGS: dict[str, Keyring] = {}


def public_key_files(folder: Path) -> list[tuple[str, str]]:
    """``(file name, text)`` of every public key of ``folder``, checked by loading them.

    Raises:
        ReconcileError: the folder is missing, holds no public key, or a bad one.
    """
    try:
        Keyring.load(folder)
        return [(p.name, p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.pub"))]
    except ConfigurationError as exc:
        raise ReconcileError(f"--keys-dir: {exc}") from None
    except OSError as exc:
        raise ReconcileError(f"--keys-dir: cannot read {folder}: {exc.strerror}") from None


def _ring(digest: str, broadcast: Any) -> Keyring:
    """The keyring of the broadcast public key files (``digest`` names the set)."""
    ring = _RINGS.get(digest)
    if ring is None:
        with tempfile.TemporaryDirectory(prefix="saga-keys-") as folder:
            for name, text in broadcast.value:
                (Path(folder) / name).write_text(text, encoding="utf-8")
            ring = Keyring.load(folder)
        _RINGS[digest] = ring
    return ring


def _headers(raw: Iterable[Any] | None) -> list[tuple[str, bytes]]:
    return [(str(h[0]), bytes(h[1]) if h[1] is not None else b"") for h in (raw or ())]


def _signer(
    digest: str,
    broadcast: Any,
    topic: str,
    key: Any,
    value: Any,
    headers: Sequence[Any] | None,
) -> str | None:
    try:
        return _ring(digest, broadcast).signer(
            topic,
            bytes(key) if key is not None else None,
            bytes(value) if value is not None else None,
            _headers(headers),
        )
    except ValueError:
        return None


def signer_column(spark: Any, files: list[tuple[str, str]]) -> SignerColumn:
    """A column factory: the principal whose valid signature a Kafka record carries."""
    from pyspark.sql import functions as F

    broadcast = spark.sparkContext.broadcast(files)
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()

    def signer(topic: str, key: Any, value: Any, headers: Any) -> str | None:
        return _signer(digest, broadcast, topic, key, value, headers)

    udf = F.udf(signer, "string")

    def column(topic: Any, key: Any, value: Any, headers: Any) -> Any:
        return udf(topic, key, value, headers)

    return column


class Verifier:
    """The driver's checks: dead letters and the records they name, replayed records."""

    def __init__(self, folder: Path) -> None:
        try:
            self.keys = Keyring.load(folder)
        except ConfigurationError as exc:
            raise ReconcileError(f"--keys-dir: {exc}") from None

    def signed_by(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]],
        allowed: frozenset[str],
    ) -> bool:
        return self.keys.check(topic, key, value, headers, allowed) is None

    def record_ok(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]],
        record: Record,
    ) -> bool:
        """Whether ``record`` (decoded from ``value``) is signed by one allowed to write it."""
        return self.signed_by(topic, key, value, headers, allowed_signers(record))

    def by_coordinator(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Sequence[tuple[str, bytes]],
    ) -> bool:
        return self.signed_by(topic, key, value, headers, frozenset({COORDINATOR}))
