"""Metrics, health, trace context and log lines of the services, on the in-memory log.

The coordinator and a participant (SQLite storage) run under a
:class:`streams.testing.Stepper`, one poll at a time, with their metrics turned on
in a registry of their own; the tests read the Prometheus text those registries
produce (as a scrape would) and the headers of the records the services wrote.
Parsing trace headers, the client's trace and OpenTelemetry export are in
test_trace_context.py; the real-Prometheus test is
tests/integration/test_prometheus_scrape.py.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from saga.coordinator._observe import reason_class
from saga.coordinator._service import CoordinatorService
from saga.coordinator.cli import main
from saga.participants import ParticipantRuntime, open_storage
from saga.streams import (
    Decision,
    KafkaSettings,
    Mode,
    Outcome,
    SagaAbort,
    SagaRequest,
    Step,
    StepEvent,
    StepStatus,
    encode,
)
from saga.streams._http import MetricsServer
from saga.streams._logs import JsonFormatter
from saga.streams._metrics import new_registry
from saga.streams._observe import Health
from saga.streams._secrets import forget_all, install_log_redaction, remember
from saga.streams._trace import TRACEPARENT, TRACESTATE, TraceContext, new_trace, parse
from saga.streams.testing import InMemoryLog, ManualClock, Stepper, key_on
from tests._helpers import memory_log

pytestmark = pytest.mark.unit

PARTITIONS = 2
SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="obs")
TOPICS = SETTINGS.topics


@pytest.fixture
def log(clock: ManualClock) -> InMemoryLog:
    return memory_log(SETTINGS, clock, PARTITIONS)


@pytest.fixture
def coordinator(
    log: InMemoryLog, clock: ManualClock
) -> Iterator[tuple[CoordinatorService, Stepper]]:
    service = CoordinatorService(SETTINGS, instance_id="m", clock=clock, log=log)
    service.observer.sample_every_s = 0  # sample at every poll: the test reads at once
    service.observer.enable_metrics(new_registry())
    stepper = Stepper(log, service.run, stop=service.stop).start()
    yield service, stepper
    if stepper.running:
        stepper.stop()


def scrape(
    service: CoordinatorService | ParticipantRuntime,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the service's registry: (name, sorted labels) -> value."""
    registry = service.observer.registry
    assert registry is not None
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def request(
    tx: str,
    clock: ManualClock,
    participants: tuple[str, ...] = ("bank", "shop"),
    *,
    confirmed: bool = False,
) -> SagaRequest:
    """``confirmed``: a custom action with a confirm (tests.confirm_handlers), which a
    commit confirms and reports; else a built-in increment, which a commit leaves alone."""
    increment = {"target": "accounts", "key": "alice", "field": "balance", "by": 1}
    credit = {"key": "alice", "by": 1}
    return SagaRequest(
        tx_id=tx,
        saga="transfer",
        mode=Mode.PARALLEL,
        steps=tuple(
            Step(p, "credit_confirmed", credit) if confirmed else Step(p, "increment", increment)
            for p in participants
        ),
        deadline_ms=clock() + 60_000,
        created_ms=clock(),
    )


def send(
    log: InMemoryLog,
    topic: str,
    *records: SagaRequest | SagaAbort | StepEvent | Decision,
    headers: list[tuple[str, bytes]] | None = None,
) -> None:
    with log.producer() as producer:
        for record in records:
            producer.produce(topic, record.tx_id, encode(record), headers)


def report(log: InMemoryLog, clock: ManualClock, tx: str, status: StepStatus, *steps: int) -> None:
    names = ("bank", "shop")
    send(
        log,
        TOPICS.events,
        *(
            StepEvent(tx, s, names[s], status, clock(), "no" if status == "failed" else None)
            for s in steps
        ),
    )


# ---------------------------------------------------------------- coordinator metrics


