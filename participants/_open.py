"""Build a storage adapter from the command line's words."""

from __future__ import annotations

from collections.abc import Sequence

from participants._storage import Storage
from streams import ConfigurationError

KINDS = ("sql", "mongo", "redis")


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
    ``schema`` names where the participant's data lives inside the server: the SQL
    schema of the tables and ledger; the MongoDB database (default: the URL's path,
    else ``saga``); the Redis key prefix (default ``saga``).
    Each adapter imports its driver only when it is chosen.
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
    if kind == "mongo":
        from participants._mongo import MongoStorage

        return MongoStorage(name, url, targets, database=schema, handlers=custom)
    if kind == "redis":
        from participants._redis import DEFAULT_PREFIX, RedisStorage

        return RedisStorage(name, url, targets, prefix=schema or DEFAULT_PREFIX, handlers=custom)
    raise ConfigurationError(f"storage kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
