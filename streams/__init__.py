"""The log: wire records, their encoding and schemas, and the topic layout.

Everything public is re-exported here; the ``_``-prefixed modules are private.
"""

from ._codec import (
    SCHEMA_NAMES,
    decode,
    decode_announcement,
    decode_as,
    decode_keyed,
    encode,
    schema,
    to_dict,
)
from ._errors import (
    BusinessRejection,
    ConfigurationError,
    ConflictingRequest,
    FatalKafkaError,
    InvalidRecord,
    SagaError,
    SagaTimeout,
    TransientError,
)
from ._limits import (
    MAX_NAME_CHARS,
    MAX_NESTING,
    MAX_REASON_CHARS,
    MAX_RECORD_BYTES,
    MAX_SAGA_CHARS,
)
from ._records import (
    MAX_STEPS,
    RECORD_TYPES,
    TX_ID_PATTERN,
    WIRE_VERSION,
    Decision,
    Mode,
    Outcome,
    ParticipantAnnouncement,
    ParticipantState,
    Record,
    SagaAbort,
    SagaRequest,
    SagaState,
    SagaStatus,
    Step,
    StepEvent,
    StepProgress,
    StepStatus,
    StorageKind,
)
from ._registry import ParticipantInfo, ParticipantRegistry, read_registry
from ._signed_log import SignedLog
from ._signing import Keyring
from ._topics import Topics
from .kafka import KafkaSettings

__all__ = [
    "MAX_NAME_CHARS",
    "MAX_NESTING",
    "MAX_REASON_CHARS",
    "MAX_RECORD_BYTES",
    "MAX_SAGA_CHARS",
    "MAX_STEPS",
    "RECORD_TYPES",
    "SCHEMA_NAMES",
    "TX_ID_PATTERN",
    "WIRE_VERSION",
    "BusinessRejection",
    "ConfigurationError",
    "ConflictingRequest",
    "Decision",
    "FatalKafkaError",
    "InvalidRecord",
    "KafkaSettings",
    "Keyring",
    "Mode",
    "Outcome",
    "ParticipantAnnouncement",
    "ParticipantInfo",
    "ParticipantRegistry",
    "ParticipantState",
    "Record",
    "SagaAbort",
    "SagaError",
    "SagaRequest",
    "SagaState",
    "SagaStatus",
    "SagaTimeout",
    "SignedLog",
    "Step",
    "StepEvent",
    "StepProgress",
    "StepStatus",
    "StorageKind",
    "Topics",
    "TransientError",
    "decode",
    "decode_announcement",
    "decode_as",
    "decode_keyed",
    "encode",
    "read_registry",
    "schema",
    "to_dict",
]
