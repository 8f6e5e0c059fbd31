"""The participant storage adapter for MongoDB and MongoDB-wire servers (FerretDB) through pymongo.

Its modules, by concern: ``_adapter`` (the storage: open, check, run a step or a batch),
``_session``/``_unit`` (one local atomic unit), ``_actions`` (the built-in actions),
``_ledger`` (the barrier's ledger) and the store's error translation.
"""

from saga.participants.mongo._adapter import MongoSession, MongoStorage

__all__ = ["MongoSession", "MongoStorage"]
