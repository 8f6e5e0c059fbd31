"""W3C trace context: strict parsing, the client starting a trace, OpenTelemetry export.

The services continuing the trace are tested with their metrics
(tests/unit/test_observability.py); across real processes, by
tests/integration/test_prometheus_scrape.py. OpenTelemetry is an optional extra: its
tests run in processes of their own (a tracer provider is set once per process) and
are skipped where the extra is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saga.coordinator import SagaClient
from saga.streams import KafkaSettings, Step
from saga.streams._trace import TRACEPARENT, TRACESTATE, TraceContext, parse
from saga.streams.testing import InMemoryLog, ManualClock

pytestmark = pytest.mark.unit

SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="trace")
TOPICS = SETTINGS.topics


@pytest.fixture
def log() -> InMemoryLog:
    made = InMemoryLog(SETTINGS, clock=ManualClock())
    made.create_topics(2)
    return made


def test_the_client_starts_a_trace_on_every_request(log: InMemoryLog) -> None:
    with SagaClient(SETTINGS, log=log, status_from_beginning=False) as client:
        first = client.submit(
            [Step("bank", "increment", {"target": "a", "key": "k", "field": "n", "by": 1})]
        )
        second = client.submit(
            [Step("bank", "increment", {"target": "a", "key": "k", "field": "n", "by": 1})]
        )
        client.abort(first, "changed my mind")
    contexts = {
        m.key: parse(m.headers)
        for m in log.records(TOPICS.requests)
        if m.value and b"saga.request" in m.value
    }
    assert set(contexts) == {first.encode(), second.encode()}
    a, b = contexts[first.encode()], contexts[second.encode()]
    assert a is not None and b is not None and a.trace_id != b.trace_id and a.sampled


VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (VALID, True),
        (VALID.upper(), False),  # upper-case hex
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),  # zero trace id
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),  # zero span id
        ("ff" + VALID[2:], False),  # forbidden version
        (VALID + "-extra", False),  # version 00 has exactly four fields
        ("01" + VALID[2:] + "-extra", True),  # a later version: its first 55 characters
        ("01" + VALID[2:] + "extra", False),
        (VALID[:-1], False),
        ("00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01", False),
        ("", False),
    ],
)
def test_traceparent_is_parsed_strictly(value: str, ok: bool) -> None:
    assert (parse([(TRACEPARENT, value.encode())]) is not None) is ok


def test_two_traceparent_headers_make_none_and_a_bad_tracestate_is_dropped() -> None:
    assert parse([(TRACEPARENT, VALID.encode())] * 2) is None
    context = parse([(TRACEPARENT, VALID.encode()), (TRACESTATE, b"a=1\nb=2")])
    assert context is not None and context.state is None
    assert parse([(TRACEPARENT, VALID.encode())]) == TraceContext(
        "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1
    )


def run_python(
    args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in the repository's root, its output captured (env None: ours)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@given(st.lists(st.tuples(st.sampled_from([TRACEPARENT, TRACESTATE, "x"]), st.binary(max_size=80))))
def test_no_header_bytes_make_parsing_raise(headers: list[tuple[str, bytes]]) -> None:
    context = parse(headers)
    if context is not None:
        assert parse(context.headers()) == context


def test_spans_are_exported_with_opentelemetry_and_continue_the_trace(tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.sdk")
    # In a process of its own: a tracer provider is set once per process.
    script = tmp_path / "spans.py"
    script.write_text(
        "import os\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
        "from saga.streams._otel import Spans, setup_export\n"
        "from saga.streams._trace import new_trace\n"
        "exporter = InMemorySpanExporter()\n"
        "assert setup_export('saga-test', os.environ, exporter=exporter)\n"
        "parent = new_trace()\n"
        "spans = Spans('saga.participant')\n"
        "made = spans.record('saga.participant.apply', parent, attributes={'saga.step': 1})\n"
        "[span] = exporter.get_finished_spans()\n"
        "assert made.trace_id == parent.trace_id == f'{span.context.trace_id:032x}'\n"
        "assert made.span_id == f'{span.context.span_id:016x}' != parent.span_id\n"
        "assert f'{span.parent.span_id:016x}' == parent.span_id\n"
        "assert span.name == 'saga.participant.apply' and span.attributes['saga.step'] == 1\n"
        "from opentelemetry import trace\n"
        "client = Spans('saga.client')\n"
        "with trace.get_tracer('app').start_as_current_span('app') as app:\n"
        "    sent = client.record('saga.client.submit', client.current())\n"
        "app_id = app.get_span_context().trace_id\n"
        "assert sent.trace_id == f'{app_id:032x}', 'the client continues the current span'\n"
        "print('ok')\n"
    )
    done = run_python([str(script)])
    assert done.stdout.strip() == "ok", done.stderr


def test_with_an_endpoint_spans_go_to_the_collector_over_otlp(tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    received: list[tuple[str, int]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, len(body)))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Collector) as collector:
        threading.Thread(target=collector.serve_forever, daemon=True).start()
        script = (
            "import os\n"
            "from saga.streams._otel import Spans, setup_export\n"
            "from saga.streams._trace import new_trace\n"
            "assert setup_export('saga-test', os.environ)\n"
            "Spans('saga.coordinator').record('saga.coordinator.decide', new_trace())\n"
            "print('ok')\n"  # the tracer provider sends what it holds at exit
        )
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.server_address[1]}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
        done = run_python(["-c", script], env)
        collector.shutdown()
    assert done.stdout.strip() == "ok", done.stderr
    assert received and received[0][0] == "/v1/traces" and received[0][1] > 0


def test_without_an_endpoint_nothing_imports_opentelemetry(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from saga.coordinator import SagaClient\n"
        "from saga.streams._otel import Spans, setup_export\n"
        "assert not setup_export('saga-test', {})\n"
        "Spans('saga.client').record('saga.client.submit', Spans('x').current())\n"
        "assert not any(m.startswith('opentelemetry') for m in sys.modules), 'imported'\n"
        "print('ok')\n"
    )
    done = run_python(["-c", script])
    assert done.stdout.strip() == "ok", done.stderr
