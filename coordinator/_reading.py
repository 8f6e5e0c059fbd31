"""Reading parts of topics to the ends noted at the start: for the admin commands, and for
the status view's reads of the status topic on demand (:func:`read_range`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from saga.streams import TransientError
from saga.streams._signed_log import SignedLog
from saga.streams.kafka import KafkaLog, Message
from saga.streams.log import Log, LogConsumer

Partition = tuple[str, int]


def read_to(
    reader: LogConsumer,
    ends: Mapping[Partition, int],
    timeout: float,
    key: bytes | None = None,
    also: Callable[[Message], bool] | None = None,
) -> list[Message]:
    """Poll ``reader`` until each partition's position reaches its end in ``ends``, or for
    ``timeout`` seconds; the records keyed ``key`` (every record when ``None``) and those
    ``also`` accepts, as read.

    ``reader`` must be assigned the partitions of ``ends`` already.
    """
    found: list[Message] = []
    todo = set(ends)
    deadline = time.monotonic() + timeout
    while todo and time.monotonic() < deadline:
        for m in reader.poll_batch(2000, 0.2):
            if key is None or m.key == key or (also is not None and also(m)):
                found.append(m)
            if m.offset + 1 >= ends.get(m.partition_key, 0):
                todo.discard(m.partition_key)
        # Transaction markers occupy offsets too: the position tells when we are done.
        for where, pos in reader.position(list(todo)).items():
            if pos is not None and pos >= ends[where]:
                todo.discard(where)
    return found


def read_range(
    log: Log,
    topic: str,
    ranges: Mapping[int, tuple[int, int | None]],
    *,
    timeout: float,
    client_id: str,
    key: bytes | None = None,
) -> tuple[list[Message], dict[int, int]]:
    """The records keyed ``key`` (all when ``None``) of ``topic``'s partitions from
    ``ranges[p][0]`` up to ``ranges[p][1]`` (excluded; ``None``: the partition's end now),
    as read, and the end of each range: a read of the topic on demand, with a consumer of
    its own.

    Raises :class:`~streams.TransientError` when the ranges are not read to their end
    within ``timeout`` seconds (a partial answer could miss the newest record).
    """
    reader = log.consumer(None, client_id=client_id)
    try:
        upto = {
            p: end if end is not None else reader.watermarks(topic, p, timeout)[1]
            for p, (_, end) in ranges.items()
        }
        starts = {p: start for p, (start, _) in ranges.items() if upto[p] > start}
        if not starts:
            return [], upto
        reader.assign([(topic, p, start) for p, start in starts.items()])
        ends = {(topic, p): upto[p] for p in starts}
        found = [m for m in read_to(reader, ends, timeout, key) if m.offset < ends[m.partition_key]]
        reached = reader.position(list(ends))
    finally:
        reader.close()
    if any(pos is None or pos < ends[where] for where, pos in reached.items()):
        raise TransientError(
            f"could not read {topic} to its end within {timeout:g} s; try again (a read of "
            "the status topic on demand takes longer as the topic grows)"
        )
    return found, upto


def read_ahead_capped(log: Log, kib: int) -> Log:
    """A log whose Kafka consumers fetch at most about ``kib`` KiB ahead of the reader.

    librdkafka queues up to 64 MiB per consumer by default, and 100,000 records per
    partition, and a reader slower than the broker holds that much; a reader of millions
    of records that keeps few of them needs a fraction. The user's own settings of
    these keys win. A signed log's consumers are its inner log's; another log is
    returned as it is.
    """
    inner = log.inner if isinstance(log, SignedLog) else log
    if not isinstance(inner, KafkaLog):
        return log
    limits = {"queued.max.messages.kbytes": str(kib), "queued.min.messages": "1000"}
    return KafkaLog(replace(inner.settings, extra={**limits, **inner.settings.extra}))
