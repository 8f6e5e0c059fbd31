"""A custom action that keeps ``read_committed`` isolation itself (SQL storages).

The built-in actions hold records and reserve amounts until their saga's decision
(docs/architecture.md, "Isolation"). A custom handler runs the same at every level: it
gets the same isolation by doing what they do, in its three functions:

* ``try``: check, then *hold* the record: a row in a holds table of its own names the
  holder (the saga's ``tx_id`` and step, from :func:`~saga.participants.current_step`)
  and keeps the intended new value beside the record, not in it. A record another saga
  holds makes the step fail at once, naming the holder (no waiting: no deadlock across
  participants; the saga rolls back and the client may resubmit).
* ``confirm`` (the commit decision): write the held value into the record, drop the hold.
* ``cancel`` (the rollback decision): drop the hold; the record never changed.

The three run in the same local transaction as the step's ledger entry, so a crash
neither loses a hold nor applies a write twice, and a hold is dropped only by its
saga's decision. Until then every reader of the table sees the committed balance;
once the client sees ``committed``, every reader sees the new one (a handler with a
``confirm`` is confirmed before its saga is ``committed``).

The action here, ``set_balance`` with ``{"key": ..., "balance": ...}``, sets
``accounts.balance``. Run it with its holds table created once beside ``accounts``::

    python -c "import sqlalchemy as sa, examples.isolated_handler as x; \\
        x.create_holds_table(sa.create_engine('postgresql+psycopg://...'), schema='bank')"
    saga participant run --name wallet --storage sql --url postgresql://... --schema bank \\
        --targets accounts --handlers examples.isolated_handler

What it does not do: its holds are its own, so a built-in action on the same table
neither sees nor respects them (use one or the other for a table); a saga holds a
record once (a second step of the same saga on it fails like anyone else's); writers
that bypass the product are outside any guarantee.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from saga.participants import Handler, Reject, current_step

HOLDS = "example_holds"
_TARGET = "accounts"
_holds_by_schema: dict[str | None, sa.Table] = {}


def holds_table(metadata: sa.MetaData) -> sa.Table:
    """The holds table's definition: one row per held record (so of two sagas racing
    for a record, exactly one gets it), naming its holder and the value it will write."""
    return sa.Table(
        HOLDS,
        metadata,
        sa.Column("target", sa.String(63), primary_key=True),
        sa.Column("key", sa.String(256), primary_key=True),
        sa.Column("tx_id", sa.String(128), nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("value", sa.JSON, nullable=False),
        # Kept for operators: a hold of a saga past its deadline is waiting for its decision.
        sa.Column("deadline_ms", sa.BigInteger, nullable=False),
    )


def create_holds_table(engine: sa.Engine, schema: str | None = None) -> None:
    """Create the holds table in ``schema`` (beside the target table), if absent."""
    metadata = sa.MetaData(schema=schema)
    holds_table(metadata)
    metadata.create_all(engine)


def _tables(native: Any) -> tuple[sa.Table, sa.Column[Any], sa.Table]:
    """``accounts``, its key column and the holds table in the same schema."""
    accounts: sa.Table = native.table(_TARGET)
    holds = _holds_by_schema.get(accounts.schema)
    if holds is None:
        holds = _holds_by_schema[accounts.schema] = holds_table(sa.MetaData(schema=accounts.schema))
    (key_column,) = accounts.primary_key.columns
    return accounts, key_column, holds


def _mine(holds: sa.Table, key: Any) -> sa.ColumnElement[bool]:
    """The running step's hold on ``accounts/key``."""
    step = current_step()
    return sa.and_(
        holds.c.target == _TARGET,
        holds.c.key == str(key),
        holds.c.tx_id == step.tx_id,
        holds.c.step == step.step,
    )


def _claim(native: Any, holds: sa.Table, row: Mapping[str, Any]) -> None:
    """Insert the hold unless the record is held already (by anyone).

    ``ON CONFLICT DO NOTHING``: a concurrent saga's uncommitted hold makes PostgreSQL
    wait for it, then do nothing, so the holder read next is the committed one.
    """
    dialect = native.connection.dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects import postgresql

        native.execute(postgresql.insert(holds).values(**row).on_conflict_do_nothing())
    elif dialect == "sqlite":
        from sqlalchemy.dialects import sqlite

        native.execute(sqlite.insert(holds).values(**row).on_conflict_do_nothing())
    else:
        raise NotImplementedError(f"this example runs on PostgreSQL and SQLite, not {dialect}")


def hold(native: Any, args: Mapping[str, Any]) -> None:
    """``try``: hold ``accounts/key`` for this step, with the new balance beside it."""
    step = current_step()
    key, balance = args["key"], args["balance"]
    _, key_column, holds = _tables(native)
    if native.execute(sa.select(key_column).where(key_column == key)).first() is None:
        raise Reject(f"{_TARGET}/{key} does not exist")
    _claim(
        native,
        holds,
        {
            "target": _TARGET,
            "key": str(key),
            "tx_id": step.tx_id,
            "step": step.step,
            "value": {"balance": balance},
            "deadline_ms": step.deadline_ms,
        },
    )
    where = sa.and_(holds.c.target == _TARGET, holds.c.key == str(key))
    holder = native.execute(sa.select(holds.c.tx_id, holds.c.step).where(where)).one()
    if (holder.tx_id, holder.step) != (step.tx_id, step.step):
        raise Reject(
            f"{_TARGET}/{key} is held by saga {holder.tx_id} (step {holder.step}) until its "
            "decision; retry after it"
        )


def write(native: Any, args: Mapping[str, Any]) -> None:
    """``confirm``: write what this step holds into the record, and drop the hold."""
    key = args["key"]
    accounts, key_column, holds = _tables(native)
    held = native.execute(sa.select(holds.c.value).where(_mine(holds, key))).first()
    if held is None:
        return  # nothing held: written already
    native.execute(sa.update(accounts).where(key_column == key).values(**held.value))
    native.execute(sa.delete(holds).where(_mine(holds, key)))


def release(native: Any, args: Mapping[str, Any], before: Any) -> None:
    """``cancel``: drop this step's hold; the record itself never changed."""
    _, _, holds = _tables(native)
    native.execute(sa.delete(holds).where(_mine(holds, args["key"])))


HANDLERS = {"set_balance": Handler(try_=hold, confirm=write, cancel=release)}
