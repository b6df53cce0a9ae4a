"""The one place where exceptions become gRPC statuses.

Domain errors carry their code and a message meant for people; they go out as that code
with a `google.rpc.Status` whose ErrorInfo detail gives a machine-readable reason. Anything
else is a bug: it is logged with its traceback and the caller gets INTERNAL with a safe
message, never a Python repr.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from contextd.errors import ContextdError

log = logging.getLogger(__name__)

DOMAIN = "contextd"


def _status(code: grpc.StatusCode, message: str, reason: str, field: str = "") -> Any:
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN)
    if field:
        info.metadata["field"] = field
    detail = any_pb2.Any()
    detail.Pack(info)
    return rpc_status.to_status(
        status_pb2.Status(code=code.value[0], message=message, details=[detail])
    )


def _wrap(behavior: Callable[[Any, grpc.ServicerContext], Any], method: str) -> Any:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request, context)
        except ContextdError as exc:
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
            context.abort_with_status(_status(code, exc.message, exc.reason, exc.field))
        except Exception:
            log.exception("unexpected error", extra={"method": method})
            context.abort_with_status(
                _status(
                    grpc.StatusCode.INTERNAL,
                    "internal error; the server logged the details",
                    "INTERNAL",
                )
            )
        return None  # unreachable: abort_with_status raises

    return handle


class ErrorMappingInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method
        return grpc.unary_unary_rpc_method_handler(
            _wrap(handler.unary_unary, method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
