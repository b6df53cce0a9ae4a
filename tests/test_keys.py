"""API keys: tenants, roles, revocation, and the rules of a server without keys.

Every test runs on both engines (the `server` fixture). Keys are created over gRPC: the
first by the local operator of a server without keys (the bootstrap), later ones by admin
keys of their tenant.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from conftest import InProcessServer, db_rows
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc
from contextd.v1 import key_service_pb2 as kpb
from contextd.v1 import key_service_pb2_grpc as kpb_grpc


class Caller:
    """Stubs that send one key (or none) with every call."""

    def __init__(self, channel: grpc.Channel, key: str | None) -> None:
        self.metadata = [("authorization", f"Bearer {key}")] if key else []
        self.context = pb_grpc.ContextServiceStub(channel)  # type: ignore[no-untyped-call]
        self.keys = kpb_grpc.KeyServiceStub(channel)  # type: ignore[no-untyped-call]

    def append(self, agent: str, text: str) -> pb.AppendMessagesResponse:
        response: pb.AppendMessagesResponse = self.context.AppendMessages(
            pb.AppendMessagesRequest(
                agent=agent,
                thread="t1",
                messages=[pb.Message(role=pb.ROLE_USER, content=text)],
                create_agent_if_missing=True,
            ),
            metadata=self.metadata,
        )
        return response

    def contents(self, agent: str) -> list[str]:
        response = self.context.ListMessages(
            pb.ListMessagesRequest(agent=agent, thread="t1", range=pb.MESSAGE_RANGE_ALL),
            metadata=self.metadata,
        )
        return [m.content for m in response.messages]

    def create_key(self, role: int, tenant: str = "", name: str = "") -> kpb.CreateKeyResponse:
        response: kpb.CreateKeyResponse = self.keys.CreateKey(
            kpb.CreateKeyRequest(tenant=tenant, role=role, name=name),  # type: ignore[arg-type]
            metadata=self.metadata,
        )
        return response


def _reason(error: grpc.RpcError) -> str:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    raise AssertionError("no ErrorInfo")


def _refused(call: object, code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    assert info.value.code() == code
    assert _reason(info.value) == reason


@pytest.fixture
def operator(server: InProcessServer) -> Caller:
    return Caller(server.client.channel, None)


def test_without_keys_the_local_operator_is_the_default_tenant(
    server: InProcessServer, operator: Caller
) -> None:
    operator.append("a1", "hello")
    assert server.client.contents(server.client.history("a1")) == ["hello"]  # same tenant


def test_once_a_key_exists_every_call_needs_one(operator: Caller) -> None:
    created = operator.create_key(kpb.KEY_ROLE_WRITE, tenant="acme", name="ci")
    assert created.secret.startswith(f"ctxd_{created.key.key_id}_")
    assert created.key.tenant == "acme" and created.key.role == kpb.KEY_ROLE_WRITE
    _refused(lambda: operator.append("a1", "x"), grpc.StatusCode.UNAUTHENTICATED, "API_KEY_INVALID")


def test_a_key_confines_its_calls_to_its_tenant(server: InProcessServer, operator: Caller) -> None:
    operator.append("a1", "the default tenant's secret plan")
    root = Caller(server.client.channel, operator.create_key(kpb.KEY_ROLE_ADMIN).secret)
    acme_key = root.create_key(kpb.KEY_ROLE_WRITE, tenant="acme").secret
    globex_key = root.create_key(kpb.KEY_ROLE_ADMIN, tenant="globex").secret
    acme = Caller(server.client.channel, acme_key)
    globex = Caller(server.client.channel, globex_key)
    acme.append("a1", "acme's note")
    assert acme.contents("a1") == ["acme's note"]
    # The same agent and thread names in another tenant are another context entirely.
    _refused(lambda: globex.contents("a1"), grpc.StatusCode.NOT_FOUND, "AGENT_NOT_FOUND")
    agents = globex.context.ListAgents(pb.ListAgentsRequest(), metadata=globex.metadata)
    assert list(agents.agents) == []
    assert root.contents("a1") == ["the default tenant's secret plan"]  # its own only
    # A page token of one tenant is refused to another, even for the same request.
    acme.append("a1", "more")
    page = acme.context.ListMessages(
        pb.ListMessagesRequest(agent="a1", thread="t1", page_size=1, range=pb.MESSAGE_RANGE_ALL),
        metadata=acme.metadata,
    )
    globex.append("a1", "globex 1")
    globex.append("a1", "globex 2")
    _refused(
        lambda: globex.context.ListMessages(
            pb.ListMessagesRequest(
                agent="a1",
                thread="t1",
                page_size=1,
                range=pb.MESSAGE_RANGE_ALL,
                page_token=page.next_page_token,
            ),
            metadata=globex.metadata,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )
    # Guessing another tenant's message ids gets nothing either.
    acme_ids = [m.id for m in page.messages]
    stats = globex.context.GetContextStats(
        pb.GetContextStatsRequest(agent="a1", thread="t1"), metadata=globex.metadata
    ).stats
    assert stats.total_message_count == 2
    built = globex.context.BuildContext(
        pb.BuildContextRequest(agent="a1", thread="t1"), metadata=globex.metadata
    )
    assert not set(acme_ids) & {m.id for m in built.messages}


def test_roles_limit_what_a_key_may_do(server: InProcessServer, operator: Caller) -> None:
    admin = Caller(server.client.channel, operator.create_key(kpb.KEY_ROLE_ADMIN).secret)
    reader = Caller(server.client.channel, admin.create_key(kpb.KEY_ROLE_READ).secret)
    writer = Caller(server.client.channel, admin.create_key(kpb.KEY_ROLE_WRITE).secret)
    writer.append("a1", "written")
    assert reader.contents("a1") == ["written"]
    reader.context.BuildContext(
        pb.BuildContextRequest(agent="a1", thread="t1"), metadata=reader.metadata
    )
    _refused(lambda: reader.append("a1", "x"), grpc.StatusCode.PERMISSION_DENIED, "ROLE_TOO_LOW")
    _refused(
        lambda: writer.create_key(kpb.KEY_ROLE_READ),
        grpc.StatusCode.PERMISSION_DENIED,
        "ROLE_TOO_LOW",
    )


def test_an_admin_key_manages_only_its_own_tenant(
    server: InProcessServer, operator: Caller
) -> None:
    root = Caller(server.client.channel, operator.create_key(kpb.KEY_ROLE_ADMIN).secret)
    admin = Caller(server.client.channel, root.create_key(kpb.KEY_ROLE_ADMIN, tenant="acme").secret)
    other = operator  # no key any more: refused
    _refused(
        lambda: other.create_key(kpb.KEY_ROLE_READ),
        grpc.StatusCode.UNAUTHENTICATED,
        "API_KEY_INVALID",
    )
    made = admin.create_key(kpb.KEY_ROLE_READ, name="dashboard")
    assert made.key.tenant == "acme"
    _refused(
        lambda: admin.create_key(kpb.KEY_ROLE_READ, tenant="globex"),
        grpc.StatusCode.PERMISSION_DENIED,
        "ROLE_TOO_LOW",
    )
    listed = admin.keys.ListKeys(kpb.ListKeysRequest(), metadata=admin.metadata)
    assert {k.name for k in listed.keys} >= {"dashboard"}
    assert all(k.tenant == "acme" for k in listed.keys)


def test_a_revoked_key_is_refused_at_once(server: InProcessServer, operator: Caller) -> None:
    admin_created = operator.create_key(kpb.KEY_ROLE_ADMIN)
    admin = Caller(server.client.channel, admin_created.secret)
    writer_created = admin.create_key(kpb.KEY_ROLE_WRITE)
    writer = Caller(server.client.channel, writer_created.secret)
    writer.append("a1", "before")
    revoked = admin.keys.RevokeKey(
        kpb.RevokeKeyRequest(key_id=writer_created.key.key_id), metadata=admin.metadata
    )
    assert revoked.key.HasField("revoke_time")
    _refused(lambda: writer.append("a1", "x"), grpc.StatusCode.UNAUTHENTICATED, "API_KEY_INVALID")
    again = admin.keys.RevokeKey(
        kpb.RevokeKeyRequest(key_id=writer_created.key.key_id), metadata=admin.metadata
    )
    assert again.key.revoke_time == revoked.key.revoke_time
    _refused(
        lambda: admin.keys.RevokeKey(
            kpb.RevokeKeyRequest(key_id="0123456789abcdef"), metadata=admin.metadata
        ),
        grpc.StatusCode.NOT_FOUND,
        "KEY_NOT_FOUND",
    )


@pytest.mark.parametrize(
    "bearer",
    ["Bearer nonsense", "Basic abc", "Bearer ctxd_0123456789abcdef_" + "x" * 43, "Bearer "],
)
def test_bad_keys_are_unauthenticated(
    server: InProcessServer, operator: Caller, bearer: str
) -> None:
    real = operator.create_key(kpb.KEY_ROLE_WRITE).secret
    stub = pb_grpc.ContextServiceStub(server.client.channel)  # type: ignore[no-untyped-call]
    _refused(
        lambda: stub.ListAgents(pb.ListAgentsRequest(), metadata=[("authorization", bearer)]),
        grpc.StatusCode.UNAUTHENTICATED,
        "API_KEY_INVALID",
    )
    wrong_secret = real[:-4] + ("aaaa" if not real.endswith("aaaa") else "bbbb")
    _refused(
        lambda: stub.ListAgents(
            pb.ListAgentsRequest(), metadata=[("authorization", f"Bearer {wrong_secret}")]
        ),
        grpc.StatusCode.UNAUTHENTICATED,
        "API_KEY_INVALID",
    )


def test_secrets_are_neither_stored_nor_logged(
    server: InProcessServer, operator: Caller, caplog: pytest.LogCaptureFixture
) -> None:
    created = operator.keys.CreateKey(
        kpb.CreateKeyRequest(role=kpb.KEY_ROLE_ADMIN, request_id="make-key-1")
    )
    # The part after "<prefix>_<key id>_" (the secret itself may contain "_").
    secret = created.secret.split("_", 2)[2]
    rows = db_rows(server.running.store, "SELECT * FROM api_keys")
    assert len(rows) == 1 and not any(secret in str(value) for value in rows[0])
    # Not in the response recorded for retries either: a retry gets the key, no secret.
    recorded = db_rows(server.running.store, "SELECT payload FROM request_records")
    assert recorded and not any(secret.encode() in bytes(r[0]) for r in recorded)
    creator = Caller(server.client.channel, created.secret)
    retried = creator.keys.CreateKey(
        kpb.CreateKeyRequest(role=kpb.KEY_ROLE_ADMIN, request_id="make-key-1"),
        metadata=creator.metadata,
    )
    assert (retried.key, retried.secret) == (created.key, "")
    caplog.set_level(logging.INFO)
    wrong = created.secret[:-4] + ("aaaa" if not created.secret.endswith("aaaa") else "bbbb")
    stub = pb_grpc.ContextServiceStub(server.client.channel)  # type: ignore[no-untyped-call]
    with pytest.raises(grpc.RpcError):
        stub.ListAgents(pb.ListAgentsRequest(), metadata=[("authorization", f"Bearer {wrong}")])
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert created.key.key_id in logged  # the failed attempt is logged, by key id
    assert secret[:20] not in logged and wrong.split("_", 2)[2][:20] not in logged


def test_health_needs_no_key(server: InProcessServer, operator: Caller) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    operator.create_key(kpb.KEY_ROLE_ADMIN)
    health = health_pb2_grpc.HealthStub(server.client.channel)
    response = health.Check(health_pb2.HealthCheckRequest(service=""))
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_a_server_without_keys_refuses_a_public_address(tmp_path: Path) -> None:
    def start(*extra: str) -> subprocess.CompletedProcess[str] | None:
        command = [sys.executable, "-m", "contextd", "serve", "--addr", "0.0.0.0:0"]
        command += ["--data-dir", str(tmp_path / "data"), *extra]
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=8)
        except subprocess.TimeoutExpired:
            return None  # it kept serving

    refused = start()
    assert refused is not None and refused.returncode == 2
    assert "refusing to serve 0.0.0.0:0 without API keys" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert start("--insecure") is None  # served until the timeout


def test_keys_from_the_command_line(server: InProcessServer, tmp_path: Path) -> None:
    address = server.client.address

    def keys(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "contextd", "keys", *args, "--server", address],
            capture_output=True,
            text=True,
            timeout=60,
        )

    created = keys("create", "--tenant", "acme", "--role", "admin", "--name", "ops", "--json")
    assert created.returncode == 0, created.stderr
    import json

    made = json.loads(created.stdout)
    assert made["tenant"] == "acme" and made["secret"].startswith("ctxd_")
    listed = keys("list", "--api-key", made["secret"])
    assert listed.returncode == 0 and made["key_id"] in listed.stdout and "ops" in listed.stdout
    assert made["secret"] not in listed.stdout
    refused = keys("list")  # no key any more
    assert refused.returncode == 1
    assert "API key" in refused.stderr and "Traceback" not in refused.stderr
    revoked = keys("revoke", made["key_id"], "--api-key", made["secret"])
    assert revoked.returncode == 0 and "revoked" in revoked.stdout


@pytest.mark.duckdb_only  # --direct opens the DuckDB file itself (no server running)
def test_keys_directly_on_the_store_for_any_tenant(tmp_path: Path) -> None:
    import json

    def keys(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                *(sys.executable, "-m", "contextd", "keys", *args),
                *("--direct", "--json", "--data-dir", str(tmp_path / "data")),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    created = keys("create", "--tenant", "acme", "--role", "read")
    assert created.returncode == 0, created.stderr
    key = json.loads(created.stdout)
    listed = keys("list", "--tenant", "acme")
    assert [k["key_id"] for k in json.loads(listed.stdout)] == [key["key_id"]]
    revoked = keys("revoke", key["key_id"])
    assert revoked.returncode == 0, revoked.stderr
    assert json.loads(revoked.stdout)[0]["revoke_time_us"] is not None
    assert json.loads(keys("list", "--tenant", "acme").stdout) == []
