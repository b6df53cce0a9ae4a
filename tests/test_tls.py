"""gRPC over TLS, and mutual TLS, with certificates the test makes itself.

A server given --tls-cert/--tls-key speaks TLS only; a client that trusts another CA
fails cleanly (UNAVAILABLE, no call reaches the server); with --tls-client-ca a client
must present a certificate that CA signed. A half or unreadable configuration stops the
server before it opens anything.
"""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from contextd.api.server import RunningServer, create_server
from contextd.config import Settings
from contextd.domain.clock import ManualClock
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc


@dataclass
class Pair:
    cert: bytes
    key: bytes
    cert_path: Path
    key_path: Path


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _issue(
    directory: Path,
    name: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> tuple[Pair, x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer[0].subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(pem)
    key_path.write_bytes(_pem_key(key))
    return Pair(pem, _pem_key(key), cert_path, key_path), cert, key


@dataclass
class Pki:
    ca: Pair
    other_ca: Pair
    server: Pair
    client: Pair  # signed by client_ca
    client_ca: Pair
    stranger: Pair  # a client certificate signed by other_ca


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca, ca_cert, ca_key = _issue(tmp_path, "ca", None, ca=True)
    other, other_cert, other_key = _issue(tmp_path, "other-ca", None, ca=True)
    server, _, _ = _issue(tmp_path, "server", (ca_cert, ca_key), server=True)
    client_ca, cca_cert, cca_key = _issue(tmp_path, "client-ca", None, ca=True)
    client, _, _ = _issue(tmp_path, "client", (cca_cert, cca_key))
    stranger, _, _ = _issue(tmp_path, "stranger", (other_cert, other_key))
    return Pki(ca, other, server, client, client_ca, stranger)


def _serve(tmp_path: Path, **tls: str) -> RunningServer:
    settings = Settings(addr="127.0.0.1:0", data_dir=tmp_path / "data", **tls)  # type: ignore[arg-type]
    return create_server(settings, clock=ManualClock(2_000_000_000_000_000))


@pytest.fixture
def tls_server(tmp_path: Path, pki: Pki) -> Iterator[RunningServer]:
    running = _serve(tmp_path, tls_cert=str(pki.server.cert_path), tls_key=str(pki.server.key_path))
    yield running
    running.stop(grace=1)


def _stub(port: int, credentials: grpc.ChannelCredentials | None) -> pb_grpc.ContextServiceStub:
    target = f"127.0.0.1:{port}"
    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials)
    )
    return pb_grpc.ContextServiceStub(channel)  # type: ignore[no-untyped-call]


def _create(stub: pb_grpc.ContextServiceStub) -> pb.CreateAgentResponse:
    response: pb.CreateAgentResponse = stub.CreateAgent(
        pb.CreateAgentRequest(agent=pb.Agent(name="a1")), timeout=10
    )
    return response


def test_a_client_trusting_the_ca_talks_tls(tls_server: RunningServer, pki: Pki) -> None:
    stub = _stub(tls_server.port, grpc.ssl_channel_credentials(root_certificates=pki.ca.cert))
    assert _create(stub).agent.name == "a1"


def test_a_client_trusting_another_ca_fails_cleanly(tls_server: RunningServer, pki: Pki) -> None:
    stub = _stub(tls_server.port, grpc.ssl_channel_credentials(root_certificates=pki.other_ca.cert))
    with pytest.raises(grpc.RpcError) as info:
        _create(stub)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    trusted = _stub(tls_server.port, grpc.ssl_channel_credentials(root_certificates=pki.ca.cert))
    with pytest.raises(grpc.RpcError) as missing:  # the failed call created nothing
        trusted.GetAgent(pb.GetAgentRequest(name="a1"), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_plaintext_client_gets_nothing_from_a_tls_server(
    tls_server: RunningServer,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _create(_stub(tls_server.port, None))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate_of_its_ca(tmp_path: Path, pki: Pki) -> None:
    running = _serve(
        tmp_path,
        tls_cert=str(pki.server.cert_path),
        tls_key=str(pki.server.key_path),
        tls_client_ca=str(pki.client_ca.cert_path),
    )
    try:
        with_cert = grpc.ssl_channel_credentials(
            root_certificates=pki.ca.cert,
            private_key=pki.client.key,
            certificate_chain=pki.client.cert,
        )
        assert _create(_stub(running.port, with_cert)).agent.name == "a1"
        for credentials in (
            grpc.ssl_channel_credentials(root_certificates=pki.ca.cert),  # no certificate
            grpc.ssl_channel_credentials(
                root_certificates=pki.ca.cert,
                private_key=pki.stranger.key,
                certificate_chain=pki.stranger.cert,
            ),
        ):
            with pytest.raises(grpc.RpcError) as info:
                _stub(running.port, credentials).ListAgents(pb.ListAgentsRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop(grace=1)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tls-cert", "CERT"], "TLS needs both --tls-cert and --tls-key"),
        (["--tls-cert", "CERT", "--tls-key", "MISSING"], "cannot read --tls-key"),
        (["--tls-cert", "CERT", "--tls-key", "NOTPEM"], "is not a PEM file"),
    ],
)
def test_a_bad_tls_configuration_stops_the_start(
    tmp_path: Path, pki: Pki, flags: list[str], says: str
) -> None:
    (tmp_path / "not.pem").write_text("hello")
    paths = {
        "CERT": str(pki.server.cert_path),
        "MISSING": str(tmp_path / "nope.key"),
        "NOTPEM": str(tmp_path / "not.pem"),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "contextd",
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path / "data"),
            *[paths.get(f, f) for f in flags],
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()  # nothing was opened
