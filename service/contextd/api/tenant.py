"""Whose data a call may touch: the one place the caller's tenant comes from.

Every handler asks `caller_tenant` and passes the answer down; nothing below the API edge
decides a tenant. Until keys exist every caller is the default tenant.
"""

from __future__ import annotations

import grpc

from contextd.domain.model import DEFAULT_TENANT


def caller_tenant(context: grpc.ServicerContext) -> str:
    """The tenant of the caller of this call."""
    return DEFAULT_TENANT
