"""Whose data a call may touch: the one place the caller's tenant comes from.

`api.auth.AuthInterceptor` authenticates every call before its handler runs and records
the caller here, for the handler's thread; every handler asks `caller_tenant` (or
`current_caller`) and passes the answer down. Nothing below the API edge decides a
tenant, and no request field can name one.
"""

from __future__ import annotations

from contextvars import ContextVar

import grpc

from contextd.domain.access import Caller
from contextd.domain.errors import Unauthenticated

# Set by the interceptor around each handler. Unset means the handler runs without it (a
# server assembled wrongly): then the call fails closed.
_CALLER: ContextVar[Caller | None] = ContextVar("contextd_caller", default=None)


def current_caller(context: grpc.ServicerContext) -> Caller:
    """The caller of this call (as the interceptor authenticated it)."""
    caller = _CALLER.get()
    if caller is None:
        raise Unauthenticated("the call was not authenticated")
    return caller


def caller_tenant(context: grpc.ServicerContext) -> str:
    """The tenant of the caller of this call."""
    return current_caller(context).tenant


def set_caller(caller: Caller) -> object:
    """Record the caller for the handler about to run; returns the token to reset."""
    return _CALLER.set(caller)


def reset_caller(token: object) -> None:
    _CALLER.reset(token)  # type: ignore[arg-type]
