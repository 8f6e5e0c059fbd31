"""Benchmark of ``saga reconcile``: a synthetic log of N sagas, then the job on it.

    python -m streams.reconcile.bench --sagas 1000000

1. Creates fresh topics (prefix ``bench<time>``) and writes the log with Spark's
   Kafka sink (the JVM's murmur2 partitioner, like every saga producer): per
   saga a request and its events and decision, in a fixed mix of kinds
   (:data:`MIX`) — most commit or roll back cleanly, a few are in flight, stuck,
   failed a compensation or break an invariant. The ``committed`` steps are
   acknowledged as participants do: one ``saga.committed`` per participant,
   batch of :data:`ACK_BATCH` sagas and events partition.
2. Runs ``python -m streams.reconcile`` on it in a fresh process (so the Spark
   start-up is measured as a user sees it) and reads its ``summary.json``.
3. Prints the throughput — records per second of the audit, which excludes the
   Spark start-up — and the job's wall time, which includes it, and checks that
   the job classified every saga as generated.
4. Deletes the topics (``--keep`` keeps them).

Exit status 0 when the classification matches the generated mix, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import click

from saga.streams.kafka import KafkaSettings, create_topics, delete_topics
from saga.streams.reconcile._parse import partition_sql

__all__ = ["ACK_BATCH", "MIX", "expected_classes", "generate", "main"]

MIX: Final = (
    # (kind, per 1000 sagas, class the job must find)
    ("commit", 800, "ok"),
    ("rollback", 150, "ok"),
    ("in_flight", 20, "in_flight"),
    ("no_decision", 10, "stuck_no_decision"),
    ("unfinished", 10, "stuck_unfinished"),
    ("compensation_failed", 5, "compensation_failed"),
    ("double_decision", 5, "violation"),
)
_SLOTS: Final = sum(share for _, share, _ in MIX)
ACK_BATCH: Final = 200
"""Consecutive sagas whose ``committed`` steps a participant acknowledges together, in
one ``saga.committed`` per events partition (a participant's batch)."""
_COMMITTED: Final = {
    # kind: the steps reported committed, as (step, participant, ms after created)
    "commit": ((0, "bank", 30), (1, "shop", 31)),
    "unfinished": ((0, "bank", 30),),  # shop never reports its step (it has to confirm)
    "double_decision": ((0, "bank", 30), (1, "shop", 31)),
}


def _kind_of(i: int) -> str:
    slot = i % _SLOTS
    for kind, share, _ in MIX:
        if slot < share:
            return kind
        slot -= share
    raise AssertionError("unreachable")


def expected_classes(sagas: int) -> dict[str, int]:
    """How many sagas of each class a log of ``sagas`` holds."""
    counts: dict[str, int] = {}
    by_kind = {kind: cls for kind, _, cls in MIX}
    for i in range(min(sagas, _SLOTS)):
        repeats = (sagas - i + _SLOTS - 1) // _SLOTS
        cls = by_kind[_kind_of(i)]
        counts[cls] = counts.get(cls, 0) + repeats
    return counts


def generate(spark: Any, settings: KafkaSettings, sagas: int, now_ms: int, partitions: int) -> int:
    """Write the synthetic log of ``sagas`` sagas on topics of ``partitions`` partitions;
    returns the number of records."""

    t = settings.topics
    cases = "CASE " + " ".join(
        f"WHEN slot < {sum(s for _, s, _ in MIX[: j + 1])} THEN '{kind}'"
        for j, (kind, _, _) in enumerate(MIX)
    )
    base = spark.range(sagas).selectExpr("id", f"id % {_SLOTS} AS slot")
    base = base.selectExpr(
        "id",
        "concat('tx-', lpad(cast(id AS STRING), 9, '0')) AS tx",
        f"{cases} END AS kind",
        f"{now_ms} - 600000 AS created",
    ).selectExpr(
        "*",
        f"CASE WHEN kind = 'in_flight' THEN {now_ms} + 600000 ELSE created + 30000 END AS deadline",
    )
    steps = (
        "array(named_struct('participant', 'bank', 'action', 'increment', 'args', "
        "named_struct('target', 'accounts', 'key', 'a', 'field', 'balance', 'by', -5, 'min', 0)), "
        "named_struct('participant', 'shop', 'action', 'increment', 'args', "
        "named_struct('target', 'accounts', 'key', 'b', 'field', 'balance', 'by', 5, 'min', 0)))"
    )
    request = f"""named_struct('topic', '{t.requests}', 'value', to_json(named_struct(
        'v', 1, 'type', 'saga.request', 'tx_id', tx, 'saga', 'transfer', 'mode', 'parallel',
        'steps', {steps}, 'deadline_ms', deadline, 'created_ms', created)))"""

    def event(step: int, participant: str, status: str, at: str, confirm: bool = False) -> str:
        said = ", 'confirm', true" if confirm else ""
        return f"""named_struct('topic', '{t.events}', 'value', to_json(named_struct(
            'v', 1, 'type', 'saga.step', 'tx_id', tx, 'step', {step},
            'participant', '{participant}', 'status', '{status}', 'at_ms', {at}{said})))"""

    def decision(outcome: str, at: str) -> str:
        return f"""named_struct('topic', '{t.decisions}', 'value', to_json(named_struct(
            'v', 1, 'type', 'saga.decision', 'tx_id', tx, 'outcome', '{outcome}',
            'reason', '{"all steps applied" if outcome == "commit" else "step 1 failed"}',
            'at_ms', {at})))"""

    applied = [
        event(0, "bank", "applied", "created + 10"),
        event(1, "shop", "applied", "created + 11"),
    ]
    by_kind = {
        "commit": [
            request,
            *applied,
            decision("commit", "created + 20"),
        ],
        "rollback": [
            request,
            event(0, "bank", "applied", "created + 10"),
            event(1, "shop", "failed", "created + 11"),
            decision("rollback", "created + 20"),
            event(0, "bank", "compensated", "created + 30"),
            event(1, "shop", "compensated", "created + 31"),
        ],
        "in_flight": [request, event(0, "bank", "applied", "created + 10")],
        "no_decision": [request, event(0, "bank", "applied", "created + 10")],
        # Both steps have something to confirm and one never reports `committed`.
        "unfinished": [
            request,
            event(0, "bank", "applied", "created + 10", confirm=True),
            event(1, "shop", "applied", "created + 11", confirm=True),
            decision("commit", "created + 20"),
        ],
        "compensation_failed": [
            request,
            event(0, "bank", "applied", "created + 10"),
            event(1, "shop", "failed", "created + 11"),
            decision("rollback", "created + 20"),
            event(0, "bank", "compensation_failed", "created + 30"),
            event(1, "shop", "compensated", "created + 31"),
        ],
        "double_decision": [
            request,
            *applied,
            decision("commit", "created + 20"),
            decision("rollback", "created + 21"),
        ],
    }
    records = "CASE " + " ".join(
        f"WHEN kind = '{kind}' THEN array({', '.join(parts)})" for kind, parts in by_kind.items()
    )
    frame = base.selectExpr("tx", f"explode({records} END) AS r").selectExpr(
        "r.topic AS topic", "CAST(tx AS BINARY) AS key", "CAST(r.value AS BINARY) AS value"
    )
    frame = frame.unionByName(_acknowledgements(base, t.events, partitions))
    frame = frame.persist()
    count = int(frame.count())
    (
        frame.write.format("kafka")
        .option("kafka.bootstrap.servers", settings.bootstrap)
        .option("kafka.compression.type", "lz4")
        .option("kafka.linger.ms", "20")
        .option("kafka.batch.size", "524288")
        .save()
    )
    frame.unpersist()
    return count


def _acknowledgements(base: Any, topic: str, partitions: int) -> Any:
    """The ``saga.committed`` records of ``base``'s committed steps: per participant, batch
    of :data:`ACK_BATCH` sagas and events partition, keyed by the first ``tx_id`` listed
    (so on that partition, with every ``tx_id`` it lists)."""
    from pyspark.sql import functions as F

    steps = "CASE " + " ".join(
        f"WHEN kind = '{kind}' THEN array("
        + ", ".join(
            f"named_struct('step', {step}, 'participant', '{who}', 'after', {after})"
            for step, who, after in acked
        )
        + ")"
        for kind, acked in _COMMITTED.items()
    )
    acked = base.selectExpr("id", "tx", "created", f"explode({steps} END) AS a").selectExpr(
        "tx",
        "a.step AS step",
        "a.participant AS participant",
        "created + a.after AS at",
        f"{partition_sql('tx', partitions)} AS part",
        f"id div {ACK_BATCH} AS batch",
    )
    batches = acked.groupBy("participant", "part", "batch").agg(
        F.expr("array_sort(collect_list(named_struct('tx', tx, 'step', step)))").alias("steps"),
        F.expr("max(at)").alias("at"),
    )
    return batches.selectExpr(
        f"'{topic}' AS topic",
        "CAST(steps[0].tx AS BINARY) AS key",
        """CAST(concat('{"v":1,"type":"saga.committed","participant":"', participant,
            '","at_ms":', CAST(at AS STRING), ',"steps":[', array_join(transform(steps,
            s -> concat('["', s.tx, '",', CAST(s.step AS STRING), ']')), ','), ']}')
            AS BINARY) AS value""",
    )


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--sagas", type=click.IntRange(1, 50_000_000), default=1_000_000, show_default=True)
@click.option("--partitions", type=click.IntRange(1, 256), default=4, show_default=True)
@click.option(
    "--bootstrap", envvar="SAGA_KAFKA_BOOTSTRAP", required=True, help="[env SAGA_KAFKA_BOOTSTRAP]"
)
@click.option(
    "--jars-dir", envvar="SAGA_SPARK_JARS", required=True, type=click.Path(path_type=Path)
)
@click.option("--driver-memory", default="4g", show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--keep", is_flag=True, help="Keep the topics afterwards.")
def main(
    sagas: int,
    partitions: int,
    bootstrap: str,
    jars_dir: Path,
    driver_memory: str,
    out: Path | None,
    keep: bool,
) -> None:
    """Generate a log of SAGAS sagas and time `saga reconcile` on it."""
    from saga.streams.reconcile._config import ReconcileConfig
    from saga.streams.reconcile._spark import check_jars, start_spark

    settings = KafkaSettings(bootstrap=bootstrap, prefix=f"bench{int(time.time())}")
    scratch = None if out else Path(tempfile.mkdtemp(prefix="saga-bench-"))
    out = out or scratch
    assert out is not None
    now_ms = time.time_ns() // 1_000_000
    create_topics(settings, partitions)
    try:
        click.echo(f"generating {sagas:,} sagas into {settings.prefix}.* ({partitions} partitions)")
        config = ReconcileConfig(settings=settings, out=out, driver_memory=driver_memory)
        spark = start_spark(config, check_jars(jars_dir))
        t = time.monotonic()
        try:
            records = generate(spark, settings, sagas, now_ms, partitions)
        finally:
            spark.stop()
        gen_s = time.monotonic() - t
        click.echo(f"wrote {records:,} records in {gen_s:.1f}s ({records / gen_s:,.0f}/s)")

        command = [
            sys.executable,
            "-m",
            "saga.streams.reconcile",
            "--bootstrap",
            bootstrap,
            "--prefix",
            settings.prefix,
            "--jars-dir",
            str(jars_dir),
            "--out",
            str(out),
            "--now-ms",
            str(now_ms),
            "--driver-memory",
            driver_memory,
            "--show",
            "0",
            "--json",
        ]
        click.echo("running: " + " ".join(command))
        t = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wall_s = time.monotonic() - t
        if done.returncode not in (0, 1):
            click.echo(done.stderr, err=True)
            raise SystemExit(f"saga reconcile failed with exit status {done.returncode}")
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    finally:
        if not keep:
            delete_topics(settings, list(settings.topics.all))
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    timings = summary["timings"]
    expected = expected_classes(sagas)
    found = {k: v for k, v in summary["classes"].items() if v}
    matches = found == expected and summary["transactions"] == sagas
    click.echo(
        json.dumps(
            {
                "sagas": sagas,
                "records": summary["records"]["total"],
                "audit_s": timings["audit_s"],
                "records_per_s": timings["records_per_s"],
                "startup_s": timings["startup_s"],
                "job_wall_s": round(wall_s, 1),
                "classes": found,
                "classes_as_generated": matches,
            },
            indent=2,
        )
    )
    click.echo(
        f"saga reconcile on {sagas:,} sagas ({summary['records']['total']:,} records): "
        f"{timings['records_per_s']:,.0f} records/s (audit {timings['audit_s']:.1f}s, "
        f"excluding the Spark start-up); wall time {wall_s:.1f}s including it"
        f" [{os.cpu_count()} cores]"
    )
    if not matches:
        click.echo(f"classes differ from the generated mix: expected {expected}", err=True)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
