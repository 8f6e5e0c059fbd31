"""A custom action whose own statement the database refuses, for tests
(``--handlers tests.e2e.driver_error_handlers``).

``audit`` inserts into a table that does not exist: the driver raises a
``ProgrammingError`` (SQLSTATE 42P01) inside the handler. That fails the step, as a
built-in step's refused statement does; it must not stop the participant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from saga.participants import Handler, SqlSession


def _try(native: SqlSession, args: Mapping[str, Any]) -> None:
    native.execute(sa.text("INSERT INTO saga_audit_table_that_is_not_there VALUES (1)"))


def _cancel(native: SqlSession, args: Mapping[str, Any], before: Any) -> None:
    return None


HANDLERS = {"audit": Handler(try_=_try, cancel=_cancel)}
