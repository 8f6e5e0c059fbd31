"""Bounded state: a coordinator and a client with default settings after millions of sagas.

``make state-bench`` (``python -m tests.state_bench``). Under a fresh topic prefix it
writes the history a real run of ``--sagas`` (default 2,000,000) finished three-step
sagas leaves (:mod:`tests.state_bench_history`: requests, events, decisions, statuses,
each at the time it would have had, ``--rate`` sagas per second ending now; tombstones
for the sagas older than the retention) and commits the coordinator group's offsets at
the end of its input topics, as a coordinator that processed them would have. With the
default retention (seven days) every one of those sagas is still remembered. Then:

* a coordinator (``saga coordinator run``, default settings): its restart-to-ready time
  (started, to its partitions restored) and its resident memory once ready, and at its
  peak during the restore;
* a client (``SagaClient.from_env()``, default settings, a process of its own,
  :mod:`tests.state_bench_client`): its start-to-ready time and memory, the look-up of
  one saga of the history, and its memory once it has sent ``--follow`` requests
  (100,000: as many as it remembers) and read their statuses (published five times
  ``--rate`` a second, as a coordinator would publish them as they finish).

It prints one table, checks the bounds (coordinator at most 512 MB, client at most
128 MB) and writes ``reports/state-bench.json``. ``--probe`` adds the in-memory log's
figures of :mod:`tests.state_bench_probe` (heap per finished and per in-flight saga, disk
per finished saga).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from saga.streams._duration import DEFAULT_RETENTION_MS, parse_duration_ms
from saga.streams.kafka import Consumer, KafkaSettings, create_topics, delete_topics
from tests._infra import unique_name
from tests.state_bench_history import tx_name, write_history, write_statuses

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"assigned partitions \[[0-9, ]+\] \(restored (\d+) sagas\)")
COORDINATOR_MB = 512
CLIENT_MB = 128


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def memory_mb(pid: int) -> tuple[float, float]:
    """Resident memory now and at its peak (VmRSS, VmHWM), in MB."""
    text = Path(f"/proc/{pid}/status").read_text()
    found = [re.search(rf"{name}:\s+(\d+) kB", text) for name in ("VmRSS", "VmHWM")]
    return tuple(round(int(m.group(1)) / 1024, 1) if m else 0.0 for m in found)  # type: ignore[return-value]


def env_for(settings: KafkaSettings) -> dict[str, str]:
    env = dict(os.environ)
    env["SAGA_KAFKA_BOOTSTRAP"] = settings.bootstrap
    env["SAGA_TOPIC_PREFIX"] = settings.prefix
    return env


def commit_coordinator_offsets(settings: KafkaSettings, partitions: int) -> None:
    """Where a coordinator that processed the whole history would stand."""
    topics = settings.topics
    group = Consumer(settings, group_id=f"{topics.prefix}.coordinator", client_id="state-bench")
    try:
        ends = {}
        for topic in (topics.requests, topics.events, topics.decisions):
            for p in range(partitions):
                ends[(topic, p)] = group.watermarks(topic, p)[1]
        group.commit(ends)
    finally:
        group.close()


def status_ends(settings: KafkaSettings, partitions: int) -> dict[int, tuple[int, int]]:
    reader = Consumer(settings, group_id=None, client_id="state-bench.count")
    try:
        return {p: reader.watermarks(settings.topics.status, p) for p in range(partitions)}
    finally:
        reader.close()


def measure_coordinator(settings: KafkaSettings, retention: str, log: Path) -> dict[str, Any]:
    """Start ``saga coordinator run`` with default settings; measure it once it is ready."""
    command = [sys.executable, "-m", "coordinator", "-v", "coordinator", "run"]
    command += ["--instance-id", "bench"]
    if parse_duration_ms(retention) != DEFAULT_RETENTION_MS:
        command += ["--retention", retention]
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, env=env_for(settings), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        peak = 0.0
        while time.monotonic() < started + 3600:
            found = READY.search(log.read_text(errors="replace"))
            if found:
                ready_s = time.monotonic() - started
                rss, peak = memory_mb(proc.pid)
                time.sleep(5)  # a few idle polls after: the figure it keeps
                settled, peak = memory_mb(proc.pid)
                return {
                    "ready_s": round(ready_s, 1),
                    "rss_mb": rss,
                    "rss_after_5s_mb": settled,
                    "peak_mb": peak,
                    "restored": int(found.group(1)),
                }
            if proc.poll() is not None:
                raise SystemExit(f"the coordinator exited; see {log}")
            time.sleep(0.2)
        raise SystemExit(f"the coordinator was not ready within an hour; see {log}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure_client(
    settings: KafkaSettings, old_tx: str, follow: int, partitions: int, rate: float
) -> dict[str, Any]:
    """Run :mod:`tests.state_bench_client` and read its stages; publish the statuses of the
    requests it sent, ``rate`` a second (as a coordinator would as they finish)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.state_bench_client", old_tx, str(follow)],
        env=env_for(settings), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=ROOT,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    stages: dict[str, Any] = {}
    try:
        for line in proc.stdout:
            stage = json.loads(line)
            stages[stage.pop("stage")] = stage
            if "ready" in stages and "process_ready_s" not in stages:
                stages["process_ready_s"] = round(time.monotonic() - started, 2)
            if "sent" in stages and "published" not in stages:
                write_statuses(settings, [tx_name(n, "p") for n in range(follow)], rate)
                ends = {p: high for p, (_, high) in status_ends(settings, partitions).items()}
                stages["published"] = True
                proc.stdin.write(json.dumps(ends) + "\n")
                proc.stdin.flush()
        if proc.wait(120) != 0:
            raise SystemExit(f"the client probe failed (exit {proc.returncode})")
    finally:
        if proc.poll() is None:
            proc.kill()
    return stages


