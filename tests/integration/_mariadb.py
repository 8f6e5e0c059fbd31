"""A fresh MariaDB database per test, with the business tables of ``test_sql_storage``.

The local MariaDB (``infra/services.sh``) lets its user make databases whose names
start with its own database's (``saga_t...``); each test gets one, dropped afterwards.
The address is ``SAGA_MARIADB_URL`` (what ``infra/services.sh env`` prints), as the
PostgreSQL tests read ``SAGA_POSTGRES_URL``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from test_sql_storage import Database, business_tables

MARIADB_URL = os.environ.get("SAGA_MARIADB_URL", "mariadb://saga:saga@127.0.0.1:13306/saga")
UNREACHABLE_URL = "mariadb://saga:saga@127.0.0.1:1/saga"


def engine_url(url: str = MARIADB_URL) -> str:
    """The SQLAlchemy URL of a ``mariadb://`` or ``mysql://`` address (PyMySQL)."""
    for scheme in ("mariadb://", "mysql://"):
        if url.startswith(scheme):
            return url.replace("://", "+pymysql://", 1)
    return url


@contextmanager
def mariadb_database() -> Iterator[Database]:
    """A fresh MariaDB database (the storage's ``schema``) with the business tables."""
    base = sa.make_url(engine_url())
    schema = f"{base.database}_t{uuid.uuid4().hex[:12]}"
    engine = sa.create_engine(base)
    with engine.begin() as connection:
        connection.execute(sa.text(f"CREATE DATABASE `{schema}`"))
    try:
        metadata = sa.MetaData(schema=schema)
        tables = business_tables(metadata)
        metadata.create_all(engine)
        yield Database(MARIADB_URL, schema, engine, tables)
    finally:
        with engine.begin() as connection:
            connection.execute(sa.text(f"DROP DATABASE IF EXISTS `{schema}`"))
        engine.dispose()
