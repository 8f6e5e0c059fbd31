"""What one reconciliation run is asked to do: a frozen settings object built once.

Nothing here touches Spark, Kafka or a store; the command line builds a
:class:`ReconcileConfig` from its options (every parse error is a
:class:`~streams.ConfigurationError` with one sentence) and hands it to
:func:`streams.reconcile.run`.

Store specs
-----------
Ledgers (``--ledger``) and business tables (``--table``) are named by one
string, ``KIND:URL#key=value&key=value``; the fragment holds what the URL
cannot (no driver reads a URL's fragment, so it is free)::

    sql:postgresql://saga:saga@127.0.0.1:15432/saga#schema=bank
    mongo:mongodb://127.0.0.1:27027/#database=shop
    redis:redis://127.0.0.1:16379/0#prefix=saga

The URL may be an environment variable instead, ``$NAME`` or ``${NAME}`` right
after ``KIND:``; the job reads its value itself, so a URL holding a password
need not appear on the command line (where process lists show it)::

    saga reconcile --ledger 'sql:$SAGA_POSTGRES_URL#schema=bank'

Keys per kind: ``sql`` — ``schema``, ``table``; ``mongo`` — ``database``,
``collection``; ``redis`` — ``prefix``, ``target`` (tables only). Ledgers also
take ``participants=a,b``: the participant names whose steps that ledger
records (default: every name found in it).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal, cast
from urllib.parse import parse_qsl, urlsplit

from saga.streams._errors import ConfigurationError
from saga.streams.kafka import KafkaSettings

__all__ = [
    "DEFAULT_GRACE_MS",
    "BusinessCheck",
    "LedgerSource",
    "ReconcileConfig",
    "StoreKind",
    "StoreSpec",
    "TableSource",
    "parse_check",
    "parse_duration_ms",
    "parse_ledger",
    "parse_offsets",
    "parse_since",
    "parse_table",
]

StoreKind = Literal["sql", "mongo", "redis"]

DEFAULT_GRACE_MS: Final = 60_000
"""How long after a deadline or a decision a saga may still be finishing on its own."""

IDENTIFIER: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
_REDIS_PREFIX: Final = re.compile(r"[^\s*?\[\]\\:\x00-\x1f]{1,64}")
_SCHEMES: Final[dict[str, tuple[str, ...]]] = {
    "sql": ("postgresql", "postgres", "mariadb", "mysql"),
    "mongo": ("mongodb", "mongodb+srv"),
    "redis": ("redis", "rediss", "unix"),
}
_KEYS: Final[dict[str, frozenset[str]]] = {
    "sql": frozenset({"schema", "table", "participants"}),
    "mongo": frozenset({"database", "collection", "participants"}),
    "redis": frozenset({"prefix", "target", "participants"}),
}
_VARIABLE: Final = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?")
_UNIT_MS: Final = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


@dataclass(frozen=True)
class StoreSpec:
    """Where a ledger or a table lives: ``kind``, the URL without fragment, and the options."""

    kind: StoreKind
    url: str
    options: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def option(self, name: str, default: str) -> str:
        return self.options.get(name) or default

    @property
    def where(self) -> str:
        """The store's address for messages: scheme, host and path, never a password."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{self.kind} {parts.scheme}://{host}{port}{parts.path}"


@dataclass(frozen=True)
class LedgerSource:
    """A participant ledger to cross-check against the log (I4)."""

    store: StoreSpec

    @property
    def participants(self) -> tuple[str, ...] | None:
        """The participant names this ledger answers for, when the spec names them."""
        names = self.store.options.get("participants")
        if not names:
            return None
        return tuple(n.strip() for n in names.split(",") if n.strip())

    @property
    def label(self) -> str:
        o = self.store.options
        if self.store.kind == "sql":
            return f"{self.store.where}#{o.get('schema', 'public')}.{o.get('table', 'saga_ledger')}"
        if self.store.kind == "mongo":
            return (
                f"{self.store.where}#{o.get('database', '')}.{o.get('collection', 'saga_ledger')}"
            )
        return f"{self.store.where}#{o.get('prefix', 'saga')}:ledger"


@dataclass(frozen=True)
class TableSource:
    """A store table exposed to business checks as the Spark SQL view ``name``."""

    name: str
    store: StoreSpec


@dataclass(frozen=True)
class BusinessCheck:
    """A business invariant (I5) as a Spark SQL query over the tables.

    The check holds when the query returns no row, or, when its result has a
    boolean column ``ok``, when it returns rows and ``ok`` is true in every one.
    """

    name: str
    sql: str


