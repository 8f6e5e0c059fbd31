"""The participant storage adapter for Redis through redis-py.

Its modules, by concern: ``_adapter`` (the storage: open, check, run a step or a batch),
``_session``/``_unit`` (one local atomic unit), ``_actions`` (the built-in actions),
``_ledger`` (the barrier's ledger) and the store's error translation.
"""

from saga.participants.redis._adapter import RedisSession, RedisStorage

__all__ = ["RedisSession", "RedisStorage"]
