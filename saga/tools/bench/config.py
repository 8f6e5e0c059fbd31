"""The benchmark's settings (``saga bench`` options) and the names its phases share."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from saga.streams import ConfigurationError
from saga.streams.kafka import KafkaSettings

PHASES: Final = ("main", "latency", "rollback", "hot", "direct", "log")
SAGA_PHASES: Final = ("main", "latency", "rollback", "hot")
ISOLATION: Final = ("read_committed", "none", "both")
NONE_SUFFIX: Final = "-none"
"""``--isolation both``: the main and latency phases run again at level ``none``, named
``main-none`` and ``latency-none``; every other phase runs at ``read_committed``."""
COMPARED: Final = ("main", "latency")
"""The phases ``--isolation both`` runs at each level."""
HOT_RECORDS: Final = 10
"""The hot phase's sagas all touch the first this many records of each store."""
PARTICIPANTS: Final = ("bank", "wallet", "rewards")
TARGET_OF: Final = {"bank": "accounts", "wallet": "wallets", "rewards": "points"}
FIELD_OF: Final = {"bank": "balance", "wallet": "balance", "rewards": "points"}
STORES: Final = ("postgres", "ferretdb", "redis", "mariadb")
"""Where a participant's data can live (``ferretdb``: the MongoDB-wire server)."""
KIND_OF: Final = {"postgres": "sql", "ferretdb": "mongo", "redis": "redis", "mariadb": "sql"}
"""The ``participant run --storage`` kind of each store."""
_STORE_ALIASES: Final = {
    "postgres": "postgres", "postgresql": "postgres", "pg": "postgres", "sql": "postgres",
    "ferretdb": "ferretdb", "mongo": "ferretdb", "mongodb": "ferretdb",
    "redis": "redis",
    "mariadb": "mariadb", "mysql": "mariadb",
}  # fmt: skip
OPENING_BALANCE: Final = 10**12  # debits never reach the minimum: only designed failures fail
MAX_AMOUNT: Final = 100
SIGNING: Final = ("off", "on", "both")
SIGNED_MAIN: Final = "main-signed"
"""The main phase run again with signed records (``--signing both``)."""
ROUND_MARK: Final = "-r"
"""``--signing-rounds N``: round ``n`` (from 2) of the unsigned and the signed main phase
runs as ``main-r<n>`` and ``main-signed-r<n>``."""
SERVICES: Final = ("kafka", "postgres", "redis", "ferretdb", "mariadb")
CLIENT: Final = "client (bench)"


@dataclass(frozen=True)
class Layout:
    """Which store each participant's data lives in (participant -> one of :data:`STORES`).

    The same three steps run whatever the layout: ``bank`` debits (never below 0),
    ``wallet`` and ``rewards`` credit; only the store under each participant moves.
    """

    name: str
    stores: Mapping[str, str]

    def kind(self, participant: str) -> str:
        """The participant's ``--storage`` kind (sql, mongo, redis)."""
        return KIND_OF[self.stores[participant]]

    @property
    def spec(self) -> str:
        return ",".join(f"{p}={self.stores[p]}" for p in PARTICIPANTS)


DEFAULT_LAYOUT: Final = Layout(
    "default", {"bank": "postgres", "wallet": "ferretdb", "rewards": "redis"}
)
LAYOUTS: Final = {
    "default": DEFAULT_LAYOUT,
    "pg-wallet": Layout(
        "pg-wallet", {"bank": "postgres", "wallet": "postgres", "rewards": "redis"}
    ),
    "mariadb-bank": Layout(
        "mariadb-bank", {"bank": "mariadb", "wallet": "ferretdb", "rewards": "redis"}
    ),
}
"""The named layouts: the issue's default (wallet on FerretDB), the wallet on PostgreSQL,
and the default with the bank on MariaDB (or MySQL: ``--mariadb-url``)."""
_SHORT: Final = {"postgres": "pg", "ferretdb": "ferret", "redis": "redis", "mariadb": "maria"}


def parse_layout(text: str) -> Layout:
    """A named layout, or ``bank=STORE,wallet=STORE,rewards=STORE`` (a participant left out
    keeps its default store); raises :class:`ConfigurationError` with the fix."""
    text = text.strip()
    if text in LAYOUTS:
        return LAYOUTS[text]
    if "=" not in text:
        raise ConfigurationError(
            f"--layout {text!r}: name one of {', '.join(LAYOUTS)} or give "
            "bank=STORE,wallet=STORE,rewards=STORE (STORE: postgres, ferretdb, redis or mariadb)"
        )
    stores = dict(DEFAULT_LAYOUT.stores)
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, store = (s.strip() for s in part.partition("="))
        if name not in PARTICIPANTS or store.lower() not in _STORE_ALIASES:
            raise ConfigurationError(
                f"--layout {text!r}: {part!r} is not PARTICIPANT=STORE (participants: "
                f"{', '.join(PARTICIPANTS)}; stores: {', '.join(STORES)})"
            )
        stores[name] = _STORE_ALIASES[store.lower()]
    for layout in LAYOUTS.values():
        if dict(layout.stores) == stores:
            return layout
    return Layout("-".join(_SHORT[stores[p]] for p in PARTICIPANTS), stores)