@dataclass(frozen=True)
class ReconcileConfig:
    """Everything one run needs; see ``saga reconcile --help`` for the meaning of each."""

    settings: KafkaSettings
    out: Path
    jars_dir: Path | None = None
    master: str | None = None
    grace_ms: int = DEFAULT_GRACE_MS
    now_ms: int | None = None
    since_ms: int | None = None
    starting_offsets: Mapping[str, Mapping[int, int]] | None = None
    ending_offsets: Mapping[str, Mapping[int, int]] | None = None
    ledgers: tuple[LedgerSource, ...] = ()
    tables: tuple[TableSource, ...] = ()
    checks: tuple[BusinessCheck, ...] = ()
    replay: bool = False
    replay_rate: float | None = None
    keys_dir: Path | None = None
    write_all: bool = False
    show: int = 20
    driver_memory: str = "2g"
    executor_memory: str | None = None
    shuffle_partitions: int | None = None
    """Spark SQL shuffle partitions; None: chosen from the size of the log read
    (:func:`._spark.shuffle_partitions_for`)."""
    spark_conf: Mapping[str, str] = field(default_factory=dict)
    verbose: int = 0

    def __post_init__(self) -> None:
        if self.grace_ms < 0:
            raise ConfigurationError("--grace must not be negative")
        if self.replay_rate is not None and self.replay_rate <= 0:
            raise ConfigurationError(
                "--replay-rate must be a positive number of records per second"
            )
        if self.shuffle_partitions is not None and self.shuffle_partitions < 1:
            raise ConfigurationError("--shuffle-partitions must be at least 1")
        if self.since_ms is not None and self.starting_offsets is not None:
            raise ConfigurationError("give either --since or --starting-offsets, not both")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ConfigurationError("two --table options use the same name")
        checks = [c.name for c in self.checks]
        if len(set(checks)) != len(checks):
            raise ConfigurationError("two --check options use the same name")
        object.__setattr__(self, "spark_conf", MappingProxyType(dict(self.spark_conf)))

    def as_of_ms(self) -> int:
        """The audit's "now": ``now_ms`` when given, else the wall clock."""
        return self.now_ms if self.now_ms is not None else time.time_ns() // 1_000_000


# ---------------------------------------------------------------- parsing


def parse_duration_ms(text: str, what: str) -> int:
    """``"90"`` (seconds), ``"1500ms"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"1d"`` as milliseconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ConfigurationError(
            f"{what} {text!r} is not a duration: use a number of seconds or 1500ms, 30s, 5m, 2h, 1d"
        )
    number, unit = match.groups()
    return int(float(number) * _UNIT_MS[unit or "s"])


def parse_since(text: str, now_ms: int) -> int:
    """``--since``: a duration back from now, an ISO 8601 time, or epoch milliseconds."""
    value = text.strip()
    if value.isdigit() and len(value) >= 12:
        return int(value)
    try:
        return now_ms - parse_duration_ms(value, "--since")
    except ConfigurationError:
        pass
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigurationError(
            f"--since {text!r} is neither a duration (30m, 2h, 1d), an ISO 8601 time "
            "(2025-01-31T12:00:00Z) nor epoch milliseconds"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


def parse_offsets(text: str, what: str) -> dict[str, dict[int, int]]:
    """Spark's offsets JSON, ``{"saga.requests": {"0": 10, "1": 0}, ...}``."""
    import json

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"{what} is not JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ConfigurationError(f'{what} must be an object like {{"saga.requests": {{"0": 10}}}}')
    out: dict[str, dict[int, int]] = {}
    for topic, parts in data.items():
        if not isinstance(parts, dict):
            raise ConfigurationError(f"{what}: the offsets of {topic} must be an object")
        try:
            out[str(topic)] = {int(p): int(o) for p, o in parts.items()}
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"{what}: partitions and offsets of {topic} must be integers"
            ) from None
    return out


def _expand(url: str, what: str, environ: Mapping[str, str]) -> str:
    """``url`` with a leading ``$NAME`` / ``${NAME}`` replaced by that variable's value."""
    found = _VARIABLE.match(url)
    if found is None:
        return url
    name = found.group(1) or found.group(2)
    value = environ.get(name, "")
    if not value:
        raise ConfigurationError(
            f"{what} reads the URL from ${name}, which is not set: export it "
            '(e.g. eval "$(infra/services.sh env)") or write the URL itself'
        )
    return value + url[found.end() :]


