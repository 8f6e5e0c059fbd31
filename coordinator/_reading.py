"""Reading parts of topics to the ends noted at the start, for the admin commands."""

from __future__ import annotations

import time
from collections.abc import Mapping

from saga.streams.kafka import Message
from saga.streams.log import LogConsumer

Partition = tuple[str, int]


def read_to(
    reader: LogConsumer, ends: Mapping[Partition, int], timeout: float, key: bytes | None = None
) -> list[Message]:
    """Poll ``reader`` until each partition's position reaches its end in ``ends``, or for
    ``timeout`` seconds; the records keyed ``key`` (every record when ``None``), as read.

    ``reader`` must be assigned the partitions of ``ends`` already.
    """
    found: list[Message] = []
    todo = set(ends)
    deadline = time.monotonic() + timeout
    while todo and time.monotonic() < deadline:
        for m in reader.poll_batch(2000, 0.2):
            if key is None or m.key == key:
                found.append(m)
            if m.offset + 1 >= ends.get(m.partition_key, 0):
                todo.discard(m.partition_key)
        # Transaction markers occupy offsets too: the position tells when we are done.
        for where, pos in reader.position(list(todo)).items():
            if pos is not None and pos >= ends[where]:
                todo.discard(where)
    return found
