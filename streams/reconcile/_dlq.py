"""I6: every record on the dead-letter topic was rightly rejected.

The DLQ is small (it holds only rejected records), so its records are judged in
this process with the project's own decoder (:func:`streams.decode_as`, the
JSON Schemas themselves), not with the JVM-side approximation the main log
needs for speed.

A dead letter was rightly rejected when it

* is an excerpt (header ``saga.truncated``, or a ``saga.source.key.length`` plus
  ``saga.source.value.length`` over :data:`~streams._limits.MAX_RECORD_BYTES`):
  the original was over the size limit, whatever its first bytes decode to (a
  valid object followed by a megabyte of blanks decodes fine when cut), or
* is itself, key and value together, over that limit, or
* does not decode as a record of its source topic (header
  ``saga.source.topic``), or
* is keyed by something other than its ``tx_id``, or
* was on a partition other than the one murmur2 gives its key (its transaction's
  other records are elsewhere), or is a ``saga.committed`` that lists a ``tx_id``
  of another partition than its own (the coordinator acts on none of its steps), or
* is a request whose deadline had passed when it was rejected
  (``saga.rejected.at_ms``): the coordinator rejects a request whose deadline
  passed more than its retention ago as expired, and such a request can never be
  applied anyway, or
* is a request whose transaction already had a different first request (a
  conflicting resubmission), or
* is an abort of a transaction that has a decision.

Any other dead letter is a valid record that was wrongly rejected: an I6
violation, reported on its transaction (a ``saga.committed``: on each transaction
it lists, whose ``committed`` acknowledgement it carried).

The first two count as ``invalid`` (the record does not decode), like the third.

With a key folder (signed records, :mod:`streams._signing`), also when it

* names a source record that is not signed by a principal allowed to write it
  (the coordinator's reason for it, checked again here on the original read
  from the log; when retention took the original, the coordinator's signed
  ``saga.error`` says so): ``unauthenticated``.

and a dead letter the coordinator did not sign is ``forged``: it is not judged,
and no record is left out of the audit on its word.

:func:`rejected_at` gives the other use of the DLQ: where the coordinator's
rejected records sit in the log, so that the audit leaves them out
(:mod:`._audit`, "Validity").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from saga.streams._codec import decode, decode_as
from saga.streams._errors import InvalidRecord
from saga.streams._limits import MAX_RECORD_BYTES
from saga.streams._records import (
    Decision,
    Record,
    SagaAbort,
    SagaRequest,
    SagaResolve,
    SagaStatus,
    StepEvent,
    StepsCommitted,
    TxRecord,
)
from saga.streams._topics import Topics
from saga.streams.kafka import partition_for
from saga.streams.reconcile._signatures import Verifier
from saga.streams.reconcile._spark import Original

__all__ = ["COORDINATOR", "DeadLetter", "DlqVerdict", "TxFacts", "judge", "rejected_at"]

COORDINATOR: Final = "coordinator"
"""``saga.component`` of the coordinator's dead letters."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One record of the DLQ: its bytes and headers as read."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Mapping[str, bytes] = field(default_factory=dict)
    header_list: tuple[tuple[str, bytes], ...] = ()
    """The headers in order, duplicates included (what a signature covers)."""

    def header(self, name: str) -> str | None:
        raw = self.headers.get(name)
        return raw.decode("utf-8", "replace") if raw is not None else None

    def int_header(self, name: str) -> int | None:
        text = self.header(name)
        if text is None or not text.isascii():
            return None
        try:
            return int(text)
        except ValueError:
            return None

    @property
    def source(self) -> tuple[str, int, int] | None:
        """``(topic, partition, offset)`` of the rejected record, when the headers say."""
        topic = self.header("saga.source.topic")
        partition = self.int_header("saga.source.partition")
        offset = self.int_header("saga.source.offset")
        if topic is None or partition is None or offset is None:
            return None
        return (topic, partition, offset)

    @property
    def oversized(self) -> bool:
        """The rejected record was over :data:`~streams._limits.MAX_RECORD_BYTES`: the
        letter is an excerpt (``saga.truncated``, or the source lengths say so), or is
        itself that large."""
        if self.header("saga.truncated") == "1":
            return True
        key_length = self.int_header("saga.source.key.length") or 0
        value_length = self.int_header("saga.source.value.length") or 0
        if key_length + value_length > MAX_RECORD_BYTES:
            return True
        return len(self.key or b"") + len(self.value or b"") > MAX_RECORD_BYTES


