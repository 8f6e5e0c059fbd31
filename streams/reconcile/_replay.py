"""Replaying stuck sagas: re-publish what is already in the log, never anything new.

* ``stuck_no_decision``: the transaction's first request, byte for byte, on the
  requests topic. The coordinator ignores a request it has seen (same
  fingerprint) and decides one it has not (commit if every step is applied,
  else rollback: the deadline has passed).
* ``stuck_unfinished``: the transaction's first decision, byte for byte, on the
  decisions topic; participants act on it once (the ledger) and report again.
  When a step never answered at all, its participant may have missed the
  request too, and a rollback alone would only close the transaction there
  without a report: the request is re-sent as well, but only once the deadline
  has passed, when a participant can no longer apply it (it reports ``failed``
  or, after the rollback, ``compensated``).

Only records the codec accepts, on their key's partition, are re-published
(:func:`replayable`): the audit may see as stuck a hostile record the coordinator
has not read yet. Each goes out with its original headers, its signature
(``saga.kid``, ``saga.sig``) included, plus ``saga.replayed.by`` (outside the
signature, :mod:`streams._signing`): a replayed signed record is as valid as the
original. With a key folder, a record whose signature does not hold is never
re-published. Decisions go out (and are acknowledged) before requests. Records are produced
through :class:`streams.kafka.Producer` (murmur2, like every saga producer), so
each lands on its transaction's partition. Replaying twice, or again after the
job was killed half-way, re-sends only what is still stuck, and each consumer
takes a repeat as a no-op.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from saga.streams._codec import decode_keyed
from saga.streams._errors import InvalidRecord
from saga.streams._records import Decision, SagaRequest
from saga.streams._signing import UNSIGNED_HEADER_PREFIX
from saga.streams.kafka import Consumer, KafkaSettings, Producer, partition_for
from saga.streams.reconcile._signatures import Verifier
from saga.streams.reconcile._spark import Original

__all__ = ["REPLAYED_BY", "Resend", "plan_resends", "replay_headers", "send"]

REPLAYED_BY = "saga.replayed.by"

Kind = Literal["request", "decision"]


@dataclass(frozen=True, slots=True)
class Resend:
    """One record to re-publish: which transaction, what, and where the original is."""

    tx_id: str
    kind: Kind
    topic: str
    partition: int
    offset: int
    why: str

    def to_json(self, sent: bool) -> dict[str, object]:
        return {
            "tx_id": self.tx_id,
            "kind": self.kind,
            "topic": self.topic,
            "original": f"{self.topic}[{self.partition}]@{self.offset}",
            "why": self.why,
            "sent": sent,
        }


def plan_resends(
    rows: Iterable[Mapping[str, Any]], *, requests_topic: str, decisions_topic: str
) -> list[Resend]:
    """The records to re-publish, decisions first, from classified transactions.

    ``rows`` carry ``tx_id``, ``class``, ``replay`` (``request``, ``decision`` or
    ``decision+request``: decided by :func:`._audit.classify`), and the
    positions of the first request and decision (``request_at``, ``decision_at``:
    ``{part, off}``).
    """
    decisions: list[Resend] = []
    requests: list[Resend] = []
    for row in rows:
        what = row.get("replay")
        if not what:
            continue
        tx, why = str(row["tx_id"]), str(row["class"])
        if "decision" in what:
            at = row["decision_at"]
            decisions.append(
                Resend(tx, "decision", decisions_topic, int(at["part"]), int(at["off"]), why)
            )
        if "request" in what:
            at = row["request_at"]
            requests.append(
                Resend(tx, "request", requests_topic, int(at["part"]), int(at["off"]), why)
            )
    return decisions + requests


def replay_headers(original: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The headers of a replayed copy: the original's (signature included, earlier
    ``saga.replayed.*`` annotations left out) and ``saga.replayed.by``."""
    kept = [(n, v) for n, v in original if not n.startswith(UNSIGNED_HEADER_PREFIX)]
    return [*kept, (REPLAYED_BY, b"reconcile")]


def replayable(
    r: Resend,
    key: bytes | None,
    value: bytes | None,
    partitions: int,
    *,
    headers: Sequence[tuple[str, bytes]] = (),
    verifier: Verifier | None = None,
) -> bool:
    """Whether the original record is one the coordinator accepts, by the codec itself
    (and, with ``verifier``, by its signature).

    The audit's Spark checks cannot see everything (nesting, numbers inside ``args``,
    the partition), and a record the coordinator has not read yet has no dead letter
    to tell: re-published, a request sent to another partition than its key's would
    land on its key's and become a real transaction. So every record is checked here
    with :func:`~streams._codec.decode_keyed` and its partition before it is sent.
    """
    kinds = (SagaRequest,) if r.kind == "request" else (Decision,)
    try:
        record = decode_keyed(key, value, *kinds)
    except InvalidRecord:
        return False
    if verifier is not None and not verifier.record_ok(r.topic, key, value, headers, record):
        return False
    return key is not None and partition_for(key, partitions) == r.partition


def _partition_count(settings: KafkaSettings) -> int:
    reader = Consumer(settings, group_id=None, client_id=f"{settings.prefix}.reconcile.replay")
    try:
        return reader.list_partitions(settings.topics.requests)
    finally:
        reader.close()


def send(
    settings: KafkaSettings,
    resends: list[Resend],
    records: Mapping[tuple[str, int, int], Original],
    *,
    rate: float | None,
    progress: Callable[[int, int], None],
    verifier: Verifier | None = None,
) -> list[bool]:
    """Produce each resend's original key, value and headers; returns which were
    acknowledged (``verifier``: a key folder's, see :func:`replayable`).

    With ``rate`` (records per second) each record is sent and acknowledged before
    the next, at that pace; otherwise the decisions, then the requests, are
    sent in one batch each. ``progress(done, total)`` is called as records are
    acknowledged.
    """
    sent = [False] * len(resends)
    total = len(resends)
    producer = Producer(settings, client_id=f"{settings.prefix}.reconcile")
    partitions = _partition_count(settings)
    try:
        done = 0
        interval = 1.0 / rate if rate else 0.0
        next_at = time.monotonic()
        for phase in ("decision", "request"):
            batch = [i for i, r in enumerate(resends) if r.kind == phase]
            for i in batch:
                r = resends[i]
                original = records.get((r.topic, r.partition, r.offset))
                if original is None or original[1] is None:
                    continue  # gone (retention) since the audit read it
                key, value, headers = original
                if not replayable(r, key, value, partitions, headers=headers, verifier=verifier):
                    continue  # the coordinator will reject it (or has): never re-publish it
                if rate:
                    pause = next_at - time.monotonic()
                    if pause > 0:
                        time.sleep(pause)
                    next_at = max(next_at, time.monotonic()) + interval
                producer.produce(
                    r.topic,
                    key if key is not None else r.tx_id,
                    value,
                    headers=replay_headers(headers),
                )
                if rate:
                    producer.flush(30)
                    sent[i] = True
                    done += 1
                    progress(done, total)
            if not rate and batch:
                producer.flush(60)
                for i in batch:
                    key_of = (resends[i].topic, resends[i].partition, resends[i].offset)
                    original = records.get(key_of)
                    sent[i] = original is not None and replayable(
                        resends[i],
                        original[0],
                        original[1],
                        partitions,
                        headers=original[2],
                        verifier=verifier,
                    )
                done = sum(sent)
                progress(done, total)
    finally:
        producer.close()
    return sent
