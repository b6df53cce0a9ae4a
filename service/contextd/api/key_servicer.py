"""The KeyService servicer: proto in, use case, proto out."""

from __future__ import annotations

import grpc

from contextd.api.convert import timestamp_pb
from contextd.api.servicer import ContextServicer
from contextd.api.tenant import current_caller
from contextd.app.service import ContextService
from contextd.domain.access import ApiKey, KeyRole
from contextd.domain.errors import InvalidArgument
from contextd.v1 import key_service_pb2 as kpb
from contextd.v1 import key_service_pb2_grpc as kpb_grpc


def key_pb(key: ApiKey) -> kpb.ApiKey:
    return kpb.ApiKey(
        key_id=key.key_id,
        tenant=key.tenant,
        role=int(key.role),  # type: ignore[arg-type]
        name=key.name,
        create_time=timestamp_pb(key.create_time_us),
        revoke_time=timestamp_pb(key.revoke_time_us),
    )


def role_of(value: int) -> KeyRole:
    if value not in KeyRole.__members__.values():
        raise InvalidArgument("role must be KEY_ROLE_READ, _WRITE or _ADMIN", field="role")
    return KeyRole(value)


class KeyServicer(kpb_grpc.KeyServiceServicer):
    def __init__(self, service: ContextService, requests: ContextServicer) -> None:
        self._service = service
        self._requests = requests  # request ids work as for every write

    def CreateKey(
        self, request: kpb.CreateKeyRequest, context: grpc.ServicerContext
    ) -> kpb.CreateKeyResponse:
        caller = current_caller(context)
        role = role_of(request.role)
        return self._requests.idempotent(
            request,
            context,
            kpb.CreateKeyResponse,
            lambda created: kpb.CreateKeyResponse(key=key_pb(created[0]), secret=created[1]),
            lambda record: self._service.create_key(
                caller, request.tenant, role, request.name, record
            ),
        )

    def ListKeys(
        self, request: kpb.ListKeysRequest, context: grpc.ServicerContext
    ) -> kpb.ListKeysResponse:
        page = self._service.list_keys(
            current_caller(context), request.page_size, request.page_token, request.include_revoked
        )
        return kpb.ListKeysResponse(
            keys=[key_pb(k) for k in page.items], next_page_token=page.next_page_token
        )

    def RevokeKey(
        self, request: kpb.RevokeKeyRequest, context: grpc.ServicerContext
    ) -> kpb.RevokeKeyResponse:
        caller = current_caller(context)
        return self._requests.idempotent(
            request,
            context,
            kpb.RevokeKeyResponse,
            lambda key: kpb.RevokeKeyResponse(key=key_pb(key)),
            lambda record: self._service.revoke_key(caller, request.key_id, record),
        )
