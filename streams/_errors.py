"""The one error tree of saga.

Every error says whether retrying the same operation can help::

    SagaError                      retryable
    ├── ConfigurationError         no   bad settings, arguments or environment
    │   └── ReconcileError         no   saga reconcile cannot run: a service, topic, jar
    │                                   or option is missing (streams.reconcile, exit 2)
    ├── InvalidRecord              no   a record breaks the wire contract (goes to the DLQ)
    ├── BusinessRejection          no   a step cannot be applied (key exists, below min, ...)
    │   └── StoreRefused           no   the store refused one step's statement (a trigger's
    │                                   RAISE, a constraint, a timeout): that step fails
    ├── ConflictingRequest         no   a tx_id reused with a different payload
    ├── SagaTimeout                yes  no final state yet; the saga is still running
    ├── TransientError             yes  broker or storage unavailable for now
    │   ├── SubmitUncertain        yes  a submitted request may not have reached Kafka:
    │   │                               submit it again with the same tx_id (``.tx_id``)
    │   └── TransactionAborted     yes  the Kafka transaction cannot commit: abort it and
    │                                   re-process from the committed offsets (streams.kafka)
    └── FatalKafkaError            no   the Kafka client cannot go on (fenced producer, ...)

``ReconcileError`` is defined in :mod:`streams.reconcile`, ``TransactionAborted`` in
:mod:`streams.kafka`, ``StoreRefused`` in :mod:`participants._refusals`, the others
here. ``tests/unit/test_error_tree.py`` checks this drawing against the classes, and
that no other public ``SagaError`` subclass exists.

Not drawn: exceptions for control flow within one package, which never reach a caller
of saga (participants' ``RunBatchAgain``; the MongoDB adapter's ``_Conflict``, a
``TransientError``, ``_Refused`` and ``_Speculation``; the SQL adapter's
``_NeedsSavepoints``; the CLI's ``_NotANumber``), and ``streams.testing.Killed`` (a
``BaseException``: a simulated crash in tests).

Third-party errors are translated at the boundary with ``raise ... from exc``.
"""

from __future__ import annotations


class SagaError(Exception):
    """Base of every error saga raises on purpose.

    ``tx_id``: the transaction an error of a client's submit is about (set by the
    client: its id is fixed before sending); ``None`` elsewhere.
    """

    retryable: bool = False
    tx_id: str | None = None


class ConfigurationError(SagaError):
    """Settings, arguments or the environment are wrong; fix them and start again."""


class InvalidRecord(SagaError):
    """A record breaks the wire contract.

    ``reason`` is one sentence a person can act on; consumers send the record to
    the dead-letter topic with this reason and go on with the next one.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BusinessRejection(SagaError):
    """A step cannot be applied to its storage; the saga must roll back."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ConflictingRequest(SagaError):
    """A transaction id was submitted again with a different payload."""


class SagaTimeout(SagaError):
    """The saga has no final state yet; it is still running and may finish later."""

    retryable = True


class TransientError(SagaError):
    """A broker or storage is unavailable for now; retrying later can help."""

    retryable = True


class SubmitUncertain(TransientError):
    """A request was handed to Kafka, but its delivery was not confirmed: it may or may not
    be in the log (the client may still deliver it later).

    ``tx_id`` is the transaction's id, fixed before sending. The way to retry is to submit
    the same steps again with ``tx_id=error.tx_id``: two requests with one ``tx_id`` and the
    same steps, saga name, mode and isolation are one saga, so a retry never runs the
    transaction twice, whichever of the copies arrives. A retry with a new ``tx_id`` may.
    """

    def __init__(self, tx_id: str, reason: str, *, tx_ids: tuple[str, ...] = ()) -> None:
        super().__init__(
            f"transaction {tx_id} may not have reached Kafka ({reason}); submit it again "
            f"with tx_id={tx_id!r}: a repeat with the same tx_id and steps is one saga"
        )
        self.tx_id: str = tx_id
        self.reason = reason
        self.tx_ids: tuple[str, ...] = tx_ids or (tx_id,)
        """Every transaction the error is about (a batch's), ``tx_id`` first."""


class FatalKafkaError(SagaError):
    """The Kafka client cannot continue (for example a fenced transactional producer).

    ``fenced`` is true when the broker refused the transactional producer's epoch
    (librdkafka's ``_FENCED``, ``PRODUCER_FENCED`` or ``INVALID_PRODUCER_EPOCH``): a newer
    instance with the same ``transactional.id`` initialised, or the broker bumped the
    epoch itself (a transaction it aborted, e.g. across a transaction coordinator
    failover). The code alone does not tell the two apart (librdkafka folds them into
    one); the coordinator asks its consumer group which one it was (coordinator._txn).
    """

    def __init__(self, message: str, *, fenced: bool = False) -> None:
        super().__init__(message)
        self.fenced = fenced
