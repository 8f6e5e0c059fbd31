"""Keep passwords out of every message and log line.

:func:`redact` is the one redaction function: whatever text may reach a person
(an error sentence, a driver's exception text, a log line) goes through it
before it is printed. It hides

* the password of a URL's user information: ``postgresql://saga:***@host/db``
  (also inside a longer text, whatever the scheme);
* the value of a ``name=value`` setting (or a quoted ``'name': 'value'`` pair)
  whose name says it is a secret: ``password=***``, ``sasl.password=***``,
  ``ssl.key.password=***``, ``sasl.oauthbearer.client.secret=***``;
* every secret the process was told about with :func:`remember` (a storage
  URL's password, a Kafka setting's password), also percent-encoded, wherever it
  appears. Secrets shorter than :data:`MIN_BARE_LENGTH` characters are hidden
  only in the two forms above, so that a short password such as ``saga`` does
  not blank out every other word of a message.

:func:`install_log_redaction` makes every handler of the root logger pass its
formatted lines through :func:`redact`, tracebacks included.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from urllib.parse import quote, quote_plus, unquote, urlsplit

MASK = "***"
MIN_BARE_LENGTH = 6

# scheme://user:password@host; the password runs to the last '@' before a space or quote.
_URL_PASSWORD = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s:@/'\"]*:)(?P<password>[^\s'\"]*)(?P<at>@)"
)
_SECRET_NAME = r"[\w.\-]*(?:password|passwd|secret)[\w.\-]*"  # noqa: S105 - a pattern
# password=value, sasl.password = value, 'password': 'value', "secret": "value"
_SECRET_SETTING = re.compile(
    rf"(?P<head>\b{_SECRET_NAME}(?:\s*=\s*b?['\"]?|['\"]\s*:\s*b?['\"]?))(?P<value>[^\s'\",;&)}}\]]+)",
    re.IGNORECASE,
)
_SECRET_KEY = re.compile(rf"^{_SECRET_NAME}$", re.IGNORECASE)

_lock = threading.Lock()
_remembered: set[str] = set()


def is_secret_name(name: str) -> bool:
    """Whether a setting called ``name`` holds a secret (``sasl.password``, ...)."""
    return bool(_SECRET_KEY.match(name.strip()))


def remember(secret: str | None) -> None:
    """Hide ``secret`` (and its percent-encoded forms) from every later :func:`redact`."""
    if not secret:
        return
    forms = {secret, quote(secret, safe=""), quote_plus(secret, safe="")}
    with _lock:
        _remembered.update(form for form in forms if len(form) >= MIN_BARE_LENGTH)


def remember_settings(settings: Mapping[str, str]) -> None:
    """Remember the value of every setting whose name says it is a secret."""
    for name, value in settings.items():
        if is_secret_name(name):
            remember(value)


def url_password(url: str) -> str | None:
    """The password in ``url``'s user information, decoded; ``None`` when it has none.

    Works on URLs no driver would accept (a port that is not a number, several
    hosts), since those are exactly the ones that end up in error messages.
    """
    try:
        netloc = urlsplit(url.strip()).netloc
    except ValueError:
        netloc = url.partition("://")[2].partition("/")[0]
    userinfo, at, _ = netloc.rpartition("@")
    if not at:
        return None
    _, colon, password = userinfo.partition(":")
    return unquote(password) if colon else None


def redact(text: str) -> str:
    """``text`` with every password it may hold replaced by ``***`` (see the module doc)."""
    with _lock:
        secrets = sorted(_remembered, key=len, reverse=True)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    text = _URL_PASSWORD.sub(lambda m: m["head"] + (MASK if m["password"] else "") + m["at"], text)
    return _SECRET_SETTING.sub(lambda m: m["head"] + MASK, text)


def redact_url(url: str) -> str:
    """``url`` for a message: its password (if any) replaced by ``***``."""
    password = url_password(url)
    remember(password)
    return redact(url)


class _RedactingFormatter(logging.Formatter):
    """Formats with the handler's own formatter, then hides the secrets."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record))


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Pass every line the handlers of ``logger`` (default: the root logger) write through
    :func:`redact`; idempotent."""
    target = logger if logger is not None else logging.getLogger()
    for handler in target.handlers:
        current = handler.formatter or logging.Formatter(logging.BASIC_FORMAT)
        if not isinstance(current, _RedactingFormatter):
            handler.setFormatter(_RedactingFormatter(current))


def forget_all() -> None:
    """Forget every remembered secret (for tests)."""
    with _lock:
        _remembered.clear()


__all__ = [
    "MASK",
    "MIN_BARE_LENGTH",
    "forget_all",
    "install_log_redaction",
    "is_secret_name",
    "redact",
    "redact_url",
    "remember",
    "remember_settings",
    "url_password",
]
