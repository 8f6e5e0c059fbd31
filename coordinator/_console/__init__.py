"""The web console (``saga console``): see the sagas, their history and the DLQ, and act.

Built from small modules, standard library only apart from the product's own:

* :mod:`._store`: the console's database (SQLite by default, PostgreSQL on request);
* :mod:`._view`: :class:`StatusTable`, the materialised view of the status topic;
* :mod:`._actions`: :class:`Operations`, abort/resolve/redrive with an audit trail;
* :mod:`._server`: the HTTP server and JSON API; ``static/``: the one page it serves;
* :mod:`._cli`: the ``saga console`` command.
"""

from saga.coordinator._console._actions import ActionRefused, Operations
from saga.coordinator._console._server import Console, make_server
from saga.coordinator._console._store import ViewStore
from saga.coordinator._console._view import StatusTable

__all__ = ["ActionRefused", "Console", "Operations", "StatusTable", "ViewStore", "make_server"]
