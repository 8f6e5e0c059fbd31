"""The Spark side of the job: the session, and the log read as a batch of Kafka records.

The log is read through Spark's ``kafka`` source (``spark-sql-kafka-0-10``)
with ``read_committed`` isolation, so records of aborted Kafka transactions
(a coordinator that was fenced mid-batch) are never audited. The range read is
fixed up front (:func:`snapshot_offsets`): every topic is read up to the end
offsets seen at the start of the run, and the participants' ledgers are read
after that, so anything the log holds happened before the ledgers were read.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from saga.streams._errors import ConfigurationError, SagaError, TransientError
from saga.streams.kafka import Consumer, KafkaSettings, wait_for_broker
from saga.streams.reconcile._config import ReconcileConfig

__all__ = [
    "QUICK_JVM_OPTIONS",
    "SMALL_LOG",
    "SMALL_LOG_SQL",
    "LogRange",
    "ReconcileError",
    "check_jars",
    "class_archive_options",
    "executor_python",
    "kafka_frame",
    "kafka_options",
    "on_loopback",
    "shuffle_partitions_for",
    "snapshot_offsets",
    "spark_boundary",
    "start_spark",
]

KAFKA_JAR_PREFIX: Final = "spark-sql-kafka-0-10"

_LOG4J: Final = """\
rootLogger.level = {level}
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{{HH:mm:ss}} %p %c{{1}}: %m%n
logger.kafka.name = org.apache.kafka
logger.kafka.level = error
"""


SMALL_LOG: Final = 1_000_000
"""Offsets (all topics) up to which a run counts as small: a demo's or a day's log.

