"""A pymongo command listener for tests that count a MongoDB adapter's round trips."""

from __future__ import annotations

from typing import Any

import pymongo.monitoring


class Commands(pymongo.monitoring.CommandListener):
    """Records ``(command, collection, _ids)``, and in :attr:`scans` every filter that does
    not name one plain ``_id`` (FerretDB as ``infra/services.sh`` builds it looks the others
    up by ``_id``; pymongo swallows what a listener raises)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, list[Any]]] = []
        self.scans: list[tuple[str, Any]] = []

    def started(self, event: pymongo.monitoring.CommandStartedEvent) -> None:
        name, command = event.command_name, event.command
        if name == "insert":
            ids = [doc["_id"] for doc in command["documents"]]
        elif name in ("find", "findAndModify", "update"):
            found = command.get("filter") or command.get("query")
            filters = [s["q"] for s in command["updates"]] if name == "update" else [found]
            plain = all("_id" in f and not isinstance(f["_id"], dict) for f in filters)
            if not plain:  # FerretDB would scan the collection for a filter without one _id
                self.scans.append((name, filters))
                return
            ids = [f["_id"] for f in filters]
        else:
            return
        self.seen.append((name, command[name], ids))

    def succeeded(self, event: pymongo.monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: pymongo.monitoring.CommandFailedEvent) -> None:
        pass
