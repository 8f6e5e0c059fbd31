"""Spans through OpenTelemetry, when it is installed and asked for; trace ids otherwise.

:class:`Spans` is what a process uses to continue a saga's trace (see
:mod:`streams._trace`). It exports spans only when OpenTelemetry is usable:

* a service (``saga coordinator run``, ``saga participant run``) calls
  :func:`setup_export` at start-up: with ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set and the ``otel`` extra installed
  (``pip install 'saga-olep[otel]'``), it installs a tracer provider that sends
  spans over OTLP (``OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf`` for HTTP, gRPC
  otherwise; the exporter reads the rest of the standard ``OTEL_*`` variables);
* a client library user who already uses OpenTelemetry (their code imported it)
  gets spans through their own tracer provider, and ``submit`` continues their
  current span.

Otherwise nothing here imports ``opentelemetry`` (an application that never
imported it has no span to continue, and a service without an endpoint has
nowhere to send one), and span ids are random: the trace context still flows.
OpenTelemetry's objects are used through ``Any``: the package is optional, so
its types cannot be part of this module's signatures.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

from saga.streams._trace import TraceContext, new_trace

log = logging.getLogger("saga.trace")

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_exporting = False  # this process installed an exporting tracer provider


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def setup_export(service_name: str, environ: Mapping[str, str], exporter: Any = None) -> bool:
    """Export this process's spans over OTLP when configured; whether spans are exported.

    ``exporter`` replaces the OTLP exporter (tests pass an in-memory one; then no
    endpoint is needed). Missing packages with an endpoint set are reported once as a
    warning, not an error: tracing is never a reason for a service not to run.
    """
    global _exporting  # noqa: PLW0603 - one tracer provider per process, like OpenTelemetry's own
    if exporter is None and not any(environ.get(v) for v in _ENDPOINT_VARIABLES):
        return False
    exporter_installed = exporter is not None or _installed(_otlp(environ))
    if not (_installed("opentelemetry.sdk") and exporter_installed):
        log.warning(
            "OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed: no spans "
            "are exported; install saga-olep[otel]"
        )
        return False
    trace = importlib.import_module("opentelemetry.trace")
    sdk_trace = importlib.import_module("opentelemetry.sdk.trace")
    export = importlib.import_module("opentelemetry.sdk.trace.export")
    resources = importlib.import_module("opentelemetry.sdk.resources")
    if exporter is None:
        exporter = importlib.import_module(_otlp(environ)).OTLPSpanExporter()
        processor = export.BatchSpanProcessor(exporter)
    else:
        processor = export.SimpleSpanProcessor(exporter)
    provider = sdk_trace.TracerProvider(
        resource=resources.Resource.create({"service.name": service_name})
    )
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _exporting = True
    return True


def _otlp(environ: Mapping[str, str]) -> str:
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
    )
    kind = "http" if protocol.startswith("http") else "grpc"
    return f"opentelemetry.exporter.otlp.proto.{kind}.trace_exporter"


class Spans:
    """The spans of one component (``scope``: ``saga.client``, ``saga.coordinator``, ...).

    Spans go to OpenTelemetry's current tracer provider when this process exports
    (:func:`setup_export`) or the application imported OpenTelemetry itself;
    otherwise :meth:`record` only makes the ids that continue the trace.
    """

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self._tracer: Any = None
        self._looked = False

    def _otel(self) -> Any:
        # Looked up once, when first needed: the application may import OpenTelemetry
        # after creating its client.
        if not self._looked and (_exporting or "opentelemetry.trace" in sys.modules):
            self._looked = True
            self._tracer = importlib.import_module("opentelemetry.trace").get_tracer(self.scope)
        return self._tracer

    def current(self) -> TraceContext | None:
        """The application's current OpenTelemetry span, if it has one (never imports it)."""
        if "opentelemetry.trace" not in sys.modules:
            return None
        trace = sys.modules["opentelemetry.trace"]
        return _from_otel(trace.get_current_span().get_span_context())

    def record(
        self,
        name: str,
        parent: TraceContext | None,
        *,
        start_ns: int | None = None,
        attributes: Mapping[str, str | int] | None = None,
        kind: str = "INTERNAL",
    ) -> TraceContext:
        """A finished span ``name``, a child of ``parent`` (a new trace without one).

        Returns the span's context, to put on the records sent on its behalf. The
        span runs from ``start_ns`` (``time.time_ns()``; default now) to now.
        Never raises: a failing tracer costs the span, not the record.
        """
        tracer = self._otel()
        fallback = parent.child() if parent is not None else new_trace()
        if tracer is None:
            return fallback
        try:
            trace = importlib.import_module("opentelemetry.trace")
            context = None
            if parent is not None:
                remote = trace.SpanContext(
                    trace_id=int(parent.trace_id, 16),
                    span_id=int(parent.span_id, 16),
                    is_remote=True,
                    trace_flags=trace.TraceFlags(parent.flags),
                    trace_state=trace.TraceState.from_header([parent.state or ""]),
                )
                context = trace.set_span_in_context(trace.NonRecordingSpan(remote))
            span = tracer.start_span(
                name,
                context=context,
                kind=getattr(trace.SpanKind, kind),
                attributes=dict(attributes or {}),
                start_time=start_ns,
            )
            span.end(end_time=time.time_ns())
            made = _from_otel(span.get_span_context())
        except Exception as exc:  # tracing must never cost a record
            log.debug("could not record span %s: %s", name, exc)
            return fallback
        if made is None or (parent is not None and made.span_id == parent.span_id):
            # OpenTelemetry without an SDK: its no-op spans have no ids of their own.
            return fallback
        if parent is not None and parent.state and made.state is None:
            return TraceContext(made.trace_id, made.span_id, made.flags, parent.state)
        return made


def _from_otel(span_context: Any) -> TraceContext | None:
    if not span_context.is_valid:
        return None
    state = span_context.trace_state.to_header() if span_context.trace_state else None
    return TraceContext(
        f"{span_context.trace_id:032x}",
        f"{span_context.span_id:016x}",
        int(span_context.trace_flags),
        state or None,
    )


__all__ = ["Spans", "setup_export"]
