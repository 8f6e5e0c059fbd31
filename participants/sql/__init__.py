"""The participant storage adapter for SQL databases through SQLAlchemy (PostgreSQL, SQLite).

Its modules, by concern: ``_adapter`` (the storage: open, check, run a step or a batch),
``_session``/``_unit`` (one local atomic unit), ``_actions`` (the built-in actions),
``_ledger`` (the barrier's ledger) and the store's error translation.
"""

from saga.participants.sql._adapter import SqlSession, SqlStorage

__all__ = ["SqlSession", "SqlStorage"]