def run(args: argparse.Namespace) -> dict[str, Any]:
    bootstrap = os.environ.get("SAGA_KAFKA_BOOTSTRAP")
    if not bootstrap:
        raise SystemExit(
            'no Kafka address: run `make infra-up` and eval "$(infra/services.sh env)"'
        )
    settings = KafkaSettings(bootstrap=bootstrap, prefix=args.reuse or unique_name("state"))
    retention_ms = parse_duration_ms(args.retention)
    counts: dict[str, int] = {}
    written_s = 0.0
    if not args.reuse:
        create_topics(settings, args.partitions, retention_ms=retention_ms)
    try:
        if not args.reuse:
            say(f"{args.sagas:,} sagas under {settings.prefix}: writing their history")
            t0 = time.monotonic()
            now = int(time.time() * 1000)
            counts = write_history(
                settings, 0, args.sagas, args.rate, retention_ms, now, recent=True, say=say
            )
            written_s = time.monotonic() - t0
            say(f"  {sum(counts.values()):,} records written in {written_s:.0f} s")
        commit_coordinator_offsets(settings, args.partitions)
        marks = status_ends(settings, args.partitions)
        coordinator: dict[str, Any] = {}
        client: dict[str, Any] = {}
        if args.only in ("", "coordinator"):
            say("measuring the coordinator's restart (default settings)")
            log = args.out.parent / "state-bench-coordinator.log"
            coordinator = measure_coordinator(settings, args.retention, log)
            say(f"  {coordinator}")
        if args.only in ("", "client"):
            say("measuring a client (default settings)")
            old = tx_name(args.sagas // 2)
            client = measure_client(settings, old, args.follow, args.partitions, args.rate * 5)
            say(f"  {client}")
        return {
            "sagas": args.sagas,
            "records_written": counts,
            "history_written_s": round(written_s, 1),
            "status_records": sum(high - low for low, high in marks.values()),
            "coordinator": coordinator,
            "client": client,
        }
    finally:
        if args.keep:
            say(f"topics kept: --reuse {settings.prefix}")
        else:
            delete_topics(settings, list(settings.topics.all))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sagas", type=int, default=2_000_000, help="finished sagas written")
    parser.add_argument("--rate", type=float, default=1000.0, help="sagas per second of history")
    parser.add_argument("--retention", default="7d", help="the coordinator's --retention")
    parser.add_argument("--partitions", type=int, default=8, help="as `saga topics create`")
    parser.add_argument("--follow", type=int, default=100_000, help="requests the client sends")
    parser.add_argument("--probe", type=int, default=20_000, help="in-memory probe (0: none)")
    parser.add_argument("--only", choices=("", "coordinator", "client"), default="")
    parser.add_argument("--keep", action="store_true", help="keep the topics (for --reuse)")
    parser.add_argument("--reuse", default="", help="the prefix of a history kept by --keep")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "state-bench.json")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    if args.probe:
        from tests.state_bench_probe import probe

        say(f"in-memory probe: {args.probe:,} finished and {args.probe:,} in-flight sagas")
        report["probe"] = probe(args.probe)
        say(f"  {report['probe']}")
    if args.sagas:
        report["result"] = result = run(args)
        if not args.only:
            print_table(result)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}")
    if args.sagas and not args.only and not within_bounds(report["result"]):
        sys.exit(1)


def within_bounds(result: dict[str, Any]) -> bool:
    coordinator, client = result["coordinator"], result["client"]
    client_peak = max(
        stage.get("peak_mb", 0) for stage in client.values() if isinstance(stage, dict)
    )
    return coordinator["peak_mb"] <= COORDINATOR_MB and client_peak <= CLIENT_MB


def print_table(result: dict[str, Any]) -> None:
    c, k = result["coordinator"], result["client"]
    peak = max(stage.get("peak_mb", 0) for stage in k.values() if isinstance(stage, dict))
    held_ms, read_ms = k["result_recent"]["s"], k["result_older"]["s"] * 10
    rows = [
        ("finished sagas in the history", f"{result['sagas']:,}"),
        ("status records on the topic", f"{result['status_records']:,}"),
        ("coordinator: restart to ready", f"{c['ready_s']:.1f} s ({c['restored']:,} restored)"),
        ("coordinator: resident once ready", f"{c['rss_mb']:.0f} MB"),
        ("coordinator: resident 5 s later", f"{c['rss_after_5s_mb']:.0f} MB"),
        ("coordinator: peak (restore)", f"{c['peak_mb']:.0f} MB (bound {COORDINATOR_MB} MB)"),
        ("client: start to ready", f"{k['ready']['s']:.2f} s"),
        ("client: process start to ready", f"{k['process_ready_s']:.1f} s"),
        ("client: resident once ready", f"{k['ready']['rss_mb']:.0f} MB"),
        ("client: look-up of an old saga", f"{k['lookup']['s']:.1f} s ({k['lookup']['state']})"),
        ("client: after following sent ones", f"{k['followed']['rss_mb']:.0f} MB"),
        ("client: sagas followed / decoded", f"{k['followed']['followed']:,} / "
                                             f"{k['followed']['decoded']:,}"),
        ("client: result(), held / read again", f"{held_ms:.2f} ms / {read_ms:.0f} ms each"),
        ("client: peak", f"{peak:.0f} MB (bound {CLIENT_MB} MB)"),
    ]  # fmt: skip
    print()
    for name, value in rows:
        print(f"  {name:<38} {value}")
    print(f"  {'within the bounds':<38} {'yes' if within_bounds(result) else 'NO'}")


if __name__ == "__main__":
    main()