def _one_of(schemes: tuple[str, ...]) -> str:
    """``a://``, ``a:// or b://``, ``a://, b:// or c://``."""
    names = [s + "://" for s in schemes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _store(text: str, what: str, environ: Mapping[str, str] | None = None) -> StoreSpec:
    kind, sep, rest = text.partition(":")
    if not sep or kind not in _SCHEMES:
        raise ConfigurationError(
            f"{what} {_shown(text)} must start with sql:, mongo: or redis: "
            "(e.g. sql:postgresql://user:pw@host:5432/db#schema=bank)"
        )
    url, _, fragment = rest.partition("#")
    url = _expand(url, what, os.environ if environ is None else environ)
    scheme = urlsplit(url).scheme
    if scheme not in _SCHEMES[kind]:
        raise ConfigurationError(
            f"{what} {_shown(text)}: a {kind} store needs a {_one_of(_SCHEMES[kind])} URL"
        )
    options = dict(parse_qsl(fragment, keep_blank_values=True))
    unknown = sorted(set(options) - _KEYS[kind])
    if unknown:
        raise ConfigurationError(
            f"{what} {_shown(text)}: unknown option(s) {', '.join(unknown)} for a {kind} store "
            f"(known: {', '.join(sorted(_KEYS[kind]))})"
        )
    for name in ("schema", "table", "collection", "target"):
        if name in options and not IDENTIFIER.fullmatch(options[name]):
            raise ConfigurationError(f"{what}: {name} {options[name]!r} is not a plain name")
    if "database" in options and not re.fullmatch(r"[A-Za-z0-9_-]{1,63}", options["database"]):
        raise ConfigurationError(f"{what}: database {options['database']!r} is not a plain name")
    if "prefix" in options and not _REDIS_PREFIX.fullmatch(options["prefix"]):
        raise ConfigurationError(f"{what}: Redis key prefix {options['prefix']!r} is not allowed")
    for name in (options.get("participants") or "").split(","):
        if name.strip() and not _NAME.fullmatch(name.strip()):
            raise ConfigurationError(f"{what}: participant name {name.strip()!r} is not allowed")
    return StoreSpec(cast(StoreKind, kind), url, options)


def _shown(text: str) -> str:
    """A spec for a message, with any password in its URL masked."""
    return repr(re.sub(r"(//[^:/@]+:)[^@]*@", r"\1***@", text))


def parse_ledger(text: str, environ: Mapping[str, str] | None = None) -> LedgerSource:
    """``--ledger KIND:URL#options`` (URL may be ``$NAME``, read from ``environ``,
    by default the process environment)."""
    source = LedgerSource(_store(text, "--ledger", environ))
    if "target" in source.store.options:
        raise ConfigurationError("--ledger: target= is for --table, not for a ledger")
    return source


def parse_table(text: str, environ: Mapping[str, str] | None = None) -> TableSource:
    """``--table NAME=KIND:URL#options``: NAME becomes a Spark SQL view (URL as for
    :func:`parse_ledger`)."""
    name, sep, spec = text.partition("=")
    name = name.strip()
    if not sep or not IDENTIFIER.fullmatch(name):
        raise ConfigurationError(
            f"--table {_shown(text)} must be NAME=KIND:URL, e.g. "
            "accounts=sql:postgresql://user:pw@host/db#schema=bank"
        )
    store = _store(spec.strip(), f"--table {name}", environ)
    if "participants" in store.options:
        raise ConfigurationError(f"--table {name}: participants= is for --ledger only")
    if store.kind == "redis" and "target" not in store.options:
        # A Redis "table" is the hash records of one target: <prefix>:<target>:<key>.
        store = StoreSpec(store.kind, store.url, {**store.options, "target": name})
    return TableSource(name, store)


def parse_check(text: str) -> BusinessCheck:
    """``--check NAME=SQL`` or ``--check NAME=@file.sql``."""
    name, sep, sql = text.partition("=")
    name = name.strip()
    if not sep or not _NAME.fullmatch(name) or not sql.strip():
        raise ConfigurationError(
            f"--check {text[:60]!r} must be NAME=SQL or NAME=@FILE, e.g. money=@money.sql"
        )
    sql = sql.strip()
    if sql.startswith("@"):
        path = Path(sql[1:])
        try:
            sql = path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigurationError(
                f"--check {name}: cannot read {path}: {exc.strerror or exc}"
            ) from None
    return BusinessCheck(name, sql.rstrip(";"))


def spark_conf_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """``--conf key=value`` options as a dict."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(f"--conf {pair!r} must be key=value (a Spark setting)")
        out[key.strip()] = value.strip()
    return out
