"""The participant storage adapter for Redis through redis-py.

Its modules, by concern: ``_adapter`` (the storage: open, check, run a step or a batch,
prune, translate the store's errors), ``_session``/``_unit`` (one local atomic unit),
``_actions`` (the built-in actions), ``_isolation`` (the side hash of holds, reservations
and bounds), ``_batch``/``_plan``/``_script`` (the script path).
"""

from saga.participants.redis._adapter import RedisSession, RedisStorage

__all__ = ["RedisSession", "RedisStorage"]
