"""Build a storage adapter from the command line's words.

The storage URL may hold a password, and a command line is readable by every
user of the machine (``ps``). :func:`storage_url` therefore also takes the URL
from a file or an environment variable, and the password alone from a file;
every password it sees is remembered by :mod:`streams._secrets`, so that no
message or log line of the process shows it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import quote

from saga.participants._storage import Storage
from saga.streams import ConfigurationError
from saga.streams._faults import NO_FAULTS, Faults
from saga.streams._secrets import redact_url, remember, url_password

KINDS = ("sql", "mongo", "redis")

# storage kind -> (the extra that installs its driver, the modules it needs). The
# drivers are extras so that a client-only `pip install saga-olep` stays small.
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sql": ("postgres", ("sqlalchemy",)),
    "mongo": ("mongo", ("pymongo",)),
    "redis": ("redis", ("redis",)),
}

URL_ENV = "SAGA_STORAGE_URL"
"""The environment variable holding the storage URL when no other source is given."""

_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?:(?P<userinfo>[^/?#]*)@)?")


def storage_url(
    *,
    url: str | None = None,
    url_file: str | None = None,
    url_env: str | None = None,
    password_file: str | None = None,
    environ: Mapping[str, str],
) -> str:
    """The storage URL from exactly one source, with the password of ``password_file``.

    Sources: ``url`` (the command line), the first line of ``url_file``, the
    variable named ``url_env``; with none of them, the ``SAGA_STORAGE_URL``
    variable. ``password_file``'s first line replaces the URL's password.

    Raises:
        ConfigurationError: no source or more than one, an unreadable or empty
            file, an unset variable, or a password for a URL without a host.
    """
    given = [
        name
        for name, value in (("--url", url), ("--url-file", url_file), ("--url-env", url_env))
        if value is not None
    ]
    if len(given) > 1:
        raise ConfigurationError(
            f"give the storage URL once: {' and '.join(given)} were both given; keep one"
        )
    if url_file is not None:
        found = _first_line(url_file, "storage URL")
    elif url_env is not None:
        found = environ.get(url_env, "").strip()
        if not found:
            raise ConfigurationError(
                f"the environment variable {url_env} (named by --url-env) is not set or empty; "
                "set it to the storage URL"
            )
    elif url is not None:
        found = url.strip()
    else:
        found = environ.get(URL_ENV, "").strip()
        if not found:
            raise ConfigurationError(
                "no storage URL: pass --url-file PATH, --url-env NAME or --url URL, "
                f"or set {URL_ENV}"
            )
    if not found:
        raise ConfigurationError("the storage URL is empty; give the URL of the storage")
    remember(url_password(found))
    if password_file is not None:
        found = with_password(found, _first_line(password_file, "storage password"))
    return found


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` (percent-encoded) as the password of its user information."""
    remember(password)
    match = _USERINFO.match(url)
    rest = url[match.end() :] if match else ""
    if match is None or not rest or rest.startswith("/"):
        raise ConfigurationError(
            f"a password needs a URL with a host, such as postgresql://user@host:5432/db; "
            f"{redact_url(url)!r} has none"
        )
    user = (match["userinfo"] or "").partition(":")[0]
    return f"{match['scheme']}{user}:{quote(password, safe='')}@{rest}"


def _first_line(path: str, what: str) -> str:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read the {what} from {path}: {exc.strerror or exc}; check the path and "
            "its permissions"
        ) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"{path} is not UTF-8 text; write the {what} as UTF-8") from exc
    lines = text.splitlines()
    line = lines[0].strip() if lines else ""
    if not line:
        raise ConfigurationError(f"{path} is empty; write the {what} on its first line")
    return line


def require_driver(kind: str, url: str = "") -> None:
    """Import the driver of storage ``kind``; a missing one names the extra to install.

    PostgreSQL URLs also need psycopg (SQLite's driver ships with Python).

    Raises:
        ConfigurationError: the driver is not installed: "the sql storage needs the
            postgres extra: pip install 'saga-olep[postgres]'" (the CLI exits 2).
    """
    if kind not in EXTRAS:
        return
    extra, drivers = EXTRAS[kind]
    modules = [*drivers, "psycopg"] if kind == "sql" and url.startswith("postgres") else drivers
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigurationError(
                f"the {kind} storage needs the {extra} extra ({exc.name or module} is not "
                f"installed): pip install 'saga-olep[{extra}]'"
            ) from None


def open_storage(
    kind: str,
    *,
    name: str,
    url: str,
    targets: Sequence[str],
    handlers: str | None = None,
    schema: str | None = None,
    faults: Faults = NO_FAULTS,
) -> Storage:
    """A storage adapter of ``kind`` (sql, mongo, redis) for participant ``name``.

    ``handlers`` is the dotted path of a module with custom ``HANDLERS``.
    ``schema`` names where the participant's data lives inside the server: the SQL
    schema of the tables and ledger; the MongoDB database (default: the URL's path,
    else ``saga``); the Redis key prefix (default ``saga``).
    Each adapter imports its driver only when it is chosen; a driver that is not
    installed raises :class:`ConfigurationError` naming the extra that brings it
    (:func:`require_driver`). The URL's password
    is hidden from every later message and log line (:mod:`streams._secrets`).
    ``faults`` are the crash tests' hooks (:mod:`streams._faults`), no-ops by default.
    """
    remember(url_password(url))
    if not targets:
        raise ConfigurationError("give the participant at least one target with --targets")
    require_driver(kind, url)
    custom = None
    if handlers is not None:
        from saga.participants._handlers import load_handlers

        custom = load_handlers(handlers)
    if kind == "sql":
        from saga.participants.sql._adapter import SqlStorage

        return SqlStorage(name, url, targets, schema=schema, handlers=custom, faults=faults)
    if kind == "mongo":
        from saga.participants.mongo._adapter import MongoStorage

        return MongoStorage(name, url, targets, database=schema, handlers=custom, faults=faults)
    if kind == "redis":
        from saga.participants.redis._adapter import DEFAULT_PREFIX, RedisStorage

        return RedisStorage(
            name,
            url,
            targets,
            prefix=schema or DEFAULT_PREFIX,
            handlers=custom,
            faults=faults,
        )
    raise ConfigurationError(f"storage kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
