"""The consumer: auto-commit off, offsets committed only when asked."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import confluent_kafka as ck

from saga.streams._errors import ConfigurationError, FatalKafkaError, TransientError
from saga.streams._rejoin import RejoinPolicy, is_instance_fence
from saga.streams.kafka._commits import CommitGate
from saga.streams.kafka._message import (
    Message,
    Partition,
    RebalanceCallback,
    _offset_or_none,
    _to_message,
    _tps,
    _tps_at,
)
from saga.streams.kafka._settings import (
    CONSUMER_SOCKET_TIMEOUT_MS,
    KafkaSettings,
    _checked_instance_id,
    _client_config,
    _group_timeouts,
)
from saga.streams.kafka._translate import (
    _E,
    _UNKNOWN_TOPIC_CODES,
    _error_of,
    _log_client_error,
    _partition_count,
    _translate,
)

_log = logging.getLogger("saga.kafka")

_T = TypeVar("_T")


class Consumer:
    """A consumer with auto-commit off: offsets are committed only when asked.

    With a ``group_id`` it joins that group through :meth:`subscribe`; without
    one it is a plain reader for :meth:`assign` (it gets a throw-away group id
    and cannot commit). ``read_committed`` (the default) hides records of
    aborted and still-open transactions. The rebalance callbacks receive
    ``(topic, partition)`` lists and run inside :meth:`poll_batch`; with the
    default cooperative-sticky strategy they receive only the partitions that
    change. ``on_lost`` defaults to ``on_revoke``.

    Group membership (see :func:`~streams.kafka._settings._group_timeouts`): a
    ``group_instance_id`` makes the consumer a *static* member (KIP-345): a
    restarted process with the same id takes back its partitions at once, without
    a rebalance, while a process gone for good loses them after the session
    timeout, 6 s by default here (librdkafka's is 45 s). The id must be stable
    across restarts of one process and unique among the live ones: a second
    consumer with the same id fences the first, which then fails with
    :class:`FatalKafkaError`. A static member does not leave the group when it
    closes: its partitions wait for its restart, or the session timeout.

    A static member fenced once rejoins in-process instead (streams._rejoin:
    librdkafka's self-fence after a broker fault looks the same as a duplicate):
    ``on_lost`` gets the partitions it owned, a new client joins with the same id
    and the subscription, and reading goes on from the committed offsets. Fenced
    again within ``REJOIN_WINDOW_S`` of the rejoin, it raises, as above.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        group_id: str | None = None,
        *,
        isolation_level: Literal["read_committed", "read_uncommitted"] = "read_committed",
        assignment_strategy: str = "cooperative-sticky",
        auto_offset_reset: Literal["earliest", "latest", "error"] = "earliest",
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
        on_lost: RebalanceCallback | None = None,
        client_id: str = "saga",
        session_timeout_ms: int | None = None,
        max_poll_interval_ms: int | None = None,
        group_instance_id: str | None = None,
    ) -> None:
        self._settings = settings
        self._has_group = group_id is not None
        self._instance_id = group_instance_id
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._on_lost = on_lost
        self._closed = False
        self.commit_failures = 0
        """Commits that failed, sent by :meth:`commit_async` or :meth:`commit` (logged each)."""
        self._gate = CommitGate()  # commit_async: one in flight, later offsets held back
        self._rejoin = None if group_instance_id is None else RejoinPolicy(group_instance_id)
        self._topics: list[str] = []
        self._callbacks: dict[str, Callable[[ck.Consumer, list[ck.TopicPartition]], None]] = {}
        self._owned: set[Partition] = set()  # assigned through the callbacks, for a rejoin
        self._in_callback = False  # no rejoin from inside the old client's own callback
        options: dict[str, Any] = {}
        if group_id is not None:
            options.update(_group_timeouts(settings.extra, session_timeout_ms))
            if group_instance_id is not None:
                options["group.instance.id"] = _checked_instance_id(group_instance_id)
        elif group_instance_id is not None:
            raise ConfigurationError("a group_instance_id needs a group_id")
        if session_timeout_ms is not None:
            options["session.timeout.ms"] = session_timeout_ms
        if max_poll_interval_ms is not None:
            options["max.poll.interval.ms"] = max_poll_interval_ms
        if "socket.timeout.ms" not in settings.extra:
            options["socket.timeout.ms"] = CONSUMER_SOCKET_TIMEOUT_MS
        config = _client_config(
            settings,
            client_id=client_id,
            group_id=group_id or f"{settings.prefix}.reader.{uuid.uuid4().hex}",
            enable_auto_commit=False,
            auto_offset_reset=auto_offset_reset,
            isolation_level=isolation_level,
            partition_assignment_strategy=assignment_strategy,
        )
        config.update(options)
        config["error_cb"] = self._client_error
        config["on_commit"] = self._committed
        config["logger"] = _FenceWatch(self, config.get("logger"))
        self._fatal_text = ""  # the client's fatal error, as error_cb or its log line told it
        self._config = config  # a rejoin makes a new client with it
        try:
            self._client = ck.Consumer(config)
        except (ck.KafkaException, ValueError, TypeError) as exc:
            raise ConfigurationError(f"cannot create a Kafka consumer: {exc}") from exc

    # -- group membership

    def subscribe(self, topics: Sequence[str]) -> None:
        """Join the group for ``topics``; partitions arrive through :meth:`poll_batch`."""
        if not self._has_group:
            raise ConfigurationError("a consumer without a group_id cannot subscribe: use assign()")

        def relay(
            callback: RebalanceCallback | None, owned: Callable[[list[Partition]], None]
        ) -> Callable[[ck.Consumer, list[ck.TopicPartition]], None]:
            def handler(client: ck.Consumer, partitions: list[ck.TopicPartition]) -> None:
                if client is not self._client:
                    return  # a client left behind by a rejoin (closing it may call back)
                changed = [(tp.topic, tp.partition) for tp in partitions]
                self._in_callback = True
                try:
                    owned(changed)
                    if callback is not None:
                        callback(changed)
                finally:
                    self._in_callback = False

            return handler

        def gained(partitions: list[Partition]) -> None:
            self._owned.update(partitions)

        def gone(partitions: list[Partition]) -> None:
            self._owned.difference_update(partitions)
            # Offsets held back for these partitions go now, while they are still ours.
            if self._gate.holds_any(partitions):
                self._commit_held_now()

        def lost(partitions: list[Partition]) -> None:
            self._owned.difference_update(partitions)
            self._gate.drop(partitions)  # no longer ours to commit: their new owner reads on

        # After each callback returns, the client performs the (incremental) assignment
        # itself. Every callback is registered, to know what a rejoin loses.
        self._topics = list(topics)
        self._callbacks = {
            "on_assign": relay(self._on_assign, gained),
            "on_revoke": relay(self._on_revoke, gone),
            "on_lost": relay(self._on_lost or self._on_revoke, lost),
        }
        callbacks = self._callbacks
        self._guard("subscribing", lambda: self._client.subscribe(list(topics), **callbacks))

    def assign(
        self,
        partitions_with_offsets: Mapping[Partition, int] | Iterable[tuple[str, int, int]],
    ) -> None:
        """Read exactly these partitions, without a group, from the given offsets.

        Takes ``{(topic, partition): offset}`` or ``[(topic, partition, offset), ...]``.
        Each offset is the next offset to read, or :data:`OFFSET_BEGINNING` /
        :data:`OFFSET_END`. Replaces any previous assignment.
        """
        if isinstance(partitions_with_offsets, Mapping):
            starts = _tps_at(partitions_with_offsets)
        else:
            starts = [ck.TopicPartition(t, p, o) for t, p, o in partitions_with_offsets]
        self._guard("assigning partitions", lambda: self._client.assign(starts))

    # -- reading

    def poll_batch(self, max_messages: int = 500, timeout: float = 1.0) -> list[Message]:
        """Up to ``max_messages`` records, waiting at most ``timeout`` seconds; may be empty.

        Natural batching: it returns what has arrived as soon as there is
        anything, and waits (up to ``timeout``) only while nothing has. So a
        busy process gets large batches (what arrived while it worked on the
        last one) and an idle one handles a record without delay. (librdkafka's
        batch consume alone waits for ``max_messages`` or the whole timeout.)

        Rebalance callbacks run inside this call. Partition-end events are
        skipped; other per-partition errors are logged (librdkafka keeps
        retrying those partitions by itself).

        Raises:
            ConfigurationError: a subscribed or assigned topic does not exist.
            FatalKafkaError: the consumer hit a fatal error.
            TransientError: the client failed as a whole.
        """
        try:
            raw = self._client.consume(max_messages, 0)
            if not raw and timeout > 0:
                raw = self._client.consume(1, timeout)
                if raw and max_messages > 1:
                    raw += self._client.consume(max_messages - 1, 0)
        except ck.KafkaException as exc:
            raise _translate(_error_of(exc), "consuming", text=str(exc)) from exc
        messages: list[Message] = []
        for item in raw:
            err = item.error()
            if err is None:
                messages.append(_to_message(item))
                continue
            code = err.code()
            if code == _E._PARTITION_EOF:
                continue
            topic = item.topic()
            if code in _UNKNOWN_TOPIC_CODES and topic and not self._topic_exists(topic):
                raise ConfigurationError(
                    f"topic {topic} does not exist: create the topics with `saga topics create`"
                )
            if err.fatal() or code == _E._FATAL:
                if self._rejoined(err.name(), err.str()):
                    return []  # read again from the committed offsets by their owner
                raise FatalKafkaError(self._fatal_sentence(err.str()))
            _log.warning(
                "Kafka consumer: %s (topic %s, partition %s); retrying",
                err.str(),
                topic,
                item.partition(),
            )
        if self._gate.holding:  # the commit in flight may have been answered in this call
            try:
                self._send_held()
            except TransientError as exc:
                _log.warning("offsets not committed, the records will be read again: %s", exc)
        return messages

    def _fatal_sentence(self, text: str) -> str:
        if self._instance_id is None:
            return f"the Kafka consumer hit a fatal error: {text}; exiting"
        # A static member's usual fatal error: another process joined with its id
        # (librdkafka reports it as a generic fatal error; the text names the cause).
        return (
            f"the Kafka consumer hit a fatal error: {text}; if another live process runs "
            f"with the same instance id ({self._instance_id}), give each process its own "
            "id; exiting"
        )

    def _client_error(self, err: ck.KafkaError) -> None:
        # A fatal error reaches later calls only as "Local: Fatal error" (a commit, say):
        # kept, it still says whether it was the instance fence.
        if err.fatal():
            self._fatal_text = err.str()
        _log_client_error(err)

    def _fatal_cause(self) -> None:
        """Serve the client's queued events, for error_cb to learn the fatal error's cause.

        A call that fails with "Local: Fatal error" (a commit) may come before the poll
        that would have delivered the cause. What else the queue holds is dropped: the
        client is unusable, and a rejoin reads on from the committed offsets.
        """
        try:
            for item in self._client.consume(500, 0):
                err = item.error()
                if err is not None and err.fatal() and not self._fatal_text:
                    self._fatal_text = err.str()
        except ck.KafkaException as exc:
            err = _error_of(exc)
            if err is not None and not self._fatal_text:
                self._fatal_text = err.str()
        except RuntimeError:
            return  # closed

    def _rejoined(self, code_name: str | None, text: str) -> bool:
        """Rejoin the group with a new client if this fatal error is a first instance fence.

        Returns false (the caller raises) for any other fatal error, for a consumer that
        is not a static member, inside a rebalance callback (the old client is in the
        middle of a call), and for a second fence within the policy's window.
        """
        if self._rejoin is None or self._in_callback:
            return False
        if not self._fatal_text and not is_instance_fence(code_name, text):
            self._fatal_cause()
        fenced = is_instance_fence(code_name, text) or is_instance_fence(None, self._fatal_text)
        if not fenced:
            return False
        if not self._rejoin.allow(text):
            return False
        lost, self._owned = sorted(self._owned), set()
        self._gate.reset()  # the new client reads on from the group's committed offsets
        callback = self._on_lost or self._on_revoke
        if lost and callback is not None:
            callback(lost)  # as after a session timeout: the partitions are not ours now
        old, self._fatal_text = self._client, ""
        try:
            self._client = ck.Consumer(self._config)
        except (ck.KafkaException, ValueError, TypeError) as exc:
            raise FatalKafkaError(f"cannot make a Kafka consumer again: {exc}; exiting") from exc
        try:
            old.close()  # a static member sends no LeaveGroup; its callbacks are ignored
        except (ck.KafkaException, RuntimeError) as exc:
            _log.warning("closing the fenced consumer: %s", exc)
        if self._topics:
            self._guard(
                "subscribing again",
                lambda: self._client.subscribe(self._topics, **self._callbacks),
            )
        return True

    @property
    def rejoins(self) -> int:
        """How many times this consumer rejoined its group after an instance fence."""
        return 0 if self._rejoin is None else self._rejoin.rejoins

    def _topic_exists(self, topic: str) -> bool:
        # An unknown-topic event can precede metadata propagation of a topic
        # created a moment ago; ask the broker before calling it missing.
        try:
            _partition_count(self._client.list_topics(topic, timeout=5.0), topic)
        except ConfigurationError:
            return False
        except ck.KafkaException:
            return True
        return True

    # -- offsets

    def commit(self, offsets: Mapping[Partition, int]) -> None:
        """Commit ``offsets`` for the group synchronously; an empty mapping does nothing.

        Each offset is the **next offset to read** (last processed + 1).

        Raises:
            TransientError: the commit failed, e.g. because the group is
                rebalancing and these partitions may have moved; the records
                since the last successful commit will be delivered again.
        """
        if not offsets:
            return
        if not self._has_group:
            raise ConfigurationError("a consumer without a group_id cannot commit offsets")
        try:
            self._commit(self._gate.take(offsets))
        except FatalKafkaError as exc:
            if not self._rejoined(None, str(exc)):
                raise
            raise TransientError(
                "committing offsets failed: the consumer was fenced and rejoined its group; "
                "the records since the last commit will be delivered again"
            ) from exc

    def commit_async(self, offsets: Mapping[Partition, int]) -> None:
        """Commit ``offsets`` for the group (as :meth:`commit`) without waiting for the answer.

        At most one such commit is in flight (:mod:`._commits` says why): later offsets
        are held back, each partition's newest replacing the one before, and leave
        from the :meth:`poll_batch` that reads its answer (or with the next
        :meth:`commit`, a revocation, or :meth:`close`).

        A commit that failed is logged and counted in :attr:`commit_failures`, and
        the records since the last commit that succeeded are delivered again (after
        a restart or a rebalance), as when :meth:`commit` raises
        :class:`TransientError`. A later commit supersedes an earlier one that failed.
        """
        if not offsets:
            return
        if not self._has_group:
            raise ConfigurationError("a consumer without a group_id cannot commit offsets")
        self._gate.hold(offsets)
        self._send_held()

    @property
    def commits_sent(self) -> int:
        """Offset commits sent to the broker (by :meth:`commit_async` and :meth:`commit`)."""
        return self._gate.sent

    def _send_held(self, *, now: bool = False) -> None:
        """Send the held-back offsets, unless a commit is in flight (and ``now`` is false)."""
        offsets = self._gate.release(now=now)
        if offsets is not None:
            self._guard(
                "committing offsets",
                lambda: self._client.commit(offsets=_tps_at(offsets), asynchronous=True),
            )

    def _commit_held_now(self) -> None:
        """Commit the held-back offsets and wait (a revocation: the partitions leave us)."""
        try:
            self._commit(self._gate.take())
        except (TransientError, FatalKafkaError) as exc:
            _log.warning(
                "offsets not committed on a revocation; records will be read again: %s", exc
            )

    def _committed(self, err: ck.KafkaError | None, partitions: list[ck.TopicPartition]) -> None:
        """librdkafka's answer to a commit (``on_commit``): a failure is logged once."""
        self._gate.answered()  # the next held-back offsets may leave
        if err is not None and err.code() == _E._NO_OFFSET:
            return
        failed = err if err is not None else next((tp.error for tp in partitions if tp.error), None)
        if failed is None:
            return
        self.commit_failures += 1
        _log.warning(
            "offsets not committed (%s); the records since the last commit will be read again",
            failed.str(),
        )

    def _commit(self, offsets: Mapping[Partition, int]) -> None:
        result = self._guard(
            "committing offsets",
            lambda: self._client.commit(offsets=_tps_at(offsets), asynchronous=False),
        )
        for tp in result:
            if tp.error is not None:
                raise _translate(
                    tp.error,
                    f"committing offset {tp.offset} of {tp.topic} [{tp.partition}]",
                    text=tp.error.str(),
                )

    def committed(
        self, partitions: Iterable[Partition], timeout: float = 10.0
    ) -> dict[Partition, int | None]:
        """The group's committed offsets (next offset to read); ``None`` if none is committed."""
        result = self._guard(
            "reading committed offsets",
            lambda: self._client.committed(_tps(partitions), timeout=timeout),
        )
        return {(tp.topic, tp.partition): _offset_or_none(tp.offset) for tp in result}

    def position(self, partitions: Iterable[Partition]) -> dict[Partition, int | None]:
        """Per partition, the offset of the next record to be returned (``None``: unknown)."""
        result = self._guard("reading positions", lambda: self._client.position(_tps(partitions)))
        return {(tp.topic, tp.partition): _offset_or_none(tp.offset) for tp in result}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Make the next record read from an assigned partition the one at ``offset``."""
        self._guard(
            f"seeking {topic} [{partition}] to {offset}",
            lambda: self._client.seek(ck.TopicPartition(topic, partition, offset)),
        )

    # -- flow control and metadata

    def pause(self, partitions: Iterable[Partition]) -> None:
        """Stop fetching these partitions (they stay assigned) until :meth:`resume`."""
        self._guard("pausing partitions", lambda: self._client.pause(_tps(partitions)))

    def resume(self, partitions: Iterable[Partition]) -> None:
        """Fetch paused partitions again, from where they stopped."""
        self._guard("resuming partitions", lambda: self._client.resume(_tps(partitions)))

    def pause_all(self) -> list[Partition]:
        """Pause every partition assigned now; returns them.

        Partitions assigned later (by a rebalance) are not paused: keep
        polling to stay in the group and hold back what they deliver.
        """
        assigned = self.assignment()
        if assigned:
            self.pause(assigned)
        return assigned

    def resume_all(self) -> None:
        """Resume every partition assigned now (resuming one not paused is harmless)."""
        assigned = self.assignment()
        if assigned:
            self.resume(assigned)

    def assignment(self) -> list[Partition]:
        """The partitions currently assigned to this consumer."""
        result = self._guard("reading the assignment", self._client.assignment)
        return [(tp.topic, tp.partition) for tp in result]

    def watermarks(self, topic: str, partition: int, timeout: float = 10.0) -> tuple[int, int]:
        """``(low, high)``: the oldest offset still stored, and the offset of the next record."""
        tp = ck.TopicPartition(topic, partition)
        deadline = time.monotonic() + timeout
        while True:
            try:
                marks = self._guard(
                    f"reading the offsets of {topic} [{partition}]",
                    lambda: self._client.get_watermark_offsets(tp, timeout=timeout),
                    topic=topic,
                )
                break
            except TransientError:
                # A partition created a moment ago may still answer "not leader".
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
        if marks is None:
            raise TransientError(
                f"Kafka at {self._settings.bootstrap} did not report the offsets of "
                f"{topic} [{partition}] within {timeout:g}s"
            )
        low, high = marks
        return low, high

    def list_partitions(self, topic: str, timeout: float = 10.0) -> int:
        """The number of partitions of ``topic``.

        Raises:
            ConfigurationError: the topic does not exist.
        """
        metadata = self._guard(
            f"describing topic {topic}",
            lambda: self._client.list_topics(topic, timeout=timeout),
            topic=topic,
        )
        return _partition_count(metadata, topic)

    def close(self) -> None:
        """Leave the group (revoking partitions) and release the client; closing twice is a no-op.

        Commits only what :meth:`commit_async` held back (closing waits for its answer):
        commit what was processed before closing.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._send_held(now=True)
        except (TransientError, FatalKafkaError) as exc:
            _log.warning("offsets not committed before closing, they will be read again: %s", exc)
        try:
            self._client.close()
        except (ck.KafkaException, RuntimeError) as exc:
            _log.warning("closing the consumer: %s", exc)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _guard(self, doing: str, operation: Callable[[], _T], *, topic: str | None = None) -> _T:
        try:
            return operation()
        except ck.KafkaException as exc:
            error = _translate(_error_of(exc), doing, text=str(exc), topic=topic)
            if isinstance(error, FatalKafkaError) and self._rejoined(None, str(exc)):
                # The client's first call after the fence (a seek, a pause): the new one
                # owns nothing yet, so the call has nothing left to act on.
                raise TransientError(
                    f"{doing} failed: the consumer was fenced by its instance id and "
                    "rejoined its group"
                ) from exc
            raise error from exc


class _FenceWatch:
    """The consumer's librdkafka logger: passes every line on, and keeps the text of a
    fatal instance fence for the consumer (see ``Consumer._rejoined``).

    A commit that fails with "Local: Fatal error" can come before the client has served
    the error event that names the cause (the three-broker chaos profile saw it: the
    participant exited instead of rejoining); the client's own log line, served with the
    failing call, names it already.
    """

    def __init__(self, consumer: Consumer, forward: Any) -> None:
        self._consumer = consumer
        self._forward = forward

    def log(self, level: int, msg: str, *args: Any) -> None:
        if self._forward is not None:
            self._forward.log(level, msg, *args)
        if level >= logging.CRITICAL and not self._consumer._fatal_text:
            text = msg % args if args else msg
            if is_instance_fence(None, text):
                self._consumer._fatal_text = text
