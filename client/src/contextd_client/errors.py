"""Errors of contextd calls, as one exception hierarchy with the server's error details.

contextd answers every failure with a canonical status code and a `google.rpc.Status`
whose details hold an ErrorInfo (a documented `reason`), a BadRequest naming the offending
fields and, where waiting helps, a RetryInfo delay. A caller should not have to decode
those: `ContextdError` carries them as attributes, and its subclass says the code, so
`except NotFound` and `err.reason == "AGENT_NOT_FOUND"` both read naturally. Reasons stay
strings: a newer server may add some, and they must still come through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One offending request field (from google.rpc.BadRequest)."""

    field: str
    description: str


class ContextdError(Exception):
    """A failed contextd call: the status code and message plus the decoded details.

    `reason` is ErrorInfo.reason ("" if the server sent none, e.g. a connection failure),
    `field_violations` the BadRequest entries, `retry_delay` the RetryInfo delay (None when
    the server gave no advice), `metadata` ErrorInfo's metadata.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        reason: str = "",
        domain: str = "",
        metadata: Mapping[str, str] | None = None,
        field_violations: tuple[FieldViolation, ...] = (),
        retry_delay: timedelta | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.reason = reason
        self.domain = domain
        self.metadata: Mapping[str, str] = MappingProxyType(dict(metadata or {}))
        self.field_violations = field_violations
        self.retry_delay = retry_delay

    @property
    def field(self) -> str:
        """The offending field: the first BadRequest violation, or ErrorInfo's "field"."""
        if self.field_violations:
            return self.field_violations[0].field
        return self.metadata.get("field", "")

    def __str__(self) -> str:
        reason = f" ({self.reason})" if self.reason else ""
        return f"{self.code.name}{reason}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, reason={self.reason!r})"


class Cancelled(ContextdError):
    code = grpc.StatusCode.CANCELLED


class InvalidArgument(ContextdError):
    """Bad input; `field` names what to fix."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(ContextdError):
    """The call's deadline passed; a write may or may not have happened (retry it with the
    same request_id)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(ContextdError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ContextdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(ContextdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(ContextdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(ContextdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(ContextdError):
    """A concurrent change won (ETAG_MISMATCH): read again, then retry."""

    code = grpc.StatusCode.ABORTED


class Unimplemented(ContextdError):
    """The server does not know the RPC (an older server than this client)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(ContextdError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(ContextdError):
    """The server is down, shutting down or its store is busy; retrying later helps."""

    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(ContextdError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(ContextdError):
    """No valid API key."""

    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[ContextdError]] = {
    cls.code: cls
    for cls in (
        Cancelled,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}


def from_rpc_error(error: grpc.RpcError) -> ContextdError:
    """The ContextdError for a failed call, with its google.rpc.Status details decoded."""
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    message = str(error)
    if isinstance(error, grpc.Call):
        code = error.code()
        message = error.details() or ""
    reason = domain = ""
    metadata: dict[str, str] = {}
    violations: list[FieldViolation] = []
    delay: timedelta | None = None
    for detail in _details(error):
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [FieldViolation(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            delay = timedelta(microseconds=retry.retry_delay.ToMicroseconds())
    cls = _BY_CODE.get(code, ContextdError)
    return cls(
        message,
        code=code,
        reason=reason,
        domain=domain,
        metadata=metadata,
        field_violations=tuple(violations),
        retry_delay=delay,
    )


def _details(error: grpc.RpcError) -> list[Any]:
    """The Any details of the call's google.rpc.Status (none when it sent no Status, or
    one that contradicts the call's own code or message)."""
    if not isinstance(error, grpc.Call):
        return []
    try:
        status = rpc_status.from_call(error)
    except ValueError:
        return []
    return list(status.details) if status is not None else []
