"""`saga bench --layout mariadb-bank`: the bank on MariaDB (or MySQL), and its URL."""

from __future__ import annotations

import pytest

from saga.streams import ConfigurationError
from saga.streams.kafka import KafkaSettings
from saga.tools.bench.config import LAYOUTS, BenchConfig, parse_layout
from saga.tools.bench.stores import sa_url, target_table

pytestmark = pytest.mark.unit

URLS = ("postgresql://pg/saga", "mongodb://m/", "redis://r/0")


def test_the_mariadb_bank_layout() -> None:
    layout = parse_layout("mariadb-bank")
    assert dict(layout.stores) == {"bank": "mariadb", "wallet": "ferretdb", "rewards": "redis"}
    assert layout.kind("bank") == "sql"
    assert parse_layout("bank=mysql") is LAYOUTS["mariadb-bank"]
    assert parse_layout("bank=mariadb,wallet=mariadb").name == "maria-maria-redis"


def test_a_layout_on_mariadb_needs_its_url() -> None:
    kafka = KafkaSettings(bootstrap="127.0.0.1:1")
    with pytest.raises(ConfigurationError, match="give --mariadb-url or set SAGA_MARIADB_URL"):
        BenchConfig(kafka, *URLS, layouts=(LAYOUTS["mariadb-bank"],))
    url = "mariadb://saga:saga@127.0.0.1:13306/saga"
    cfg = BenchConfig(kafka, *URLS, layouts=(LAYOUTS["mariadb-bank"],), mariadb_url=url)
    assert sa_url(cfg.mariadb_url) == "mariadb+pymysql://saga:saga@127.0.0.1:13306/saga"


def test_the_mariadb_table_has_a_binary_key_with_a_length() -> None:
    """MySQL cannot key a TEXT column, and its default collation would make ``A1`` and
    ``a1`` one account."""
    key = target_table("saga_bench", "bank", "mariadb").c.id
    assert key.type.length == 16 and key.type.collation == "utf8mb4_bin"
