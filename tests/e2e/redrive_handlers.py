"""A custom action whose ``confirm`` fails while a flag file exists, for the re-drive test.

Its participant fails to act on the commit (the runtime gives the decision up: an
error that is not transient) as long as the file named by the step's ``flag`` argument
exists; once the file is gone, a repeat of the decision confirms.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from saga.participants import Handler


def _nothing(native: Any, args: Mapping[str, Any]) -> None:
    return None


def _confirm(native: Any, args: Mapping[str, Any]) -> None:
    if os.path.exists(str(args["flag"])):
        raise RuntimeError("confirm fails on purpose while the flag file exists")


def _cancel(native: Any, args: Mapping[str, Any], before: Any) -> None:
    return None


HANDLERS = {"confirm_later": Handler(try_=_nothing, cancel=_cancel, confirm=_confirm)}