A small run lasts seconds, and on a machine of two cores the JVM's optimising
compiler (C2) and its parallel collector then cost more than they ever pay back:
measured on the demo's log (16,053 offsets, three ledgers), the driver JVM
spent 45 s of CPU with the defaults and 25 s with ``-XX:TieredStopAtLevel=1
-XX:+UseSerialGC``. Past this size the defaults' throughput wins (1,000,000
sagas are 5.9 million offsets)."""

QUICK_JVM_OPTIONS: Final = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
"""JVM options of a ``local`` driver for a small log: C1 compiler only, serial collector."""

SMALL_LOG_SQL: Final = {
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
    "spark.sql.adaptive.enabled": "false",
}
"""Spark SQL settings for a small log. Whole-stage code generation compiles one
Java class per stage (Janino, then the JIT), which a few thousand rows never
pay back; adaptive execution re-plans the query after each shuffle, a second
optimisation of the job's large plan and a job more per shuffle, to size
partitions that are tiny anyway. On the demo's log both together saved about
4 s of the driver's CPU beside the JVM options. Without whole-stage code
generation each task still compiled its projections and predicates one by one
(a third of the tasks' CPU on the demo's log): ``NO_CODEGEN`` evaluates them
interpreted instead, the same results without the compiler."""


_ARCHIVE_SETTLE_S: Final = 30.0
_ARCHIVE_CLAIM_S: Final = 900.0
"""How long a run that set out to write the archive keeps others from writing one too
(its JVM writes it as it exits, up to a minute or two after the command returns)."""


def class_archive_options(jars: list[Path], environ: Mapping[str, str]) -> list[str]:
    """JVM options that load Spark's classes from a class-data archive (CDS), or, when
    there is none yet for this Java, Spark and jars, write one as the JVM exits.

    Loading and verifying the ~20,000 classes a run touches, looked up across some
    250 jars, was a third of the driver's CPU on the demo's log; mapped from the
    archive they cost a fraction (measured: 20 s of CPU without, 16 s with). The
    archive lives in ``$XDG_CACHE_HOME/saga-olep`` (else ``~/.cache/saga-olep``),
    about 180 MB, named by a digest of what it depends on, so a new Spark, Java or
    jar writes a new one (and the old ones are removed). The JVM checks the class
    path itself and runs without the archive when it does not match; its messages
    about the archive are silenced (they would go to standard output). The JVM
    writes the archive as it exits, so the first run's JVM outlives the command by
    a minute or so; meanwhile (and for :data:`_ARCHIVE_CLAIM_S` at most) a claim
    file keeps other runs from writing one too. No options when the folder cannot
    be written.
    """
    import hashlib

    import pyspark

    digest = hashlib.sha256()
    digest.update(f"{pyspark.__version__}|{environ.get('JAVA_HOME')}|".encode())
    digest.update(f"{environ.get('SPARK_HOME')}|{' '.join(QUICK_JVM_OPTIONS)}".encode())
    spark_jars = Path(environ.get("SPARK_HOME") or Path(pyspark.__file__).parent) / "jars"
    try:
        cache = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "saga-olep"
        for jar in [*sorted(spark_jars.glob("*.jar")), *jars]:
            info = jar.stat()
            digest.update(f"|{jar}:{info.st_size}:{info.st_mtime_ns}".encode())
        key = f"reconcile-{digest.hexdigest()[:16]}"
        quiet = "-Xlog:cds*=off"
        found = sorted(cache.glob(f"{key}.*.jsa"))
        # One written in the last half minute may still be being written by a JVM that
        # is exiting: run without an archive rather than map half of one.
        done = [p for p in found if time.time() - p.stat().st_mtime > _ARCHIVE_SETTLE_S]
        if done:
            return [f"-XX:SharedArchiveFile={done[0]}", quiet]
        if found:
            return []
        cache.mkdir(parents=True, exist_ok=True)
        claim = cache / f"{key}.claim"
        try:
            if time.time() - claim.stat().st_mtime < _ARCHIVE_CLAIM_S:
                return []  # another run's JVM is writing it
        except FileNotFoundError:
            pass
        claim.write_text(str(os.getpid()), encoding="utf-8")
        for old in [*cache.glob("reconcile-*.jsa"), *cache.glob("reconcile-*.claim")]:
            if old != claim:
                old.unlink(missing_ok=True)
    except (OSError, RuntimeError):  # RuntimeError: no home folder to be found
        return []
    # One name per writer: two first runs at once each write their own whole file.
    return [f"-XX:ArchiveClassesAtExit={cache / f'{key}.{os.getpid()}.jsa'}", quiet]


def shuffle_partitions_for(offsets: int) -> int:
    """Shuffle partitions for a log of ``offsets``: 2 (one per core of a small machine)
    for a small log, one more per 250,000 offsets, at most 8.

    Each partition is a task in every stage after a shuffle; for a few thousand
    transactions each task's fixed cost is what the stage costs.
    """
    return max(2, min(8, offsets // 250_000))


class ReconcileError(ConfigurationError):
    """The job cannot run (exit status 2): a service, a topic, a jar or an option is missing."""


# ---------------------------------------------------------------- pre-flight


def check_jars(jars_dir: Path) -> list[Path]:
    """The jars of ``jars_dir``; it must hold the Kafka connector.

    Raises:
        ReconcileError: the folder is missing or has no ``spark-sql-kafka-0-10`` jar.
    """
    if not jars_dir.is_dir():
        raise ReconcileError(
            f"the Spark jars folder {jars_dir} does not exist: run `infra/services.sh provision` "
            "or pass --jars-dir (or SAGA_SPARK_JARS) naming the folder with spark-sql-kafka"
        )
    jars = sorted(p.resolve() for p in jars_dir.glob("*.jar"))
    if not any(p.name.startswith(KAFKA_JAR_PREFIX) for p in jars):
        raise ReconcileError(
            f"the Spark jars folder {jars_dir} has no {KAFKA_JAR_PREFIX} jar: run "
            "`infra/services.sh provision` to fetch the connector jars"
        )
    return jars


@dataclass(frozen=True)
class LogRange:
    """The offsets read per topic: ``{topic: {partition: (start, end)}}``, end exclusive."""

    ranges: Mapping[str, Mapping[int, tuple[int, int]]]

    def spark_json(self, topic: str, which: int) -> str:
        return json.dumps({topic: {str(p): r[which] for p, r in self.ranges[topic].items()}})

    def spans(self) -> dict[str, int]:
        """Offsets per topic in the range (records plus transaction markers)."""
        return {t: sum(e - s for s, e in parts.values()) for t, parts in self.ranges.items()}

    def to_json(self) -> dict[str, dict[str, list[int]]]:
        return {
            t: {str(p): [s, e] for p, (s, e) in sorted(parts.items())}
            for t, parts in self.ranges.items()
        }


def snapshot_offsets(config: ReconcileConfig, topics: tuple[str, ...]) -> LogRange:
    """Check that Kafka answers and every topic exists; fix the offset range to read.

    End offsets are the last stable offsets (``read_committed``) at this moment,
    unless ``ending_offsets`` names them; start offsets are the oldest still
    stored, unless ``starting_offsets`` names them (``--since`` is applied by
    Spark, by record time).

    Raises:
        ReconcileError: Kafka does not answer, refuses the credentials, or a topic
            is missing.
    """
    settings = config.settings
    try:
        wait_for_broker(settings, timeout=10.0)
    except SagaError as exc:
        raise ReconcileError(f"cannot reach Kafka: {exc}") from None
    reader = Consumer(settings, client_id=f"{settings.prefix}.reconcile.offsets")
    try:
        ranges: dict[str, dict[int, tuple[int, int]]] = {}
        for topic in topics:
            try:
                count = reader.list_partitions(topic)
            except ConfigurationError as exc:
                raise ReconcileError(str(exc)) from None
            parts: dict[int, tuple[int, int]] = {}
            for p in range(count):
                low, high = reader.watermarks(topic, p)
                start = _given(config.starting_offsets, topic, p, low)
                end = _given(config.ending_offsets, topic, p, high)
                first = max(start, low)
                parts[p] = (first, max(min(end, high), first))
            ranges[topic] = parts
        return LogRange(ranges)
    except TransientError as exc:
        raise ReconcileError(f"cannot read the topics' offsets from Kafka: {exc}") from None
    finally:
        reader.close()


def _given(
    offsets: Mapping[str, Mapping[int, int]] | None, topic: str, p: int, default: int
) -> int:
    if offsets is None or topic not in offsets:
        return default
    return offsets[topic].get(p, default)


# ---------------------------------------------------------------- the session


def submitted() -> bool:
    """Whether this process was started by ``spark-submit`` (the JVM already exists)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def start_spark(config: ReconcileConfig, jars: list[Path], offsets: int | None = None) -> Any:
    """A SparkSession for the job: ``local[*]`` unless ``--master`` (or ``spark-submit``) says.

    ``offsets``: how many offsets the run will read, when known. A ``local`` driver
    for a small log (:data:`SMALL_LOG`) starts with :data:`QUICK_JVM_OPTIONS` and a
    class-data archive (:func:`class_archive_options`); shuffle
    partitions not given in ``config`` follow :func:`shuffle_partitions_for` (8 when
    the size is not known), and a small log's run uses :data:`SMALL_LOG_SQL` whatever
    the master. A ``spark.driver.extraJavaOptions`` given with ``--conf``
    replaces the job's own options (the log settings included).

    Progress bars and INFO logs are off (``-v`` shows warnings). Under
    ``spark-submit`` the session it configured is used and only the SQL
    settings are applied. With a cluster master (``spark://...``) the executors
    run in other JVMs: they fetch the jars from the driver (``spark.jars``), start
    :func:`executor_python` for the ledger readers, and reach the driver at
    ``spark.driver.host`` (loopback when the master is on loopback).

    Every setting given here reaches the driver JVM's command line (PySpark starts
    it with ``spark-submit --conf key=value``), so none of them may hold a secret:
    store passwords travel inside the readers' options, Kafka's in its source's
    options.
    """
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("saga-reconcile")
    level = "warn" if config.verbose else "error"
    if not submitted():
        master = config.master or "local[*]"
        builder = builder.master(master)
        if jars:
            builder = builder.config("spark.jars", ",".join(str(j) for j in jars))
        # One small file per level, rewritten each time: nothing piles up in /tmp.
        log4j = Path(tempfile.gettempdir()) / f"saga-reconcile-log4j2-{level}.properties"
        log4j.write_text(_LOG4J.format(level=level), encoding="utf-8")
        java = [f"-Dlog4j2.configurationFile=file:{log4j}"]
        if master.startswith("local") and offsets is not None and offsets <= SMALL_LOG:
            java += QUICK_JVM_OPTIONS
            java += class_archive_options(jars, os.environ)
        builder = (
            builder.config("spark.driver.memory", config.driver_memory)
            .config("spark.driver.extraJavaOptions", " ".join(java))
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
        )
        if config.executor_memory is not None:
            builder = builder.config("spark.executor.memory", config.executor_memory)
        if on_loopback(master) and "spark.driver.host" not in config.spark_conf:
            # A loopback driver avoids host-name trouble on laptops and CI; executors of
            # a cluster on loopback reach it there too. A cluster elsewhere needs the
            # driver's routable address: --conf spark.driver.host=...
            builder = builder.config("spark.driver.host", "127.0.0.1").config(
                "spark.driver.bindAddress", "127.0.0.1"
            )
    partitions = config.shuffle_partitions
    if partitions is None:
        partitions = shuffle_partitions_for(offsets) if offsets is not None else 8
    builder = builder.config("spark.sql.shuffle.partitions", str(partitions))
    if offsets is not None and offsets <= SMALL_LOG:
        for key, value in SMALL_LOG_SQL.items():
            builder = builder.config(key, value)
    builder = builder.config("spark.sql.session.timeZone", "UTC")
    for key, value in config.spark_conf.items():
        builder = builder.config(key, value)
    try:
        session = builder.getOrCreate()
    except Exception as exc:  # the JVM could not start: no Java, bad master, ...
        raise ReconcileError(f"Spark could not start: {_first_line(exc)}") from None
    session.sparkContext.setLogLevel(level.upper())
    if not config.verbose:
        # PySpark logs every analysis error it raises as JSON on stderr; the job turns
        # those errors into one sentence of its own (spark_boundary).
        from pyspark.logger import PySparkLogger

        for name in ("DataFrameQueryContextLogger", "SQLQueryContextLogger"):
            PySparkLogger.getLogger(name).disabled = True
    # The interpreter every Python task starts (on the executors too): PySpark's default
    # is whatever `python3` is, which lacks this package and the store drivers.
    session.sparkContext.pythonExec = executor_python(
        session.sparkContext.master or "", config.spark_conf, os.environ
    )
    return session


