"""The limits of an acceptable record: one definition for every reader of the log.

The codec (:mod:`streams._codec`) enforces all of them, so the coordinator and
the participants accept exactly the same records; the JSON Schemas state the
ones a schema can express (string lengths, integer ranges) and the Spark audit
checks what Spark SQL can and takes the coordinator's dead letters as the verdict
on the rest. The README's wire-contract section quotes these numbers.

Why these numbers:

* :data:`MAX_RECORD_BYTES` (key + value) is far below what a producer
  (``message.max.bytes``, 1,000,000 by default) and the broker (1,048,588)
  accept, so a rejected record always fits on the dead-letter topic whole,
  with its headers. A record over it is copied there as its first
  :data:`DLQ_EXCERPT_BYTES` bytes, its length and its SHA-256.
* :data:`MAX_NESTING` bounds how deep ``args`` and ``meta`` nest, far below
  what any recursive walk in Python (or orjson's own 254-level writer) copes
  with, so no handler can hit a recursion limit on a decoded record.
* Integers are signed 64-bit (what PostgreSQL ``BIGINT``, MongoDB ``long`` and
  Redis ``INCRBY`` hold); a number outside that range anywhere in a record is
  rejected rather than silently rounded to a double.
"""

from __future__ import annotations

from typing import Final

MAX_RECORD_BYTES: Final = 512 * 1024
"""Largest accepted record, key and value together (524,288 bytes)."""

MAX_KEY_BYTES: Final = 128
"""Largest accepted key: a ``tx_id`` is at most 128 ASCII characters."""

MAX_NESTING: Final = 32
"""How deep ``args`` and ``meta`` may nest: the object itself is level 1."""

MAX_REASON_CHARS: Final = 1000
"""Longest ``reason`` of an abort, a step event, a decision or a status."""

MAX_SAGA_CHARS: Final = 200
"""Longest ``saga`` name."""

MAX_NAME_CHARS: Final = 64
"""Longest participant or action name."""

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

DLQ_EXCERPT_BYTES: Final = 4096
"""How much of a record over :data:`MAX_RECORD_BYTES` the dead-letter topic keeps."""

__all__ = [
    "DLQ_EXCERPT_BYTES",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_KEY_BYTES",
    "MAX_NAME_CHARS",
    "MAX_NESTING",
    "MAX_REASON_CHARS",
    "MAX_RECORD_BYTES",
    "MAX_SAGA_CHARS",
]
