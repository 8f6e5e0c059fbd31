"""The coordinator's own records, known by the place Kafka gave them.

With keys, the coordinator reads back what it writes: its status records, to move a
forged one to the DLQ (:meth:`OwnRecords.forged`), and its decisions. Each one
used to pass a signature check (a digest of a signature made here, see
``Keyring.remember_own``), which still meant rebuilding the signed bytes, hashing the
leaf and folding the batch proof of every record: about a tenth of a millisecond per
saga on the signed bench (docs/signing-performance.md).

A record's topic, partition and offset are assigned by the broker to the producer that
wrote it, once: a record read at the place a delivery report of this coordinator's
producer named is that record. So the read-back is recognised by a dictionary lookup.
The key and value are compared too (a keyed hash, salted per process), so that a topic
deleted and created again, whose offsets start over, cannot pass someone else's record
at a remembered place. Anything not remembered is checked as before: the memory is an
optimisation, never a reason to accept.

Records of a transaction that aborted have places too; a ``read_committed`` reader
never sees them, and their entries age out. Each entry is dropped when its record is
read back, so the memory holds the records written and not read yet, and at most
``limit`` of them.
"""

from __future__ import annotations

from collections import OrderedDict

from saga.streams._errors import SagaError
from saga.streams._signing import COORDINATOR, Keyring
from saga.streams.kafka import Message

_Place = tuple[str, int, int]
_COORDINATOR = frozenset({COORDINATOR})


class OwnRecords:
    """Where this coordinator's records landed, until each is read back."""

    __slots__ = ("_limit", "_places", "forgotten", "recognised")

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._places: OrderedDict[_Place, int] = OrderedDict()
        self.recognised = 0
        """Records read back and known as this coordinator's by their place."""
        self.forgotten = 0
        """Places dropped unread because the memory was full (those records are checked)."""

    def __len__(self) -> int:
        return len(self._places)

    def delivered(self, error: SagaError | None, message: Message) -> None:
        """A delivery report (a producer's ``on_delivery``): remember where it went."""
        if error is not None or message.offset < 0:
            return
        places = self._places
        places[(message.topic, message.partition, message.offset)] = hash(
            (message.key, message.value)
        )
        if len(places) > self._limit:
            places.popitem(last=False)
            self.forgotten += 1

    def read_back(self, message: Message) -> bool:
        """Whether ``message`` is a record this coordinator wrote (then forgotten here)."""
        digest = self._places.pop((message.topic, message.partition, message.offset), None)
        if digest is None or digest != hash((message.key, message.value)):
            return False
        self.recognised += 1
        return True

    def forged(self, message: Message, keys: Keyring) -> str | None:
        """Why status record ``message`` is not this coordinator's (it goes to the DLQ), or None.

        With keys, the coordinator reads the status topic too, only for this: its own
        records are known by their place, anything else passes a signature check; a
        forged one (which clients and restores do not believe anyway) is moved to the
        DLQ with the reason, like every other record that cannot be acted on.
        """
        if self.read_back(message):
            return None
        return keys.check(message.topic, message.key, message.value, message.headers, _COORDINATOR)
