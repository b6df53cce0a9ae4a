"""The one place where exceptions become gRPC statuses.

Domain errors carry their code and a message meant for people; they go out as that code
with a `google.rpc.Status` whose details give a machine-readable reason (ErrorInfo), the
offending field (BadRequest) and, where waiting helps, a retry delay (RetryInfo). Anything
else is a bug: it is logged with its traceback and the caller gets INTERNAL with a safe
message, never a Python repr.

The interceptor wraps every handler shape (unary and streaming), and the request
deserializer too: grpcio answers a body it cannot decode with INTERNAL ("Exception
deserializing request!"), which blames the server for the client's bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from contextd.domain.errors import ContextdError

log = logging.getLogger(__name__)

DOMAIN = "contextd"


class _Undecodable:
    """Stands in for a request whose bytes did not decode, so the handler can answer."""

    def __init__(self, error: str) -> None:
        self.error = error


def _pack(message: Any) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(message)
    return detail


def status_of(
    code: grpc.StatusCode,
    message: str,
    reason: str,
    field: str = "",
    retry_after_s: float | None = None,
) -> Any:
    """The grpc status (with details) for one error."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN)
    if field:
        info.metadata["field"] = field
    details = [_pack(info)]
    if field and code == grpc.StatusCode.INVALID_ARGUMENT:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromMicroseconds(int(retry_after_s * 1_000_000))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return rpc_status.to_status(
        status_pb2.Status(code=code.value[0], message=message, details=details)
    )


_INTERNAL = (grpc.StatusCode.INTERNAL, "internal error; the server logged the details", "INTERNAL")


def _abort_for(exc: BaseException, method: str, context: grpc.ServicerContext) -> None:
    """Abort the call with the status `exc` stands for (raises)."""
    if isinstance(exc, ContextdError):
        code = getattr(grpc.StatusCode, exc.code.value)
        log.info(
            "rejected call",
            extra={
                "method": method,
                "code": exc.code.value,
                "reason": exc.reason,
                "detail": exc.message,
            },
        )
        retry = getattr(exc, "retry_after_s", None)
        context.abort_with_status(status_of(code, exc.message, exc.reason, exc.field, retry))
    # A Rust panic surfaces as pyo3's PanicException, a BaseException: without this
    # branch it would escape grpcio's handler and leave the call without a status.
    log.error("unexpected error", exc_info=exc, extra={"method": method})
    context.abort_with_status(status_of(*_INTERNAL))


def _is_ours(exc: BaseException, context: grpc.ServicerContext) -> bool:
    """Whether to turn `exc` into a status: everything but the interpreter's own exits
    and a handler's own `context.abort`, which has already set the status it wants."""
    if isinstance(exc, KeyboardInterrupt | SystemExit | GeneratorExit):
        return False
    # grpcio has code() on its contexts since 1.38; the stubs do not declare it yet.
    return getattr(context, "code", lambda: None)() is None


def _check_decoded(request: Any, method: str, context: grpc.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        log.info("rejected call", extra={"method": method, "reason": "MALFORMED_REQUEST"})
        context.abort_with_status(
            status_of(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request body is not a valid {method.rsplit('/', 1)[-1]} request: "
                f"{request.error[:200]}",
                "MALFORMED_REQUEST",
            )
        )


def _decoding(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError as exc:
            return _Undecodable(str(exc) or "it does not parse")

    return decode


def _unary_request(
    behavior: Callable[[Any, grpc.ServicerContext], Any], method: str
) -> Callable[[Any, grpc.ServicerContext], Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        _check_decoded(request, method, context)
        try:
            return behavior(request, context)
        except BaseException as exc:
            if not _is_ours(exc, context):
                raise
            _abort_for(exc, method, context)
        return None  # unreachable: abort_with_status raises

    return handle


def _streaming_response(
    behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]], method: str
) -> Callable[[Any, grpc.ServicerContext], Iterator[Any]]:
    def handle(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        _check_decoded(request, method, context)
        try:
            yield from behavior(request, context)
        except BaseException as exc:
            if not _is_ours(exc, context):
                raise
            _abort_for(exc, method, context)

    return handle


def _checked_stream(requests: Iterator[Any], method: str, context: grpc.ServicerContext) -> Any:
    for request in requests:
        _check_decoded(request, method, context)
        yield request


class ErrorMappingInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Maps every exception of every handler to a status, for all four handler shapes."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        decode = _decoding(handler.request_deserializer)
        encode = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary_request(handler.unary_unary, method),
                request_deserializer=decode,
                response_serializer=encode,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _streaming_response(handler.unary_stream, method),
                request_deserializer=decode,
                response_serializer=encode,
            )
        if handler.stream_unary is not None:
            stream_unary = handler.stream_unary

            def client_streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
                return stream_unary(_checked_stream(requests, method, context), context)

            return grpc.stream_unary_rpc_method_handler(
                _unary_request(client_streaming, method),
                request_deserializer=decode,
                response_serializer=encode,
            )
        if handler.stream_stream is not None:
            stream_stream = handler.stream_stream

            def bidi(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                return stream_stream(_checked_stream(requests, method, context), context)

            return grpc.stream_stream_rpc_method_handler(
                _streaming_response(bidi, method),
                request_deserializer=decode,
                response_serializer=encode,
            )
        return handler
