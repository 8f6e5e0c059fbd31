"""saga's tools: the demo workload (``saga demo``) and the benchmark (``saga bench``).

They drive PostgreSQL, MongoDB and Redis directly (SQLAlchemy, pymongo, redis)
to prepare and check their data, so they live outside the core packages and
install with the ``tools`` extra: ``pip install 'saga-olep[tools]'``. The
``saga`` command line attaches their commands (:mod:`saga.tools.cli`) lazily.
"""

from __future__ import annotations

import importlib
from typing import Final

DRIVERS: Final = ("sqlalchemy", "psycopg", "pymongo", "redis")


def require_drivers() -> None:
    """Import every storage driver the tools use; :class:`ImportError` names a missing one.

    The tools import some drivers only where they use them; checking them all
    first turns a missing one into a sentence before anything starts.
    """
    for name in DRIVERS:
        importlib.import_module(name)
