"""The service commands' observability options: metrics endpoint, log format, tracing.

``saga coordinator run`` and ``saga participant run`` take :func:`observe_options`
(``--metrics-port``, ``--metrics-host``, ``--log-format``) and run their loop inside
:meth:`Observability.serve`, which starts what was asked for around it: the HTTP
endpoint (:mod:`streams._http`) and, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set,
span export (:mod:`streams._otel`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import click

from saga.streams._logs import LOG_FORMATS, LogFormat, set_log_format

if TYPE_CHECKING:
    from saga.streams._observe import LoopObserver

F = TypeVar("F", bound=Callable[..., Any])

LOG_FORMAT_HELP = "Log lines as text or JSON objects (one per line) [env SAGA_LOG_FORMAT]."


@dataclass(frozen=True, slots=True)
class Observability:
    """What a service command was asked to expose."""

    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"

    @contextmanager
    def serve(self, observer: LoopObserver, service_name: str) -> Iterator[None]:
        """Export spans when configured, serve the endpoints when asked, for the block."""
        from saga.streams._otel import setup_export

        setup_export(f"saga-{service_name}", os.environ)
        if not self.metrics_port:
            yield
            return
        from saga.streams._http import serve_metrics

        server = serve_metrics(observer, self.metrics_host, self.metrics_port)
        try:
            yield
        finally:
            server.close()


def log_format_option(fn: F) -> F:
    """``--log-format text|json`` (the ``saga`` group's; a service command repeats it)."""
    return click.option(
        "--log-format",
        type=click.Choice(LOG_FORMATS),
        default=None,
        envvar="SAGA_LOG_FORMAT",
        help=LOG_FORMAT_HELP,
    )(fn)


def observe_options(fn: F) -> F:
    """Add ``--metrics-port``, ``--metrics-host`` and ``--log-format`` to a service command.

    The command receives them as one ``observability`` argument; ``--log-format``
    takes effect at once (it overrides the group's).
    """

    @functools.wraps(fn)
    def command(
        *args: Any,
        metrics_port: int,
        metrics_host: str,
        log_format: LogFormat | None,
        **kwargs: Any,
    ) -> Any:
        if log_format is not None:
            set_log_format(log_format)
        kwargs["observability"] = Observability(metrics_port, metrics_host)
        return fn(*args, **kwargs)

    options = [
        click.option(
            "--metrics-port",
            type=click.IntRange(0, 65535),
            default=0,
            envvar="SAGA_METRICS_PORT",
            help="Serve /metrics (Prometheus), /healthz and /readyz on this port; 0: off "
            "[env SAGA_METRICS_PORT].",
        ),
        click.option(
            "--metrics-host",
            default="127.0.0.1",
            show_default=True,
            envvar="SAGA_METRICS_HOST",
            help="Address the metrics endpoint listens on (0.0.0.0: every interface) "
            "[env SAGA_METRICS_HOST].",
        ),
        log_format_option,
    ]
    wrapped: Any = command
    for option in reversed(options):
        wrapped = option(wrapped)
    return wrapped  # type: ignore[no-any-return]


__all__ = ["Observability", "log_format_option", "observe_options"]
