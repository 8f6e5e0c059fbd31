"""One reconciliation run, start to finish.

1. Pre-flight (before Spark, so mistakes cost seconds): the jars folder, Kafka
   and every topic, every store named by ``--ledger`` / ``--table``.
2. Fix the offset range of each topic (the snapshot), start Spark.
3. Read the dead letters: the records of requests, events and decisions the
   coordinator rejected are invalid for the audit (:func:`._dlq.rejected_at`).
4. Read requests, events and decisions up to the snapshot, parse and fold them
   into one row per transaction (:mod:`._audit`); join the ledgers (I4).
5. Judge the dead letters (I6, :mod:`._dlq`) and classify every transaction.
6. Write ``findings/`` (Parquet), run the business checks, plan the replay,
   and with ``replay`` re-publish (:mod:`._replay`).
7. Write ``summary.json`` and ``replay.jsonl``.

``invalid_records`` in the summary counts, per topic, the records the audit
left out: those that fail its checks and those the coordinator rejected;
``invalid_explained`` counts those whose parse says why (a ``saga.committed``
listing a ``tx_id`` of another partition) and shows the first. ``records``
counts the records read (a ``saga.committed`` is one event record, however many
steps it lists; the findings' ``events`` count step events). With a
key folder (``keys_dir``) a record not signed by a principal allowed to write it
is one of them (:mod:`._signatures`); ``signatures`` in the summary counts those
apart, with the dead letters the coordinator did not sign (``dlq_forged``) and
those of records refused for their signature (``dlq_unauthenticated``).

Exit status: 0 clean (``in_flight`` allowed), 1 violations, early effects, stuck
sagas or a failed business check, 2 could not run (:class:`._spark.ReconcileError`).
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Any

from saga.streams._codec import decode_as
from saga.streams._errors import InvalidRecord
from saga.streams._records import SagaRequest
from saga.streams.reconcile import _audit, _dlq, _replay, _signatures, _sources
from saga.streams.reconcile._checks import run_checks
from saga.streams.reconcile._config import ReconcileConfig
from saga.streams.reconcile._operators import collect_actions
from saga.streams.reconcile._spark import (
    LogRange,
    Original,
    ReconcileError,
    check_jars,
    fetch_records,
    header_list,
    kafka_frame,
    snapshot_offsets,
    spark_boundary,
    start_spark,
    submitted,
)

__all__ = ["RunResult", "run"]

_STUCK = ("stuck_no_decision", "stuck_unfinished", "compensation_failed")
_BAD = ("violation", "early_effect", *_STUCK)
"""The classes that make a run exit 1."""
_OUTPUT_COLUMNS = (
    "tx_id",
    "class",
    "invariants",
    "reasons",
    "saga",
    "mode",
    "steps",
    "outcome",
    "outcomes",
    "requests",
    "decisions",
    "events",
    "created_ms",
    "deadline_ms",
    "decided_ms",
    "decision_reason",
    "unfinished_steps",
    "replay",
)


@dataclass
class RunResult:
    """The run's summary (also written as ``summary.json``), the rows shown, the resends."""

    summary: dict[str, Any]
    shown: list[dict[str, Any]] = field(default_factory=list)
    resends: list[tuple[_replay.Resend, bool]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        code: int = self.summary["exit_code"]
        return code


Progress = Callable[[str], None]


def run(
    config: ReconcileConfig,
    *,
    started: float | None = None,
    say: Progress = print,
    spark: Any = None,
) -> RunResult:
    """Run the audit (and the replay) described by ``config``.

    ``started`` is the ``time.monotonic()`` of the process start, for the wall
    time; ``say`` receives progress lines. ``spark``: a SparkSession to use (and
    leave running), e.g. one shared by tests; by default the run starts its own
    (with the jars of ``config.jars_dir``) and stops it at the end.

    Raises:
        ReconcileError: the job could not run (exit status 2); the message is one sentence.
    """
    t0 = started if started is not None else time.monotonic()
    topics = config.settings.topics
    as_of = config.as_of_ms()
    jars = []
    if spark is None and not submitted():
        if config.jars_dir is None:
            raise ReconcileError(
                "no Spark jars folder: pass --jars-dir or set SAGA_SPARK_JARS to the folder "
                "with spark-sql-kafka-0-10 (infra/services.sh provision fills one)"
            )
        jars = check_jars(config.jars_dir)
    log = snapshot_offsets(config, (topics.requests, topics.events, topics.decisions, topics.dlq))
    for ledger in config.ledgers:
        table = ledger.store.option("table", "saga_ledger") if ledger.store.kind == "sql" else None
        _sources.ping(ledger.store, table)
    for source in config.tables:
        _sources.ping(source.store)
    if config.keys_dir is not None:
        _signatures.public_key_files(config.keys_dir)  # a bad key folder fails before Spark
    try:
        config.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReconcileError(
            f"cannot create the output folder {config.out}: {exc.strerror}"
        ) from None

    own = spark is None
    # A local driver reads the ledgers itself, while the JVM starts (after the snapshot).
    early = own and not submitted() and (config.master or "local[*]").startswith("local")
    with (
        tempfile.TemporaryDirectory(prefix="saga-reconcile-") as folder,
        ThreadPoolExecutor(max_workers=max(1, len(config.ledgers))) as pool,
    ):
        scratch = Path(folder)
        sources = config.ledgers if early else ()
        reading = [pool.submit(_sources.read_ledger, source, scratch) for source in sources]
        if own:
            say("starting Spark")
            spark = start_spark(config, jars, offsets=sum(log.spans().values()))
        t_ready = time.monotonic()
        try:
            return _audit_and_replay(spark, config, log, as_of, t0, t_ready, say, scratch, reading)
        finally:
            if own and not submitted():
                spark.stop()


def _audit_and_replay(
    spark: Any,
    config: ReconcileConfig,
    log: LogRange,
    as_of: int,
    t0: float,
    t_ready: float,
    say: Progress,
    scratch: Path,
    reading: list[Future[_sources.LedgerFile]],
) -> RunResult:
    """The audit. ``scratch``: a folder for the ledger entries read here (it outlives the
    frames); ``reading``: the ledgers being read (none: read them here now)."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    topics = config.settings.topics
    window = config.since_ms is not None
    verifier: _signatures.Verifier | None = None
    signer: _signatures.SignerColumn | None = None
    if config.keys_dir is not None:
        verifier = _signatures.Verifier(config.keys_dir)
        signer = _signatures.signer_column(spark, _signatures.public_key_files(config.keys_dir))
        say(f"checking signatures against {len(verifier.keys.principals())} principal(s)")
    with spark_boundary("reading the dead-letter topic"):
        letters = _dead_letters(spark, config, log)
    rejected = _dlq.rejected_at(letters, topics, verifier)

    def read_topic(topic: str) -> tuple[Any, Any, Any]:
        """The topic's records in the range, where its rejected ones sit (or None), and
        the signature check (or None)."""
        # Headers always: signatures, and the redrive headers of the operator actions.
        frame = kafka_frame(spark, config, log, topic, config.since_ms, headers=True)
        at = rejected.get(topic)
        where = spark.createDataFrame(sorted(at), "partition INT, offset BIGINT") if at else None
        return frame, where, signer

    say(f"auditing {sum(log.spans().values())} offsets of {topics.prefix}.*")
    with spark_boundary("reading the log"):
        union = (
            _audit.parse_requests(*read_topic(topics.requests))
            .unionByName(
                _audit.parse_events(
                    *read_topic(topics.events),
                    partitions=len(log.ranges.get(topics.events, {})) or None,
                )
            )
            .unionByName(_audit.parse_decisions(*read_topic(topics.decisions)))
        )
        frame = _audit.per_transaction(
            union, as_of_ms=as_of, grace_ms=config.grace_ms, window=window
        )

    ledger_info: list[dict[str, Any]] = []
    ledgers: Any = None
    if config.ledgers:
        with spark_boundary("reading the ledgers"):
            done: list[_sources.LedgerFile | None] = [f.result() for f in reading]
            done = done or [None] * len(config.ledgers)
            read = [
                _sources.ledger_frame(spark, source, scratch, file)
                for source, file in zip(config.ledgers, done, strict=True)
            ]
            ledgers = reduce(lambda a, b: a.unionByName(b), [frame for frame, _ in read])
            counted = [counts for _, counts in read]
            if any(counts is None for counts in counted):
                # Read by tasks: one job counts them, and the cache spares a second read.
                ledgers = ledgers.persist(StorageLevel.MEMORY_AND_DISK)
                rows = ledgers.groupBy("source", "participant").count().collect()
                counted = [
                    Counter(
                        {r["participant"]: int(r["count"]) for r in rows if r["source"] == s.label}
                    )
                    for s in config.ledgers
                ]
            covered: set[str] = set()
            for source, counts in zip(config.ledgers, counted, strict=True):
                assert counts is not None
                names = set(counts) | set(source.participants or ())
                covered |= names
                ledger_info.append(
                    {
                        "source": source.label,
                        "participants": sorted(names),
                        "entries": sum(counts.values()),
                    }
                )
            frame = _audit.ledger_findings(
                frame,
                ledgers,
                sorted(covered),
                as_of_ms=as_of,
                grace_ms=config.grace_ms,
                window=window,
            )
    else:
        frame = frame.withColumn(
            "ledger_findings",
            F.expr("CAST(NULL AS ARRAY<STRUCT<invariant: STRING, reason: STRING>>)"),
        )

    base = frame.drop("events").persist(StorageLevel.MEMORY_AND_DISK)
    try:
        return _finish(
            spark, config, log, base, letters, ledger_info, as_of, t0, t_ready, say, verifier
        )
    finally:
        base.unpersist()
        if ledgers is not None:
            ledgers.unpersist()


def _finish(
    spark: Any,
    config: ReconcileConfig,
    log: LogRange,
    base: Any,
    letters: list[_dlq.DeadLetter],
    ledger_info: list[dict[str, Any]],
    as_of: int,
    t0: float,
    t_ready: float,
    say: Progress,
    verifier: _signatures.Verifier | None,
) -> RunResult:
    from pyspark.sql import functions as F

    topics = config.settings.topics

    def originals(
        wanted: set[tuple[str, int, int]],
    ) -> dict[tuple[str, int, int], Original]:
        found: dict[tuple[str, int, int], Original] = {}
        for topic in sorted({t for t, _, _ in wanted}):
            pointers = {(p, o) for t, p, o in wanted if t == topic}
            for (p, o), record in fetch_records(spark, config, topic, pointers).items():
                found[(topic, p, o)] = record
        return found

    with spark_boundary("judging the dead letters"):
        say(f"judging {len(letters)} dead letter(s)")
        verdict = _dlq.judge(
            letters,
            topics,
            lambda txs: _facts(spark, config, base, txs),
            partitions=len(log.ranges.get(topics.requests, {})) or None,
            verifier=verifier,
            originals=originals,
        )
    if verdict.findings:
        dlq_rows = [
            (tx, [("I6", reason) for reason in reasons]) for tx, reasons in verdict.findings.items()
        ]
        dlq_frame = spark.createDataFrame(
            dlq_rows, "tx STRING, dlq_findings ARRAY<STRUCT<invariant: STRING, reason: STRING>>"
        )
        merged = base.join(F.broadcast(dlq_frame), on="tx", how="full")
    else:
        merged = base.withColumn(
            "dlq_findings", F.expr("CAST(NULL AS ARRAY<STRUCT<invariant: STRING, reason: STRING>>)")
        )
    final = _audit.classify(merged, as_of_ms=as_of)

    with spark_boundary("auditing the log"):
        totals, first_explained = _totals(final)
        records = {
            "requests": totals["n_requests"]
            + totals["n_aborts"]
            + totals["n_resolves"]
            + totals["bad_requests"],
            "events": totals["n_event_records"] + totals["bad_events"],
            "decisions": totals["n_decisions"] + totals["bad_decisions"],
            "dlq": verdict.records,
        }
        records["total"] = sum(records.values())
        say(f"classified {totals['transactions']} transactions from {records['total']} records")
        # The counts say which of the queries below can find anything: a clean log's
        # run skips them (each is a Spark job, a second or so on a small machine).
        operator_count, operator_actions = collect_actions(base) if totals["n_ops"] else (0, [])
        transactions = final.where("tx_id IS NOT NULL")
        findings_path = config.out / "findings"
        written = transactions if config.write_all else transactions.where("class != 'ok'")
        written.select(*_OUTPUT_COLUMNS).write.mode("overwrite").parquet(str(findings_path))
        say(f"wrote {findings_path}")
        severity = F.expr(
            "array_position(array(" + ", ".join(f"'{c}'" for c in _audit.CLASSES) + "), class)"
        )
        not_ok = totals["transactions"] - totals["class_ok"]
        shown = (
            [
                r.asDict(recursive=True)
                for r in transactions.where("class != 'ok'")
                .orderBy(severity, "tx_id")
                .select(*_OUTPUT_COLUMNS)
                .limit(config.show)
                .collect()
            ]
            if not_ok and config.show > 0
            else []
        )
        replayable = totals["class_stuck_no_decision"] + totals["class_stuck_unfinished"]
        stuck = (
            [
                r.asDict(recursive=True)
                for r in transactions.where("replay IS NOT NULL")
                .select("tx_id", "class", "replay", "request_at", "decision_at")
                .orderBy("tx_id")
                .toLocalIterator()
            ]
            if replayable
            else []
        )
    t_audit = time.monotonic()

    checks = run_checks(spark, config)
    t_checks = time.monotonic()

    resends = _replay.plan_resends(
        stuck, requests_topic=topics.requests, decisions_topic=topics.decisions
    )
    sent = [False] * len(resends)
    if config.replay and resends:
        say(f"replaying {len(resends)} record(s)")
        with spark_boundary("reading the records to replay"):
            fetched = originals({(r.topic, r.partition, r.offset) for r in resends})
        sent = _replay.send(
            config.settings,
            resends,
            fetched,
            rate=config.replay_rate,
            progress=lambda done, total: say(f"replayed {done}/{total}"),
            verifier=verifier,
        )
    t_end = time.monotonic()

    classes = {c: totals[f"class_{c}"] for c in _audit.CLASSES}
    invariants = {i: totals[f"inv_{i}"] for i in _audit.INVARIANTS}
    failed_checks = [c for c in checks if not c["holds"]]
    bad = sum(classes[c] for c in _BAD)
    exit_code = 1 if bad or failed_checks else 0
    verdict_text = _verdict(classes, failed_checks, exit_code)
    audit_s = t_audit - t_ready
    summary: dict[str, Any] = {
        "format": 1,
        "prefix": topics.prefix,
        "bootstrap": config.settings.bootstrap,
        "as_of_ms": as_of,
        "grace_ms": config.grace_ms,
        "since_ms": config.since_ms,
        "offsets": log.to_json(),
        "records": records,
        "invalid_records": {
            "requests": totals["bad_requests"],
            "events": totals["bad_events"],
            "decisions": totals["bad_decisions"],
        },
        "invalid_explained": {"count": totals["explained"], "first": first_explained},
        "signatures": {
            "keys_dir": str(config.keys_dir) if config.keys_dir is not None else None,
            "forged_records": {
                "requests": totals["forged_requests"],
                "events": totals["forged_events"],
                "decisions": totals["forged_decisions"],
            },
            "dlq_forged": verdict.forged,
            "dlq_unauthenticated": verdict.unauthenticated,
        },
        "transactions": totals["transactions"],
        "classes": classes,
        "invariants": invariants,
        "dlq": {
            "records": verdict.records,
            "invalid": verdict.invalid,
            "justified": verdict.justified,
            "violations": verdict.violations,
            "by_component": dict(verdict.by_component),
        },
        "ledgers": ledger_info,
        "operator_actions": {"count": operator_count, "actions": operator_actions},
        "checks": checks,
        "replay": {
            "mode": "sent" if config.replay else "dry-run",
            "planned": len(resends),
            "decisions": sum(1 for r in resends if r.kind == "decision"),
            "requests": sum(1 for r in resends if r.kind == "request"),
            "sent": sum(sent),
        },
        "timings": {
            "startup_s": round(t_ready - t0, 3),
            "audit_s": round(audit_s, 3),
            "checks_s": round(t_checks - t_audit, 3),
            "replay_s": round(t_end - t_checks, 3),
            "wall_s": round(t_end - t0, 3),
            "records_per_s": round(records["total"] / audit_s, 1) if audit_s > 0 else 0.0,
        },
        "findings_path": str(findings_path),
        "exit_code": exit_code,
        "verdict": verdict_text,
    }
    from saga.streams.reconcile._report import write_json, write_jsonl

    write_json(config.out / "summary.json", summary)
    write_jsonl(
        config.out / "replay.jsonl",
        [r.to_json(s) for r, s in zip(resends, sent, strict=True)],
    )
    return RunResult(summary, shown, list(zip(resends, sent, strict=True)))


def _verdict(classes: Mapping[str, int], failed_checks: list[dict[str, Any]], code: int) -> str:
    if code == 0:
        return "clean"
    parts = [
        f"{c.replace('_', ' ')}: {n}"
        for c, n in classes.items()
        if n and c not in ("ok", "in_flight")
    ]
    parts += [f"check {c['name']} fails" for c in failed_checks]
    return ", ".join(parts)


def _totals(final: Any) -> tuple[dict[str, int], str | None]:
    """Every count of the summary, in one pass over the classified transactions, and the
    first invalid record whose parse said why (``topic[partition]@offset: reason``)."""
    from pyspark.sql import functions as F

    sums = {
        "n_requests": "requests",
        "n_aborts": "n_aborts",
        "n_resolves": "n_resolves",
        "n_events": "events",
        "n_event_records": "event_records",
        "n_decisions": "decisions",
        "bad_requests": "bad_requests",
        "bad_events": "bad_events",
        "bad_decisions": "bad_decisions",
        "forged_requests": "forged_requests",
        "forged_events": "forged_events",
        "forged_decisions": "forged_decisions",
        "explained": "explained",
        "n_ops": "n_ops",
    }
    exprs = [F.expr(f"coalesce(sum({column}), 0)").alias(name) for name, column in sums.items()]
    exprs.append(F.expr("count_if(tx_id IS NOT NULL)").alias("transactions"))
    exprs += [
        F.expr(f"count_if(tx_id IS NOT NULL AND class = '{c}')").alias(f"class_{c}")
        for c in _audit.CLASSES
    ]
    exprs += [
        F.expr(f"count_if(array_contains(invariants, '{i}'))").alias(f"inv_{i}")
        for i in _audit.INVARIANTS
    ]
    exprs.append(F.expr("min(first_explained)").alias("first_explained"))
    found = final.agg(*exprs).first().asDict()
    first = found.pop("first_explained")
    return {k: int(v or 0) for k, v in found.items()}, first


def _dead_letters(spark: Any, config: ReconcileConfig, log: LogRange) -> list[_dlq.DeadLetter]:
    topic = config.settings.topics.dlq
    if not any(e > s for s, e in log.ranges[topic].values()):
        return []
    frame = kafka_frame(spark, config, log, topic, None, headers=True)
    frame = frame.select("partition", "offset", "key", "value", "headers")
    out: list[_dlq.DeadLetter] = []
    for row in frame.toLocalIterator():
        pairs = header_list(row)
        out.append(
            _dlq.DeadLetter(
                partition=int(row["partition"]),
                offset=int(row["offset"]),
                key=bytes(row["key"]) if row["key"] is not None else None,
                value=bytes(row["value"]) if row["value"] is not None else None,
                headers=dict(pairs),
                header_list=tuple(pairs),
            )
        )
    return out


def _facts(
    spark: Any, config: ReconcileConfig, base: Any, txs: set[str]
) -> dict[str, _dlq.TxFacts]:
    """What the audit knows of ``txs``: decided or not, and the first request."""
    rows = (
        base.where(base.tx.isin(sorted(txs)))
        .select("tx", "n_decisions", "req.part", "req.off")
        .collect()
    )
    topic = config.settings.topics.requests
    pointers = {(int(r["part"]), int(r["off"])) for r in rows if r["part"] is not None}
    originals = fetch_records(spark, config, topic, pointers)
    facts: dict[str, _dlq.TxFacts] = {}
    for r in rows:
        first: SagaRequest | None = None
        if r["part"] is not None:
            value = originals.get((int(r["part"]), int(r["off"])), (None, None, []))[1]
            try:
                decoded = decode_as(value, SagaRequest)
                first = decoded if isinstance(decoded, SagaRequest) else None
            except InvalidRecord:
                first = None
        facts[r["tx"]] = _dlq.TxFacts(
            decided=int(r["n_decisions"] or 0) > 0,
            first_request=first,
            first_request_offset=int(r["off"]) if r["off"] is not None else None,
        )
    return facts
