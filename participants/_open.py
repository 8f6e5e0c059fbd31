"""Build a storage adapter from the command line's words."""

from __future__ import annotations

from collections.abc import Sequence

from participants._storage import Storage
from streams import ConfigurationError


def open_storage(
    kind: str,
    *,
    name: str,
    url: str,
    targets: Sequence[str],
    handlers: str | None = None,
    schema: str | None = None,
) -> Storage:
    """A storage adapter of ``kind`` (sql, mongo, redis) for participant ``name``.

    ``handlers`` is the dotted path of a module with custom ``HANDLERS``.
    """
    if not targets:
        raise ConfigurationError("give the participant at least one target with --targets")
    custom = None
    if handlers is not None:
        from participants._handlers import load_handlers

        custom = load_handlers(handlers)
    if kind == "sql":
        from participants._sql import SqlStorage

        return SqlStorage(name, url, targets, schema=schema, handlers=custom)
    raise ConfigurationError(f"storage kind {kind!r} is not available in this version; use sql")