def on_loopback(master: str) -> bool:
    """Whether ``master`` runs in this process (``local``) or on this machine's loopback."""
    if master.startswith("local"):
        return True
    host = master.partition("://")[2].split(",")[0].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def executor_python(master: str, conf: Mapping[str, str], environ: Mapping[str, str]) -> str:
    """The Python the Python tasks run: this interpreter for a ``local`` master; for a
    cluster ``spark.pyspark.python`` (``--conf``), else ``PYSPARK_PYTHON``, else this
    interpreter's path (right when the workers share this machine or its file layout).

    The executors need the same Python minor version, this package and the store
    drivers (``pip install 'saga-olep[spark]'``) at that path.
    """
    if master.startswith("local"):
        return sys.executable
    return conf.get("spark.pyspark.python") or environ.get("PYSPARK_PYTHON") or sys.executable


def kafka_options(settings: KafkaSettings) -> dict[str, str]:
    """Options of Spark's Kafka source for these settings (extras become ``kafka.<name>``)."""
    options = {
        "kafka.bootstrap.servers": settings.bootstrap,
        "kafka.isolation.level": "read_committed",
        # A partition emptied by retention between the snapshot and the read has nothing
        # to lose for an audit of what is still there; failing the run would help no one.
        "failOnDataLoss": "false",
        # A read_committed task's last fetch of a partition finds only transaction
        # markers (or nothing) before its ending offset, and the broker holds such a
        # fetch for fetch.max.wait.ms (500 ms by default) per task: on the demo's log
        # (12 partitions, 2 cores) that was 3 of the job's 11 s. Fetches that find
        # records return at once, so a short wait only shortens the empty ones.
        "kafka.fetch.max.wait.ms": "10",
    }
    for key, value in settings.extra.items():
        options[f"kafka.{key}"] = value
    return options