def test_the_coordinator_counts_decisions_by_outcome_and_reason_class_and_times_them(
    log: InMemoryLog, clock: ManualClock, coordinator: tuple[CoordinatorService, Stepper]
) -> None:
    service, stepper = coordinator
    committed, failed, aborted = (
        key_on(0, PARTITIONS),
        key_on(1, PARTITIONS),
        key_on(0, PARTITIONS, 1),
    )
    send(log, TOPICS.requests, *(request(tx, clock) for tx in (committed, failed, aborted)))
    stepper.step()
    clock.advance(40)
    report(log, clock, committed, StepStatus.APPLIED, 0, 1)
    report(log, clock, failed, StepStatus.FAILED, 1)
    send(log, TOPICS.requests, SagaAbort(aborted, "operator said so", clock()))
    stepper.step()
    report(log, clock, committed, StepStatus.COMMITTED, 0, 1)
    report(log, clock, failed, StepStatus.COMPENSATED, 0, 1)
    stepper.step(2)

    samples = scrape(service)
    assert sample(samples, "saga_decisions_total", outcome="commit", reason="all_applied") == 1
    assert sample(samples, "saga_decisions_total", outcome="rollback", reason="step_failed") == 1
    assert sample(samples, "saga_decisions_total", outcome="rollback", reason="abort") == 1
    assert sample(samples, "saga_decision_latency_seconds_count", outcome="commit") == 1
    # The request was read 40 ms (the manual clock) before its decision.
    assert sample(samples, "saga_decision_latency_seconds_sum", outcome="commit") == pytest.approx(
        0.04
    )
    assert (
        sample(samples, "saga_decision_latency_seconds_bucket", outcome="rollback", le="+Inf") == 2
    )
    assert sample(samples, "saga_completion_latency_seconds_count", state="committed") == 1
    assert sample(samples, "saga_completion_latency_seconds_count", state="rolled_back") == 1
    assert sample(samples, "saga_sagas", state="committed") == 1
    assert sample(samples, "saga_sagas", state="rolled_back") == 1
    assert sample(samples, "saga_sagas", state="rolling_back") == 1  # the abort: nobody compensates
    assert sample(samples, "saga_sagas", state="pending") == 0
    assert sample(samples, "saga_records_read_total", service="coordinator", topic="requests") == 4
    assert sample(samples, "saga_records_read_total", service="coordinator", topic="events") == 7
    assert sample(samples, "saga_ready", service="coordinator") == 1
    assert sample(samples, "saga_batches_total") == service.stats.batches
    assert sample(samples, "saga_batch_records_count", service="coordinator") >= 3
    assert (
        "saga_consumer_lag",
        (("partition", "0"), ("service", "coordinator"), ("topic", "requests")),
    ) in samples
    # Bounded labels: no transaction id anywhere.
    label_values = {v for _, labels in samples for _, v in labels}
    assert not label_values & {committed, failed, aborted}


def test_records_sent_to_the_dlq_are_counted_by_source_topic(
    log: InMemoryLog, coordinator: tuple[CoordinatorService, Stepper]
) -> None:
    service, stepper = coordinator
    tx = key_on(0, PARTITIONS)
    with log.producer() as producer:
        producer.produce(TOPICS.requests, tx, b"{not json")
        producer.produce(TOPICS.events, tx, b"\xff\xfe")
    stepper.step()
    samples = scrape(service)
    assert sample(samples, "saga_dlq_records_total", topic="requests") == 1
    assert sample(samples, "saga_dlq_records_total", topic="events") == 1


@pytest.mark.parametrize(
    ("outcome", "reason", "expected"),
    [
        (Outcome.COMMIT, "all steps applied", "all_applied"),
        (Outcome.ROLLBACK, "step 1 failed: accounts/alice balance would be -3", "step_failed"),
        (Outcome.ROLLBACK, "deadline passed", "deadline"),
        (Outcome.ROLLBACK, "aborted by operator: oops", "abort"),
        (Outcome.ROLLBACK, "step 0 names unknown participant(s): ledgr", "unknown_participant"),
        (Outcome.ROLLBACK, "step 2 was compensated before a decision", "compensated_early"),
        (Outcome.ROLLBACK, "something new", "other"),
    ],
)
def test_reason_classes_are_a_small_fixed_set(outcome: Outcome, reason: str, expected: str) -> None:
    assert reason_class(Decision("t", outcome, reason, 0)) == expected


