"""Domain errors, each bound to the canonical gRPC status it means.

The domain raises these; one interceptor (`contextd.api.errors`) turns them into statuses,
so no servicer method has its own try/except and every error message reads the same way.
"""

from __future__ import annotations

from enum import Enum


class Code(Enum):
    """Canonical status codes the domain may ask for (a subset of grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAVAILABLE = "UNAVAILABLE"
    ABORTED = "ABORTED"
    DATA_LOSS = "DATA_LOSS"


class ContextdError(Exception):
    """An error the caller can act on: a code, a human message and a machine reason.

    `retry_after_s`, when set, is how long the caller should wait before trying again
    (sent as google.rpc.RetryInfo); None means a retry as such will not help.
    """

    code: Code = Code.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"

    def __init__(
        self,
        message: str,
        *,
        reason: str | None = None,
        field: str = "",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.field = field
        self.retry_after_s = retry_after_s


class InvalidArgument(ContextdError):
    code = Code.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"


class NotFound(ContextdError):
    code = Code.NOT_FOUND
    default_reason = "NOT_FOUND"


class AlreadyExists(ContextdError):
    code = Code.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class FailedPrecondition(ContextdError):
    code = Code.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class ResourceExhausted(ContextdError):
    code = Code.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class Aborted(ContextdError):
    """A concurrency conflict the caller resolves by reading again (e.g. a stale etag)."""

    code = Code.ABORTED
    default_reason = "ETAG_MISMATCH"


class DataLoss(ContextdError):
    """Stored data the call needs is missing or corrupt (e.g. a snapshot's document):
    retrying will not help; an operator must restore it from a backup."""

    code = Code.DATA_LOSS
    default_reason = "SNAPSHOT_UNREADABLE"


class Unauthenticated(ContextdError):
    """No valid API key came with a call that needs one."""

    code = Code.UNAUTHENTICATED
    default_reason = "API_KEY_INVALID"


class PermissionDenied(ContextdError):
    """The caller's key lacks the role the call needs."""

    code = Code.PERMISSION_DENIED
    default_reason = "ROLE_TOO_LOW"


class Unavailable(ContextdError):
    code = Code.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class StoreUnavailable(Unavailable):
    """The store cannot serve the call now: an I/O error, or a fatal DuckDB error after
    which the database must be reopened (the server then reports NOT_SERVING)."""

    default_reason = "STORE_UNAVAILABLE"


class StoreBusy(StoreUnavailable):
    """The store's writer did not take the call within the write timeout."""

    default_reason = "STORE_BUSY"


class StoreExhausted(ResourceExhausted):
    """DuckDB ran out of memory (its memory limit) for this call."""

    default_reason = "STORE_RESOURCE_EXHAUSTED"


class StaleModel(Exception):
    """An append was counted under a model the agent no longer has (another replica
    changed it): the caller counts again under `model` and retries. Never reaches a client."""

    def __init__(self, model: str) -> None:
        super().__init__(f"the agent's model is now {model!r}")
        self.model = model


class StoreLocked(Exception):
    """The DuckDB file is held by another process; raised at start-up only."""