def kafka_frame(
    spark: Any,
    config: ReconcileConfig,
    log: LogRange,
    topic: str,
    since_ms: int | None,
    *,
    headers: bool = False,
) -> Any:
    """The records of ``topic`` in the run's range: key, value, partition, offset, timestamp
    (and ``headers`` when asked)."""
    reader = spark.read.format("kafka").options(**kafka_options(config.settings))
    if headers:
        reader = reader.option("includeHeaders", "true")
    reader = reader.option("subscribe", topic).option("endingOffsets", log.spark_json(topic, 1))
    if since_ms is not None:
        reader = reader.option("startingTimestamp", str(since_ms)).option(
            "startingOffsetsByTimestampStrategy", "latest"
        )
    else:
        reader = reader.option("startingOffsets", log.spark_json(topic, 0))
    return reader.load()


# ---------------------------------------------------------------- errors


def _first_line(exc: BaseException) -> str:
    """The most useful line of a (Java) exception: the innermost cause's message."""
    text = str(exc)
    causes = [line.strip() for line in text.splitlines() if "Caused by:" in line]
    line = causes[-1].split("Caused by:", 1)[1].strip() if causes else ""
    if not line:
        lines = [s.strip() for s in text.splitlines() if s.strip()]
        line = lines[0] if lines else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