@dataclass(frozen=True)
class BenchConfig:
    kafka: KafkaSettings
    postgres_url: str
    mongo_url: str
    redis_url: str
    phases: tuple[str, ...] = PHASES
    warmup: float = 10.0
    duration: float = 60.0
    latency_duration: float = 30.0
    rollback_duration: float = 30.0
    hot_duration: float = 30.0
    baseline_duration: float = 20.0
    rate: float = 400.0
    window: int = 1000
    fail_share: float = 0.0
    rollback_fail_share: float = 0.2
    partitions: int = 4
    workers: int = 1
    accounts: int = 10_000
    batch: int = 500
    saga_timeout: float = 60.0
    drain_timeout: float = 120.0
    settle_timeout: float = 60.0
    """Before each saga phase, at most this long for the services to fall to settle_cores."""
    settle_cores: float = 0.15
    schema: str = "saga_bench"
    report: Path = Path("reports/bench.json")
    logs: Path = Path(".infra/logs/bench")
    seed: int = 7
    keep_topics: bool = False
    signing: str = "off"
    isolation: str = "read_committed"
    """The sagas' level (``both``: see :data:`NONE_SUFFIX`)."""
    signing_rounds: int = 1
    """``--signing both``: how many times the unsigned and the signed main phase each run,
    alternately (unsigned, signed, then signed, unsigned, ...); the figures pool them."""
    service_pids: Mapping[str, int] = field(default_factory=dict)
    layouts: tuple[Layout, ...] = (DEFAULT_LAYOUT,)
    profile: Path | None = None
    """A folder for py-spy's recording of every product process during each main phase."""
    mariadb_url: str = ""
    """MariaDB or MySQL, for a layout that puts a participant there (``mariadb-bank``)."""

    def __post_init__(self) -> None:
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown or not self.phases:
            raise ConfigurationError(
                f"unknown phase {', '.join(unknown) or '(none given)'}: "
                f"pick from {', '.join(PHASES)}"
            )
        if self.warmup < 0 or min(self.duration, self.latency_duration) <= 0:
            raise ConfigurationError("durations must be positive seconds (the warm-up may be 0)")
        if min(self.rollback_duration, self.baseline_duration, self.hot_duration) <= 0:
            raise ConfigurationError("durations must be positive seconds (the warm-up may be 0)")
        if self.rate <= 0 or self.window < 1 or self.batch < 1 or self.accounts < 1:
            raise ConfigurationError("--rate, --window, --batch and --accounts must be positive")
        if not 0 <= self.fail_share <= 1 or not 0 <= self.rollback_fail_share <= 1:
            raise ConfigurationError("a failure share is a fraction between 0 and 1")
        if self.signing not in SIGNING:
            raise ConfigurationError(f"--signing {self.signing!r}: use {', '.join(SIGNING)}")
        if self.signing == "both" and "main" not in self.phases:
            raise ConfigurationError(
                "--signing both compares two main phases: keep main in --phases"
            )
        if self.signing_rounds < 1 or (self.signing_rounds > 1 and self.signing != "both"):
            raise ConfigurationError(
                "--signing-rounds repeats the comparison of --signing both: give it with "
                "--signing both, at least 1"
            )
        if self.isolation not in ISOLATION:
            raise ConfigurationError(f"--isolation {self.isolation!r}: use {', '.join(ISOLATION)}")
        if self.isolation == "both" and not set(COMPARED) & set(self.phases):
            raise ConfigurationError(
                "--isolation both compares the main and latency phases at each level: "
                "keep main or latency in --phases"
            )
        names = [layout.name for layout in self.layouts]
        if not names or len(set(names)) != len(names):
            raise ConfigurationError("give each --layout once (at least one)")
        if self.profile is not None and "main" not in self.phases:
            raise ConfigurationError("--profile records the main phase: keep main in --phases")
        if not self.mariadb_url and any("mariadb" in x.stores.values() for x in self.layouts):
            raise ConfigurationError(
                "a --layout puts a participant on MariaDB: give --mariadb-url or set "
                "SAGA_MARIADB_URL (infra/services.sh env prints the local one)"
            )
        unknown = [n for n in self.service_pids if n not in SERVICES]
        if unknown:
            raise ConfigurationError(
                f"--service-pid names {', '.join(unknown)}: use one of {', '.join(SERVICES)}"
            )
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", self.schema) is None:
            raise ConfigurationError(
                f"--schema {self.schema!r} must be a letter or _ followed by up to 62 "
                "letters, digits or _"
            )


def signing_pairs(cfg: BenchConfig) -> list[tuple[str, str]]:
    """``(unsigned, signed)`` main phase names of each round of ``--signing both``."""
    if cfg.signing != "both":
        return []
    pairs = [("main", SIGNED_MAIN)]
    for n in range(2, cfg.signing_rounds + 1):
        pairs.append((f"main{ROUND_MARK}{n}", f"{SIGNED_MAIN}{ROUND_MARK}{n}"))
    return pairs


def is_signed(cfg: BenchConfig, phase: str) -> bool:
    """Whether a phase runs with a key folder of its own."""
    return cfg.signing == "on" or any(phase == on for _, on in signing_pairs(cfg))


def phase_level(cfg: BenchConfig, phase: str) -> str:
    """The isolation level a phase's sagas ask for."""
    if phase.endswith(NONE_SUFFIX) or cfg.isolation == "none":
        return "none"
    return "read_committed"


def account(i: int) -> str:
    return f"a{i:06d}"