# ---------------------------------------------------------------- trace context


def test_the_coordinator_continues_the_requests_trace_on_its_decision_and_status(
    log: InMemoryLog, clock: ManualClock, coordinator: tuple[CoordinatorService, Stepper]
) -> None:
    _, stepper = coordinator
    traced, untraced, hostile = (key_on(0, PARTITIONS, n) for n in range(3))
    context = TraceContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1, "vendor=abc")
    send(log, TOPICS.requests, request(traced, clock, ("bank",)), headers=context.headers())
    send(log, TOPICS.requests, request(untraced, clock, ("bank",)))
    garbage = [(TRACEPARENT, b"00-\xff\xfe-zz"), (TRACESTATE, b"\x00\r\n")]
    send(log, TOPICS.requests, request(hostile, clock, ("bank",)), headers=garbage)
    stepper.step()
    for tx in (traced, untraced, hostile):
        send(log, TOPICS.events, StepEvent(tx, 0, "bank", StepStatus.APPLIED, clock()))
    stepper.step()

    def traces(topic: str, tx: str) -> list[TraceContext | None]:
        return [parse(m.headers) for m in log.records(topic) if m.key == tx.encode()]

    for topic in (TOPICS.decisions, TOPICS.status):
        found = traces(topic, traced)
        assert found and all(c is not None for c in found)
        for c in found:
            assert c is not None
            assert c.trace_id == context.trace_id and c.span_id != context.span_id
            assert c.state == "vendor=abc"
        assert traces(topic, untraced) and all(c is None for c in traces(topic, untraced))
        assert traces(topic, hostile) and all(c is None for c in traces(topic, hostile))