@dataclass(frozen=True, slots=True)
class TxFacts:
    """What the main audit knows of a transaction a valid dead letter names."""

    decided: bool
    first_request: SagaRequest | None
    first_request_offset: int | None


@dataclass
class DlqVerdict:
    """The DLQ's counts and the I6 findings per transaction."""

    records: int = 0
    invalid: int = 0
    justified: int = 0
    forged: int = 0
    unauthenticated: int = 0
    wrongly_rejected: int = 0
    """Dead letters of valid records (one finding on each transaction they are about)."""
    by_component: Counter[str] = field(default_factory=Counter)
    findings: dict[str, list[str]] = field(default_factory=dict)

    @property
    def violations(self) -> int:
        """The wrongly rejected dead letters."""
        return self.wrongly_rejected


def _kinds(topics: Topics, source: str | None) -> tuple[type[Record], ...] | None:
    if source == topics.requests:
        return (SagaRequest, SagaAbort, SagaResolve)
    if source == topics.events:
        return (StepEvent, StepsCommitted)
    if source == topics.decisions:
        return (Decision,)
    if source == topics.status:
        return (SagaStatus,)
    return None


Originals = Callable[[set[tuple[str, int, int]]], Mapping[tuple[str, int, int], Original]]
"""Reads the records at ``(topic, partition, offset)`` from the log (those still there)."""

_SIGNATURE_REASONS: Final = ("record is not signed", "record is signed ", "record's signature ")
"""How the coordinator's reasons for refusing a record for its signature begin
(:meth:`streams._signing.Keyring.check`)."""


def signed_by_coordinator(letter: DeadLetter, topics: Topics, verifier: Verifier | None) -> bool:
    """Whether the coordinator signed ``letter`` (always true without a key folder)."""
    return verifier is None or verifier.by_coordinator(
        topics.dlq, letter.key, letter.value, letter.header_list
    )


def judge(
    letters: Iterable[DeadLetter],
    topics: Topics,
    facts: Callable[[set[str]], Mapping[str, TxFacts]],
    *,
    partitions: int | None = None,
    verifier: Verifier | None = None,
    originals: Originals | None = None,
) -> DlqVerdict:
    """Judge every dead letter; ``facts`` answers for the transactions of valid ones.

    ``partitions`` is the topics' partition count (for the partition rule; without
    it, that rule is not applied). ``verifier`` (a key folder's) and ``originals``
    (how to read the rejected records) turn the signature rules on.
    """
    verdict = DlqVerdict()
    candidates: list[tuple[DeadLetter, TxRecord]] = []
    for letter in letters:
        verdict.records += 1
        verdict.by_component[letter.header("saga.component") or "unknown"] += 1
        if not signed_by_coordinator(letter, topics, verifier):
            verdict.forged += 1
            continue
        if letter.oversized:
            verdict.invalid += 1  # over the size limit, whatever its excerpt decodes to
            continue
        source = letter.header("saga.source.topic")
        kinds = _kinds(topics, source)
        try:
            record = decode(letter.value) if kinds is None else decode_as(letter.value, *kinds)
        except InvalidRecord:
            verdict.invalid += 1
            continue
        if not isinstance(record, TxRecord):  # an announcement: no transaction's business
            verdict.justified += 1
            continue
        key = letter.key.decode("utf-8", "replace") if letter.key is not None else None
        misplaced = _misplaced(letter, partitions, record)
        if key != record.tx_id or misplaced or _expired(letter, record):
            verdict.justified += 1
            continue
        candidates.append((letter, record))
    if verifier is not None and candidates:
        candidates = _authenticated(candidates, verifier, originals, verdict)
    if not candidates:
        return verdict

    known = facts({record.tx_id for _, record in candidates})
    for letter, record in candidates:
        tx = known.get(record.tx_id)
        why = _wrongly_rejected(letter, record, tx)
        if why is None:
            verdict.justified += 1
        else:
            verdict.wrongly_rejected += 1
            for tx_id in _transactions(record):
                verdict.findings.setdefault(tx_id, []).append(why)
    return verdict


