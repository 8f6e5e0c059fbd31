"""Log output of the command line: text or JSON lines, passwords always redacted.

:func:`configure_logging` sets the level (``-v``: info, ``-vv``: debug; default
warnings only) and the format of the root logger's handler:

* ``text``: ``2026-11-24 11:02:12,345 WARNING saga.coordinator: ...``;
* ``json``: one object per line with ``ts`` (UTC, ISO 8601, milliseconds),
  ``level``, ``logger``, ``message``, every extra field the call passed
  (``log.info(..., extra={"tx_id": tx})``) and ``exc`` (the traceback) when
  there is one.

Either way every line goes through :func:`streams._secrets.redact` (the JSON
formatter redacts each field before encoding it, so JSON escaping cannot hide a
secret from the patterns), and the ``saga.ready`` logger, which writes the one
line a service logs when it is ready, shows at the default level.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any, Final, Literal

from saga.streams._observe import ready_log
from saga.streams._secrets import install_log_redaction, redact

LogFormat = Literal["text", "json"]
LOG_FORMATS: Final = ("text", "json")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What every LogRecord has: everything else on a record came from `extra`.
_STANDARD: Final = frozenset(
    {
        *vars(logging.LogRecord("", 0, "", 0, "", None, None)),
        "message",
        "asctime",
        "taskName",
    }
)


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring); never raises on odd extras."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = dt.datetime.fromtimestamp(record.created, tz=dt.UTC)
        out: dict[str, Any] = {
            "ts": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        for name, value in vars(record).items():
            if name in _STANDARD or name.startswith("_") or name in out:
                continue
            out[name] = _plain(value)
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        elif record.stack_info:
            out["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(out, ensure_ascii=False)


def _plain(value: object) -> object:
    """``value`` as JSON can hold it, with secrets redacted."""
    if value is None or isinstance(value, bool | int | float):
        return value
    return redact(value if isinstance(value, str) else repr(value))


def configure_logging(verbose: int = 0, log_format: LogFormat = "text") -> None:
    """Set the root logger's level and format, and redaction; callable again to change them."""
    level = logging.WARNING - 10 * min(verbose, 2)
    # As before: a process whose logging is set up already (a test runner) keeps its level.
    logging.basicConfig(level=level, format=TEXT_FORMAT)
    set_log_format(log_format)
    # The ready line is INFO, and worth seeing without -v; nothing else gets louder.
    ready_log.setLevel(min(level, logging.INFO))


def set_log_format(log_format: LogFormat) -> None:
    """Switch the root handlers to ``log_format`` (redaction stays on).

    ``text`` leaves a handler's own formatter alone unless it was JSON: a test runner's
    capturing handlers keep theirs.
    """
    for handler in logging.getLogger().handlers:
        current = handler.formatter
        inner = getattr(current, "inner", current)  # under the redacting wrapper
        if log_format == "json" and not isinstance(inner, JsonFormatter):
            handler.setFormatter(JsonFormatter())
        elif log_format == "text" and isinstance(inner, JsonFormatter):
            handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    install_log_redaction()


__all__ = [
    "LOG_FORMATS",
    "TEXT_FORMAT",
    "JsonFormatter",
    "LogFormat",
    "configure_logging",
    "set_log_format",
]
