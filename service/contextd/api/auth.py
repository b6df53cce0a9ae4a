"""Authentication and roles at the edge: every call's key is checked before its handler.

The interceptor reads `authorization: Bearer <key>`, asks the use case who that is
(`KeyCalls.authenticate`), checks the role the method needs, and records the caller for
the handler (`api.tenant`). Health and reflection need no key (load balancers and grpcurl
use them; they reveal nothing of any tenant).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from contextd.api.tenant import current_caller, reset_caller, set_caller
from contextd.app.keys import KeyCalls
from contextd.domain.access import (
    Caller,
    KeyRefused,
    KeyRole,
    key_check_paid,
    owe_key_check,
    owed_key_check,
    restore_key_check,
)
from contextd.domain.errors import PermissionDenied, ResourceExhausted, Unauthenticated
from contextd.domain.rate import TenantRates

# The role each method of contextd.v1 needs; a method not listed needs ADMIN, so a new
# RPC is closed until someone decides otherwise.
_READ_METHODS = {
    "GetAgent",
    "ListAgents",
    "ListMessages",
    "ListThreads",
    "GetContextStats",
    "BuildContext",
    "ListStatus",
    "ListEvents",
    "SearchMessages",
}
_WRITE_METHODS = {
    "CreateAgent",
    "UpdateAgent",
    "DeleteAgent",
    "AppendMessages",
    "ClearContext",
    "CompactContext",
    "SetStatus",
    "ClearStatus",
}
# ToolOutputService: reads need READ, Put and Delete need WRITE.
_TOOL_OUTPUT_READ_METHODS = {
    "ListToolOutputs",
    "GetToolOutputs",
    "ReadToolOutput",
    "GrepToolOutput",
    "HashQuery",
    "SelectRelevantToolOutputs",
}
_TOOL_OUTPUT_WRITE_METHODS = {"PutToolOutput", "StreamPutToolOutput", "DeleteToolOutputs"}
_OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Methods whose store access confirms a key owed to it (domain/access.py
# `owed_key_check`), on a store that does (PostgreSQL): a call of theirs from a key this
# replica found active before, or without a key, is admitted without a look-up of its own
# (a round trip to the database on every call), and the key is confirmed by the call's
# write (AppendMessages) or with its snapshot's reads (BuildContext), or after its handler
# when neither came. Not with per-tenant rates: a rate is taken only for a caller whose
# key was confirmed.
_CONFIRMED_IN_THE_STORE = {
    "/contextd.v1.ContextService/AppendMessages",
    "/contextd.v1.ContextService/BuildContext",
}


def required_role(method: str) -> KeyRole | None:
    """The role `method` ("/package.Service/Method") needs; None: no key needed."""
    if method.startswith(_OPEN_SERVICES):
        return None
    name = method.rsplit("/", 1)[-1]
    if method.startswith("/contextd.v1.ContextService/"):
        if name in _READ_METHODS:
            return KeyRole.READ
        if name in _WRITE_METHODS:
            return KeyRole.WRITE
    if method.startswith("/contextd.v1.ToolOutputService/"):
        if name in _TOOL_OUTPUT_READ_METHODS:
            return KeyRole.READ
        if name in _TOOL_OUTPUT_WRITE_METHODS:
            return KeyRole.WRITE
    return KeyRole.ADMIN


def _bearer(context: grpc.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            text = value if isinstance(value, str) else value.decode(errors="replace")
            scheme, _, token = text.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Unauthenticated("the authorization metadata must be `Bearer <key>`")
            return token.strip()
    return None


class AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Authenticates every call of contextd's services (unary handlers: all of them)."""

    def __init__(self, keys: KeyCalls, rates: TenantRates | None = None) -> None:
        self._keys = keys
        self._rates = rates

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        needed = required_role(handler_call_details.method)
        if handler is None or needed is None:
            return handler

        unconfirmed = (
            handler_call_details.method in _CONFIRMED_IN_THE_STORE
            and self._rates is None
            and self._keys.writes_confirm_keys()
        )

        def admitted(context: grpc.ServicerContext) -> tuple[object, object]:
            """Authenticate (or admit unconfirmed, the check owed), check the role, record
            the caller; returns the reset tokens of both."""
            bearer = _bearer(context)
            owed = self._keys.admit_unconfirmed(bearer) if unconfirmed else None
            caller = owed or self._keys.authenticate(bearer)
            wait = self._rates.take(caller.tenant) if self._rates is not None else None
            if wait is not None:
                raise ResourceExhausted(
                    "this tenant is over its rate of calls on this server; retry after the "
                    f"delay ({wait:.3g} s)",
                    reason="TENANT_RATE_LIMITED",
                    retry_after_s=wait,
                )
            if caller.role < needed:
                if owed is not None:  # a revoked key is UNAUTHENTICATED, whatever its role
                    self._keys.confirm(owed)
                raise PermissionDenied(
                    f"this call needs a key with the {needed.name.lower()} role; this key "
                    f"has {caller.role.name.lower()}",
                    reason="ROLE_TOO_LOW",
                )
            return set_caller(caller), owe_key_check(owed)

        def settle(caller: Caller) -> None:
            """Confirm the caller's key if the handler's writes did not (UNAUTHENTICATED
            if it no longer stands: the handler wrote nothing, its answer is withheld)."""
            if owed_key_check() is not None:
                key_check_paid()
                self._keys.confirm(caller)

        def guarded(behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Any:
            def handle(request: Any, context: grpc.ServicerContext) -> Any:
                token, owed = admitted(context)
                try:
                    result = behavior(request, context)
                    settle(current_caller(context))
                except KeyRefused:
                    self._keys.refused(current_caller(context))
                    reset_caller(token)
                    raise
                except BaseException:
                    try:
                        settle(current_caller(context))
                    finally:
                        reset_caller(token)
                    raise
                finally:
                    restore_key_check(owed)
                if isinstance(result, Iterator):  # a response stream: keep the caller
                    return _streaming(result, token)
                reset_caller(token)
                return result

            return handle

        # Every handler shape is guarded (fail closed): a streaming RPC added later is
        # authenticated like the others.
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(guarded(handler.unary_unary), **kwargs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(guarded(handler.unary_stream), **kwargs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(guarded(handler.stream_unary), **kwargs)
        assert handler.stream_stream is not None
        return grpc.stream_stream_rpc_method_handler(guarded(handler.stream_stream), **kwargs)


def _streaming(responses: Iterator[Any], token: object) -> Iterator[Any]:
    """Yield a handler's responses with its caller recorded, then forget the caller."""
    try:
        yield from responses
    finally:
        reset_caller(token)