def _authenticated(
    candidates: list[tuple[DeadLetter, TxRecord]],
    verifier: Verifier,
    originals: Originals | None,
    verdict: DlqVerdict,
) -> list[tuple[DeadLetter, TxRecord]]:
    """The candidates whose rejected record was signed by one allowed to write it; the
    others are counted justified (``unauthenticated``)."""
    wanted = {letter.source for letter, _ in candidates if letter.source is not None}
    found = originals({w for w in wanted if w is not None}) if originals and wanted else {}
    kept: list[tuple[DeadLetter, TxRecord]] = []
    for letter, record in candidates:
        source = letter.source
        original = found.get(source) if source is not None else None
        if original is not None and source is not None:
            key, value, headers = original
            ok = verifier.record_ok(source[0], key, value, headers, record)
        else:  # gone from the log: the coordinator's signed reason stands
            ok = not (letter.header("saga.error") or "").startswith(_SIGNATURE_REASONS)
        if ok:
            kept.append((letter, record))
        else:
            verdict.justified += 1
            verdict.unauthenticated += 1
    return kept


def _misplaced(letter: DeadLetter, partitions: int | None, record: TxRecord) -> bool:
    """The record was not on its key's partition, or (a ``saga.committed``) lists a
    ``tx_id`` that belongs on another partition than the one it was on."""
    source = letter.source
    if partitions is None or source is None or letter.key is None:
        return False
    if partition_for(letter.key, partitions) != source[1]:
        return True
    return any(partition_for(tx_id, partitions) != source[1] for tx_id in _transactions(record))


def _transactions(record: TxRecord) -> tuple[str, ...]:
    """The transactions ``record`` is about: a ``saga.committed``'s listed ones, in order
    and once each; any other record's ``tx_id``."""
    if isinstance(record, StepsCommitted):
        return tuple(dict.fromkeys(tx_id for tx_id, _ in record.steps))
    return (record.tx_id,)


def _expired(letter: DeadLetter, record: TxRecord) -> bool:
    rejected = letter.int_header("saga.rejected.at_ms")
    return (
        isinstance(record, SagaRequest)
        and (letter.header("saga.error") or "").startswith("request expired")
        and rejected is not None
        and record.deadline_ms < rejected
    )


def rejected_at(
    letters: Iterable[DeadLetter], topics: Topics, verifier: Verifier | None = None
) -> dict[str, set[tuple[int, int]]]:
    """``{topic: {(partition, offset)}}`` of the records of requests, events and decisions
    the coordinator rejected, from its dead letters' ``saga.source.*`` headers.

    Only letters whose ``saga.component`` is the coordinator count: it is the one
    consumer that reads those three topics whole and the one writer of their
    dead letters. Letters without readable coordinates are left out, and with a
    key folder (``verifier``) those the coordinator did not sign.
    """
    audited = (topics.requests, topics.events, topics.decisions)
    found: dict[str, set[tuple[int, int]]] = {}
    for letter in letters:
        if letter.header("saga.component") != COORDINATOR:
            continue
        if not signed_by_coordinator(letter, topics, verifier):
            continue
        source = letter.source
        if source is not None and source[0] in audited:
            found.setdefault(source[0], set()).add((source[1], source[2]))
    return found


def _wrongly_rejected(letter: DeadLetter, record: TxRecord, tx: TxFacts | None) -> str | None:
    """Why a valid dead letter should not be there, or ``None`` when it rightly is."""
    where = (
        f"{letter.header('saga.source.topic') or 'an unknown topic'}"
        f"[{letter.header('saga.source.partition') or '?'}]"
        f"@{letter.header('saga.source.offset') or '?'}"
    )
    said = letter.header("saga.error") or "no reason given"
    if isinstance(record, SagaRequest) and tx is not None and tx.first_request is not None:
        same_record = str(tx.first_request_offset) == letter.header("saga.source.offset")
        if not same_record and tx.first_request.fingerprint() != record.fingerprint():
            return None  # a conflicting resubmission: rightly rejected
    if isinstance(record, SagaAbort) and tx is not None and tx.decided:
        return None  # an abort after the decision: rightly rejected
    if isinstance(record, SagaResolve):
        return None  # the coordinator rejects only a resolve of no failed compensation
    return (
        f"a valid {record.TYPE} from {where} is on the dead-letter topic "
        f"(rejected with: {said[:200]})"
    )
