"""A real Prometheus server scrapes a coordinator and two participants during a workload.

Debian's ``prometheus`` package is installed by ``infra/prometheus.sh`` when missing
(CI machines reach apt: a failed install fails the test, it never skips). The test
starts ``saga coordinator run`` and two ``saga participant run`` (SQL, ``bank`` and
``shop``) as processes with ``--metrics-port``, runs Prometheus on a port of its own
with a temporary configuration and data folder, scraping the three endpoints every
second, sends transfers (about a third rolled back for lack of funds), and asks
Prometheus's query API what it scraped: decision counters by outcome and reason,
latency histograms, participants' step counters; ``/healthz`` and ``/readyz``
answer 200 on every process, and each process logged its ready line.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from saga.streams import SagaState, Step, StepsCommitted, decode
from saga.streams._trace import parse
from tests._infra import Services, eventually
from tests._system import SagaSystem, bank_system

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SAGAS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return int(answer.status), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    done = subprocess.run(
        [str(ROOT / "infra" / "prometheus.sh"), "install"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, f"infra/prometheus.sh install failed: {done.stderr}"
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with bank_system(services, pg_schema, tmp_path, {"alice": 1_000, "bob": 0}) as s:
        yield s


class Prometheus:
    """``/usr/bin/prometheus`` scraping ``targets`` every second, in ``folder``."""

    def __init__(self, binary: str, folder: Path, targets: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = folder / "prometheus.yml"
        # JSON is YAML: no YAML writer needed.
        config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                    "scrape_configs": [
                        {"job_name": "saga", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        self.log_path = folder / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        assert self.popen.poll() is None, f"prometheus exited:\n{self.log()[-3000:]}"
        try:
            return get(f"{self.url}/-/ready")[0] == 200
        except OSError:
            return False

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector ``promql`` evaluates to now."""
        code, body = get(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
        assert code == 200, body
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def value(self, promql: str) -> float:
        """The single value of ``promql`` (0 when it has none yet)."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else 0.0

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(30)


def transfer(amount: int, order: str) -> list[Step]:
    return [
        Step(
            "bank",
            "increment",
            {"target": "accounts", "key": "alice", "field": "balance", "by": -amount, "min": 0},
        ),
        Step("shop", "insert", {"target": "orders", "key": order, "value": {"qty": 1}}),
        Step(
            "bank",
            "increment",
            {"target": "accounts", "key": "bob", "field": "balance", "by": amount},
        ),
    ]


def test_prometheus_scrapes_decisions_latencies_and_health(
    system: SagaSystem, prometheus_binary: str, tmp_path: Path
) -> None:
    ports = {"coordinator": free_port(), "bank": free_port(), "shop": free_port()}
    coordinator = system.start(
        "coordinator", ["coordinator", "run", "--metrics-port", str(ports["coordinator"])]
    )
    participants = [
        system.participant(
            name,
            [table],
            extra=[
                "--metrics-port",
                str(ports[name]),
                *(["--log-format", "json"] if name == "shop" else []),
            ],
        )
        for name, table in (("bank", "accounts"), ("shop", "orders"))
    ]
    procs = [coordinator, *participants]
    endpoints = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}

    def all_ready() -> bool:
        for proc in procs:
            assert proc.alive, f"{proc.name} exited:\n{proc.log()[-3000:]}"
        try:
            return all(get(f"{url}/readyz")[0] == 200 for url in endpoints.values())
        except OSError:  # not listening yet
            return False

    eventually(all_ready, timeout=120, interval=0.5, message="the services never became ready")

    folder = tmp_path / "prometheus"
    folder.mkdir()
    server = Prometheus(
        prometheus_binary, folder, [u.removeprefix("http://") for u in endpoints.values()]
    )
    try:
        eventually(server.ready, timeout=60, interval=0.5, message="prometheus never became ready")

        # The workload: 24 transfers of 60 from 1,000: 16 commit, then alice runs dry.
        with system.client() as client:
            txs = [
                client.submit(transfer(60, f"o-{i}"), saga="transfer", timeout=60)
                for i in range(SAGAS)
            ]
            finals = [client.result(tx, timeout=120) for tx in txs]
        states = [f.state for f in finals]
        committed = states.count(SagaState.COMMITTED)
        rolled_back = states.count(SagaState.ROLLED_BACK)
        assert committed == 16 and rolled_back == SAGAS - 16, states

        def scraped_everything() -> bool:
            up = server.query('up{job="saga"}')
            return (
                len(up) == 3
                and all(float(r["value"][1]) == 1 for r in up)
                and server.value('sum(saga_decisions_total{outcome="commit"})') == committed
                and server.value('sum(saga_decisions_total{outcome="rollback"})') == rolled_back
                and server.value("sum(saga_completion_latency_seconds_count)") == SAGAS
                # sampled by the coordinator every few seconds
                and server.value('saga_sagas{state="committed"}') == committed
            )

        eventually(
            scraped_everything,
            timeout=60,
            interval=1,
            message=f"prometheus did not scrape the workload's counters\n{server.log()[-2000:]}",
        )
        assert (
            server.value('saga_decisions_total{outcome="rollback", reason="step_failed"}')
            == rolled_back
        )
        # The latency histograms have samples, in buckets as well as in the count.
        assert server.value("sum(saga_decision_latency_seconds_count)") == SAGAS
        assert server.value('sum(saga_decision_latency_seconds_bucket{le="+Inf"})') == SAGAS
        assert server.value("sum(saga_decision_latency_seconds_sum)") > 0
        assert server.value('sum(saga_completion_latency_seconds_bucket{le="600.0"})') == SAGAS
        # Both participants were scraped, with their steps by status.
        applied = server.query('saga_participant_steps_total{status="applied"}')
        assert {r["metric"]["participant"] for r in applied} == {"bank", "shop"}
        assert all(float(r["value"][1]) > 0 for r in applied)
        assert server.value('sum(saga_participant_steps_total{status="failed"})') == rolled_back
        assert server.value("sum(saga_participant_storage_seconds_count)") > 0
        assert server.value("sum(saga_ready)") == 3
    finally:
        server.stop()

    for name, url in endpoints.items():
        assert get(f"{url}/healthz") == (200, b"ok\n"), name
        assert get(f"{url}/readyz") == (200, b"ok\n"), name
    # The instance id defaults to the host name.
    assert re.search(r"saga coordinator ready: instance \S+, 4 of 4 partitions", coordinator.log())
    bank, shop = participants
    assert "saga participant ready: bank (sql, targets accounts), 4 of 4 partitions" in bank.log()
    # --log-format json: every line is one object; the ready line among them.
    lines = [json.loads(line) for line in shop.log().splitlines()]
    assert {"ts", "level", "logger", "message"} <= set(lines[0])
    assert any(
        line["logger"] == "saga.ready"
        and line["message"].startswith("saga participant ready: shop")
        for line in lines
    ), lines

    # The trace context went from the client through both participants and the
    # coordinator: every record of a saga carries its request's trace id (a
    # saga.committed that acknowledges several sagas' commits belongs to none of them).
    def trace_ids(topic: str) -> dict[bytes, set[str]]:
        found: dict[bytes, set[str]] = {}
        for m in system.read_messages(topic):
            record = decode(m.value)
            if isinstance(record, StepsCommitted) and len({t for t, _ in record.steps}) > 1:
                assert parse(m.headers) is None, "a trace context on several sagas' commits"
                continue
            context = parse(m.headers)
            assert context is not None, f"a record on {topic} without a trace context"
            found.setdefault(m.key or b"", set()).add(context.trace_id)
        return found

    requests = trace_ids(system.settings.topics.requests)
    assert len(requests) == SAGAS and all(len(ids) == 1 for ids in requests.values())
    for topic in ("events", "decisions", "status"):
        seen = trace_ids(getattr(system.settings.topics, topic))
        assert set(seen) == set(requests), topic
        for key, ids in seen.items():
            assert ids == requests[key], (topic, key)
