"""Per-tenant call rates (--tenant-max-rps): a tenant over its rate is told to wait, with
RetryInfo, and other tenants are not slowed. Time is the server's injected clock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import Client, connect
from contextd.api.server import RunningServer, create_server
from contextd.config import Settings
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import key_service_pb2 as kpb
from contextd.v1 import key_service_pb2_grpc as kpb_grpc


@pytest.fixture
def limited(
    tmp_path: Path, clock: ManualClock, store_url: str
) -> Iterator[tuple[RunningServer, Client]]:
    settings = Settings(
        addr="127.0.0.1:0", data_dir=tmp_path / "data", store=store_url, tenant_max_rps=2.0
    )
    running = create_server(settings, clock=clock)
    client = connect(f"127.0.0.1:{running.port}")
    yield running, client
    client.channel.close()
    running.stop(grace=1)


def _list(client: Client, key: str | None = None) -> None:
    metadata = [("authorization", f"Bearer {key}")] if key else []
    client.stub.ListAgents(pb.ListAgentsRequest(), metadata=metadata)


def _retry_delay_s(error: grpc.RpcError) -> float:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    reasons: list[str] = []
    delays: list[float] = []
    for detail in status.details:
        info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            reasons.append(str(info.reason))
        elif detail.Unpack(retry):
            delays.append(float(retry.retry_delay.ToMicroseconds()) / 1e6)
    assert reasons == ["TENANT_RATE_LIMITED"]
    return delays[0]


def test_a_tenant_over_its_rate_waits_and_others_do_not(
    limited: tuple[RunningServer, Client], clock: ManualClock
) -> None:
    _, client = limited
    keys = kpb_grpc.KeyServiceStub(client.channel)  # type: ignore[no-untyped-call]
    # The bootstrap operator's first call spends one of "default"'s two.
    root = keys.CreateKey(kpb.CreateKeyRequest(role=kpb.KEY_ROLE_ADMIN)).secret
    clock.advance(10_000_000)  # buckets full again
    acme = keys.CreateKey(
        kpb.CreateKeyRequest(role=kpb.KEY_ROLE_READ, tenant="acme"),
        metadata=[("authorization", f"Bearer {root}")],
    ).secret
    _list(client, root)  # "default" spent its two calls of this instant
    with pytest.raises(grpc.RpcError) as refused:
        _list(client, root)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    delay = _retry_delay_s(refused.value)
    assert 0 < delay <= 0.5
    _list(client, acme)  # another tenant is not held back
    _list(client, acme)
    clock.advance(int(delay * 1_000_000) + 1)
    _list(client, root)  # after the delay it may call again


def test_health_is_never_rate_limited(limited: tuple[RunningServer, Client]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    _, client = limited
    health = health_pb2_grpc.HealthStub(client.channel)
    for _ in range(5):
        assert health.Check(health_pb2.HealthCheckRequest()).status == 1
