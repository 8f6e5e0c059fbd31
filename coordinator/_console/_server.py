"""The console's HTTP server: one static page and a small JSON API, standard library only.

Routes (every answer is JSON but ``/`` and ``/static/*``; an error is
``{"error": "<one sentence>"}`` with a 4xx/5xx status)::

    GET  /                              the page (the CSRF token is in a meta tag)
    GET  /static/app.js, /static/app.css
    GET  /healthz                       "ok" while the server runs
    GET  /api/sagas?q=&state=&participant=&limit=   rows of the view, newest first
    GET  /api/sagas/<tx_id>             one row and its dead letters
    GET  /api/sagas/<tx_id>/history     every record of the transaction (admin module)
    GET  /api/metrics                   counts by state, decided in the last minute, DLQ size
    GET  /api/dlq, /api/participants, /api/audit
    POST /api/sagas/<tx_id>/abort       {"reason": "..."}
    POST /api/sagas/<tx_id>/resolve     {"step": N, "note": "..."}
    POST /api/dlq/redrive               {"partition": P, "offset": O}

Security: the server binds 127.0.0.1 unless told otherwise. A POST must carry the
header ``X-Saga-Console-Token`` with the random token of this process (the page
reads it from its meta tag; a foreign page cannot read it, the browser's same-origin
rule forbids that) and a JSON body; an ``Origin`` header, when sent, must be this
server's. The ``Host`` header must name this server (``--public-host`` adds names, as
behind a proxy), which stops DNS-rebinding pages from reading the API.
"""

from __future__ import annotations

import hmac
import html
import json
import logging
import re
import secrets
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, TypeGuard
from urllib.parse import parse_qs, unquote, urlsplit

from saga.coordinator._console._actions import OPERATOR_PATTERN, ActionRefused, Operations
from saga.coordinator._console._store import ViewStore
from saga.coordinator._console._view import StatusTable
from saga.streams import SagaError, SagaState
from saga.streams._lifecycle import wall_clock_ms
from saga.streams._secrets import redact

log = logging.getLogger("saga.console")

