"""The tiny HTTP server of a service: ``/metrics``, ``/healthz`` and ``/readyz``.

One daemon thread (a :class:`~http.server.ThreadingHTTPServer`) per service,
started by the command line's ``--metrics-port``. It only reads: the Prometheus
text of the service's own registry, and the :class:`~streams._observe.Health` the
service loop writes. ``/healthz`` and ``/readyz`` answer ``200 ok`` or ``503`` with
one line saying why; any other path is a 404. Nothing a client sends reaches the
service: the server takes no parameters and logs no request.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from saga.streams._errors import ConfigurationError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from saga.streams._observe import Health, LoopObserver


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body = generate_latest(self.server.registry)
            except Exception as exc:  # a collector failing must not take the endpoint down
                self._send(500, f"collecting metrics failed: {type(exc).__name__}\n".encode())
                return
            self._send(200, body, CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._answer(*self.server.health.alive())
        elif path == "/readyz":
            self._answer(*self.server.health.ready())
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

    def _answer(self, good: bool, why: str) -> None:
        self._send(200 if good else 503, f"{why}\n".encode())

    def _send(
        self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8"
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes every few seconds are not worth a log line."""


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], registry: CollectorRegistry, health: Health
    ) -> None:
        self.registry = registry
        self.health = health
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class MetricsServer:
    """Serves ``registry`` and ``health`` on ``host:port`` (port 0: any free port) until closed.

    Raises :class:`~streams.ConfigurationError` when the address cannot be bound (in
    use, not a local address): the service should not run blind.
    """

    def __init__(self, registry: CollectorRegistry, health: Health, host: str, port: int) -> None:
        try:
            self._server = _Server((host, port), registry, health)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); "
                "choose another --metrics-port or --metrics-host"
            ) from exc
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="saga-metrics", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` actually bound."""
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}"

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def serve_metrics(observer: LoopObserver, host: str, port: int) -> MetricsServer:
    """Turn ``observer``'s metrics on in a registry of its own and serve them (started)."""
    from saga.streams._metrics import new_registry

    registry = new_registry()
    server = MetricsServer(registry, observer.health, host, port)
    observer.enable_metrics(registry)
    observer.endpoint = server.url
    return server.start()


__all__ = ["MetricsServer", "serve_metrics"]