def test_a_participant_continues_the_trace_of_the_request_and_of_the_decision(
    log: InMemoryLog, clock: ManualClock, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'bank.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE TABLE accounts (id TEXT PRIMARY KEY, balance INTEGER)"))
        connection.execute(sa.text("INSERT INTO accounts VALUES ('alice', 10)"))
    engine.dispose()
    storage = open_storage(
        "sql", name="bank", url=url, targets=["accounts"], handlers="tests.confirm_handlers"
    )
    runtime = ParticipantRuntime("bank", storage, SETTINGS, log=log, clock=clock)
    runtime.observer.sample_every_s = 0
    runtime.observer.enable_metrics(new_registry())
    stepper = Stepper(log, runtime.run, stop=runtime.stop).start()
    try:
        tx, other = key_on(1, PARTITIONS), key_on(1, PARTITIONS, 1)
        start = new_trace()
        send(
            log,
            TOPICS.requests,
            request(tx, clock, ("bank",), confirmed=True),
            headers=start.headers(),
        )
        send(log, TOPICS.requests, request(other, clock, ("shop",)))
        stepper.step()
        decided = start.child()
        send(
            log,
            TOPICS.decisions,
            Decision(tx, Outcome.COMMIT, "all steps applied", clock()),
            headers=decided.headers(),
        )
        stepper.step()
        events = [(parse(m.headers), m.value) for m in log.records(TOPICS.events)]
        assert len(events) == 2  # applied, committed
        spans = set()
        for context, _ in events:
            assert context is not None and context.trace_id == start.trace_id
            spans.add(context.span_id)
        assert len(spans) == 2 and not spans & {start.span_id, decided.span_id}

        samples = scrape(runtime)
        assert (
            sample(samples, "saga_participant_steps_total", participant="bank", status="applied")
            == 1
        )
        assert (
            sample(samples, "saga_participant_steps_total", participant="bank", status="committed")
            == 1
        )
        assert (
            sample(samples, "saga_participant_steps_total", participant="bank", status="failed")
            == 0
        )
        assert (
            sample(
                samples,
                "saga_participant_records_skipped_total",
                participant="bank",
                reason="not_mine",
            )
            == 1
        )
        assert sample(samples, "saga_participant_storage_seconds_count", participant="bank") >= 2
        assert sample(samples, "saga_ready", service="participant-bank") == 1
    finally:
        stepper.stop()


# ---------------------------------------------------------------- health and the endpoint


def test_the_endpoint_serves_metrics_health_and_readiness() -> None:
    now = [100.0]
    health = Health(stale_after_s=10, clock=lambda: now[0])
    registry = new_registry()

    def get(url: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    with MetricsServer(registry, health, "127.0.0.1", 0) as server:
        base = server.url
        assert get(f"{base}/healthz")[0] == 503
        health.beat()
        assert get(f"{base}/healthz") == (200, "ok\n")
        assert get(f"{base}/readyz")[0] == 503
        health.set_ready(True)
        assert get(f"{base}/readyz") == (200, "ok\n")
        now[0] += 11  # the loop stopped iterating
        code, why = get(f"{base}/healthz")
        assert code == 503 and "11 s ago" in why
        assert get(f"{base}/readyz")[0] == 503
        assert get(f"{base}/metrics")[0] == 200
        assert get(f"{base}/nope")[0] == 404


def test_a_port_in_use_is_one_sentence() -> None:
    with MetricsServer(new_registry(), Health(), "127.0.0.1", 0) as server:
        from saga.streams import ConfigurationError

        with pytest.raises(ConfigurationError, match="choose another --metrics-port"):
            MetricsServer(new_registry(), Health(), "127.0.0.1", server.address[1])


# ---------------------------------------------------------------- logs


def test_json_log_lines_carry_extra_fields_and_no_password() -> None:
    logger = logging.getLogger("saga.test.json")
    handler = logging.StreamHandler()
    lines: list[str] = []
    handler.emit = lambda record: lines.append(handler.format(record))  # type: ignore[method-assign]
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    logger.propagate = False
    remember("s3cret-password")
    try:
        install_log_redaction(logger)
        logger.warning(
            "cannot reach postgresql://saga:hunter2@db/saga "
            '{"password": "pw123456"} s3cret-password',
            extra={"tx_id": "tx-1", "weird": object()},
        )
        try:
            raise RuntimeError("redis://:s3cret-password@cache:6379")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
        forget_all()
    first, second = (json.loads(line) for line in lines)
    assert first["level"] == "WARNING" and first["logger"] == "saga.test.json"
    assert first["tx_id"] == "tx-1" and first["ts"].endswith("Z")
    assert "hunter2" not in lines[0] and "pw123456" not in lines[0] and "s3cret" not in lines[0]
    assert "RuntimeError" in second["exc"] and "s3cret" not in lines[1]


def test_log_format_json_on_the_command_line_writes_json_lines_without_passwords() -> None:
    root = Path(__file__).resolve().parents[2]
    for where in ("group", "command"):
        option = ["--log-format", "json"]
        args = [
            *(option if where == "group" else []),
            "participant",
            "run",
            *(option if where == "command" else []),
            "--bootstrap",
            "127.0.0.1:1",  # nothing answers: the command exits after its warning
            "--connect-timeout",
            "0.5",
            "--name",
            "bank",
            "--storage",
            "sql",
            "--url",
            "postgresql://saga:pw-on-the-line@127.0.0.1:1/saga",
            "--targets",
            "accounts",
        ]
        done = subprocess.run(
            [sys.executable, "-m", "coordinator", *args],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 1, done.stderr
        assert "pw-on-the-line" not in done.stderr
        line = json.loads(done.stderr.splitlines()[0])
        assert line["logger"] == "saga.participant" and line["level"] == "WARNING"
        assert "password is on the command line" in line["message"]


def test_the_service_commands_take_the_observability_options() -> None:
    runner = CliRunner()
    for command in (["coordinator", "run"], ["participant", "run"]):
        result = runner.invoke(main, [*command, "--help"])
        assert result.exit_code == 0
        for option in ("--metrics-port", "--metrics-host", "--log-format"):
            assert option in result.output
    assert "--log-format" in runner.invoke(main, ["--help"]).output