TOKEN_HEADER = "X-Saga-Console-Token"  # noqa: S105 - a header name, not a secret
MAX_BODY_BYTES = 16 * 1024
_STATIC = {"app.js": "text/javascript", "app.css": "text/css"}
_SECURITY_HEADERS = (
    ("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'; base-uri 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)


@dataclass
class Console:
    """What the request handlers share: the view, the actions and the settings."""

    store: ViewStore
    table: StatusTable
    operations: Operations
    operator: str
    prefix: str
    user_header: str | None = None
    public_hosts: frozenset[str] = frozenset()
    history_timeout: float = 10.0
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    allowed_hosts: set[str] = field(default_factory=set)

    def who(self, headers: Any) -> str:
        """The operator of a request: the proxy's user header when configured, else ours."""
        if self.user_header:
            name = headers.get(self.user_header)
            if not name or not re.fullmatch(OPERATOR_PATTERN, name.strip()):
                raise ActionRefused(
                    f"no valid {self.user_header} header: the authenticating proxy must "
                    "name the user",
                    403,
                )
            return str(name.strip())
        return self.operator


class _Handler(BaseHTTPRequestHandler):
    server_version = "saga-console"
    console: Console  # set on the subclass made by make_server

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    # ------------------------------------------------------------------ plumbing

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in _SECURITY_HEADERS:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, payload: Any, status: int = 200) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json; charset=utf-8")

    def _error(self, status: int, message: str) -> None:
        self._json({"error": redact(message)}, status)

    def _host_ok(self) -> bool:
        host = (self.headers.get("Host") or "").lower()
        return host in self.console.allowed_hosts

    def _dispatch(self, method: str) -> None:
        if not self._host_ok():
            self._error(
                HTTPStatus.MISDIRECTED_REQUEST, "unknown Host header: start with --public-host NAME"
            )
            return
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            if method == "POST":
                self._post(parts, self._body())
            else:
                self._get(parts, query)
        except ActionRefused as exc:
            self._error(exc.status, str(exc))
        except SagaError as exc:
            self._error(HTTPStatus.BAD_GATEWAY, str(exc))
        except Exception as exc:  # a handler must answer, never leave the browser hanging
            log.exception("console request %s %s failed", method, url.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _body(self) -> dict[str, Any]:
        """The JSON object of a POST, after the CSRF checks."""
        token = self.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(token.encode(), self.console.token.encode()):
            raise ActionRefused(
                "missing or wrong console token: actions are accepted only from the "
                "console's own page",
                403,
            )
        origin = self.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc.lower() not in self.console.allowed_hosts:
            raise ActionRefused("a request from another site's page is not accepted", 403)
        if not (self.headers.get("Content-Type") or "").startswith("application/json"):
            raise ActionRefused("send the action as application/json", 415)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            raise ActionRefused(f"the body must be at most {MAX_BODY_BYTES} bytes", 413)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            raise ActionRefused("the body is not JSON") from None
        if not isinstance(body, dict):
            raise ActionRefused("the body must be a JSON object")
        return body

    # ------------------------------------------------------------------ routes

    def _get(self, parts: list[str], query: dict[str, str]) -> None:
        c = self.console
        if not parts:
            self._page()
        elif parts == ["favicon.ico"]:
            self._send(HTTPStatus.NO_CONTENT, b"", "image/x-icon")
        elif parts == ["healthz"]:
            self._send(200, b"ok\n", "text/plain; charset=utf-8")
        elif len(parts) == 2 and parts[0] == "static" and parts[1] in _STATIC:
            data = (
                resources.files("saga.coordinator._console")
                .joinpath("static", parts[1])
                .read_bytes()
            )
            self._send(200, data, _STATIC[parts[1]] + "; charset=utf-8")
        elif parts == ["api", "sagas"]:
            state = query.get("state", "")
            if state and state not in {s.value for s in SagaState}:
                raise ActionRefused(f"unknown state {state[:40]!r}")
            try:
                limit = int(query.get("limit", "200"))
            except ValueError:
                raise ActionRefused("limit must be a number") from None
            rows = c.store.sagas(
                q=query.get("q", "").strip()[:200],
                state=state,
                participant=query.get("participant", "").strip()[:64],
                limit=limit,
            )
            self._json({"sagas": rows})
        elif len(parts) == 3 and parts[:2] == ["api", "sagas"]:
            row = c.store.saga(parts[2])
            if row is None:
                raise ActionRefused(f"no saga {parts[2][:140]!r} in the view (yet)", 404)
            self._json({"saga": row, "dead_letters": c.store.dead_letters(50, tx_id=parts[2])})
        elif len(parts) == 4 and parts[:2] == ["api", "sagas"] and parts[3] == "history":
            self._json({"entries": c.operations.history(parts[2], c.history_timeout)})
        elif parts == ["api", "metrics"]:
            metrics = c.store.metrics(wall_clock_ms())
            metrics.update(
                view=c.table.health,
                caught_up=c.table.wait_caught_up(0),
                forged_skipped=c.table.forged,
                database=c.store.kind,
                prefix=c.prefix,
                capabilities=c.operations.capabilities(),
                actions_disabled=c.operations.actions_disabled,
            )
            self._json(metrics)
        elif parts == ["api", "dlq"]:
            self._json({"dead_letters": c.store.dead_letters(200)})
        elif parts == ["api", "participants"]:
            found = c.operations.participants()
            self._json({"available": found is not None, "participants": found or []})
        elif parts == ["api", "audit"]:
            self._json({"audit": c.store.audit(200)})
        else:
            raise ActionRefused("no such page", 404)

    def _post(self, parts: list[str], body: dict[str, Any]) -> None:
        c = self.console
        operator = c.who(self.headers)
        if len(parts) == 4 and parts[:2] == ["api", "sagas"] and parts[3] == "abort":
            self._json(c.operations.abort(parts[2], body.get("reason", ""), operator))
        elif len(parts) == 4 and parts[:2] == ["api", "sagas"] and parts[3] == "resolve":
            step = body.get("step")
            if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 64:
                raise ActionRefused("step must be the step's index (0 to 63)")
            self._json(c.operations.resolve(parts[2], step, body.get("note", ""), operator))
        elif parts == ["api", "dlq", "redrive"]:
            partition, offset = body.get("partition"), body.get("offset")
            if not (_count(partition) and _count(offset)):
                raise ActionRefused("partition and offset must be numbers")
            self._json(c.operations.redrive(partition, offset, operator))
        else:
            raise ActionRefused("no such action", 404)

    def _page(self) -> None:
        c = self.console
        try:
            operator = c.who(self.headers)
        except ActionRefused:
            operator = "unknown"
        page = (
            resources.files("saga.coordinator._console")
            .joinpath("static", "index.html")
            .read_text()
        )
        page = (
            page.replace("{{token}}", html.escape(c.token))
            .replace("{{operator}}", html.escape(operator))
            .replace("{{prefix}}", html.escape(c.prefix))
        )
        self._send(200, page.encode(), "text/html; charset=utf-8")


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def make_server(console: Console, host: str, port: int) -> ThreadingHTTPServer:
    """A server for ``console`` bound to ``host:port`` (port 0: any free port)."""
    handler = type("ConsoleHandler", (_Handler,), {"console": console})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    bound = server.server_address[1]
    names = {host, "127.0.0.1", "localhost", "[::1]", *console.public_hosts}
    console.allowed_hosts = {f"{n.lower()}:{bound}" for n in names} | {
        n.lower() for n in console.public_hosts
    }
    return server