@contextmanager
def spark_boundary(doing: str) -> Iterator[None]:
    """Turn a failure inside Spark into one sentence (exit status 2)."""
    try:
        yield
    except SagaError:
        raise
    except Exception as exc:
        name = type(exc).__name__
        if name in ("Py4JJavaError", "Py4JError", "PythonException", "AnalysisException") or (
            type(exc).__module__.startswith(("pyspark", "py4j"))
        ):
            raise ReconcileError(f"{doing} failed: {_first_line(exc)}") from None
        raise


Original = tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]
"""A record as it is in the log: key, value and headers (in order)."""


def fetch_records(
    spark: Any, config: ReconcileConfig, topic: str, pointers: set[tuple[int, int]]
) -> dict[tuple[int, int], Original]:
    """The key, value and headers of the records at ``(partition, offset)`` of ``topic``.

    Reads only the partitions named and only between the lowest and the highest
    offset wanted in each; the selection itself runs in Spark (a broadcast join),
    so only the wanted records reach this process.
    """
    if not pointers:
        return {}
    from pyspark.sql import functions as F

    bounds: dict[int, tuple[int, int]] = {}
    for part, off in pointers:
        low, high = bounds.get(part, (off, off))
        bounds[part] = (min(low, off), max(high, off))
    reader = spark.read.format("kafka").options(**kafka_options(config.settings))
    frame = (
        reader.option("assign", json.dumps({topic: sorted(bounds)}))
        .option("includeHeaders", "true")
        .option("startingOffsets", json.dumps({topic: {str(p): b[0] for p, b in bounds.items()}}))
        .option("endingOffsets", json.dumps({topic: {str(p): b[1] + 1 for p, b in bounds.items()}}))
        .load()
    )
    wanted = spark.createDataFrame(sorted(pointers), "partition INT, offset BIGINT")
    rows = (
        frame.join(F.broadcast(wanted), on=["partition", "offset"])
        .select("partition", "offset", "key", "value", "headers")
        .toLocalIterator()
    )
    found: dict[tuple[int, int], Original] = {}
    for row in rows:
        key = bytes(row["key"]) if row["key"] is not None else None
        value = bytes(row["value"]) if row["value"] is not None else None
        found[(int(row["partition"]), int(row["offset"]))] = (key, value, header_list(row))
    return found


def header_list(row: Any) -> list[tuple[str, bytes]]:
    """A Spark Kafka row's ``headers`` as ``(name, value)`` pairs, in order."""
    return [(str(h["key"]), bytes(h["value"] or b"")) for h in (row["headers"] or [])]
