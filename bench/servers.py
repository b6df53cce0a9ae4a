"""Start and stop the servers under test as child processes, as tests/conftest.py does.

Both contextd and the echo server bind port 0 and announce the real port in a JSON log
line; logs go to a file, never a pipe, because an unread pipe would fill and block the
server mid-benchmark.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.child import REPO

ELSEWHERE = "bench-elsewhere"
"""The agent a benchmark appends to between timed builds, so that no build is answered
from a result its server remembered (every commit starts a new state)."""


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start(
    name: str, argv: list[str], env: dict[str, str], log_path: Path, marker: str
) -> ServerProcess:
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=log
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if marker in line:
                return ServerProcess(proc, int(json.loads(line)["port"]))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{name} did not start:\n{log_path.read_text()[-3000:]}")


def start_contextd(
    data_dir: Path,
    workers: int = 32,
    store: str = "",
    module: tuple[str, ...] = ("contextd", "serve"),
) -> ServerProcess:
    """``python -m contextd serve`` on a free loopback port over ``data_dir`` (its DuckDB
    file), or over the PostgreSQL database ``store`` names (a postgresql:// URL). The log
    goes next to ``data_dir``. ``store`` is always set, so that a CONTEXTD_STORE in the
    caller's environment cannot turn a DuckDB row into a PostgreSQL one. ``module``: the
    module run and its arguments (a probe serving contextd with a part patched out)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "CONTEXTD_STORE": store,
        "CONTEXTD_DATA_DIR": str(data_dir),
        "CONTEXTD_ADDR": "127.0.0.1:0",
        "CONTEXTD_LOG_FORMAT": "json",
        "CONTEXTD_LOG_LEVEL": "INFO",  # the "serving" line, which carries the port
        "CONTEXTD_WORKERS": str(workers),
    }
    return _start(
        "contextd",
        [sys.executable, "-m", *module],
        env,
        data_dir.parent / "contextd.log",
        '"contextd serving"',
    )


def create_write_key(address: str) -> str:
    """A write key of the tenant "default", made over gRPC by the local operator of the
    server at ``address`` (which has no key yet: from now on every call needs one); its
    secret."""
    import grpc

    from contextd.v1 import key_service_pb2 as kpb
    from contextd.v1 import key_service_pb2_grpc as kpb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = kpb_grpc.KeyServiceStub(channel)  # type: ignore[no-untyped-call]
        created = stub.CreateKey(kpb.CreateKeyRequest(role=kpb.KEY_ROLE_WRITE, name="bench"))
    return str(created.secret)


def start_echo(log_dir: Path, workers: int = 32) -> ServerProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    return _start(
        "echo",
        [sys.executable, "-m", "bench.echo_server", "--workers", str(workers)],
        {},
        log_dir / "echo.log",
        '"echo serving"',
    )


def append_elsewhere(stubs: Sequence[Any], thread: str, model: str) -> Callable[[], None]:
    """A function appending one message to the agent ``ELSEWHERE`` through every one of
    ``stubs`` (ContextService stubs), made after creating that agent where it is missing."""
    import grpc

    from contextd.v1 import context_service_pb2 as pb

    for stub in stubs:
        try:
            stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name=ELSEWHERE, model=model)))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
    request = pb.AppendMessagesRequest(
        agent=ELSEWHERE,
        thread=thread,
        messages=[pb.Message(role=pb.ROLE_USER, content="meanwhile, elsewhere")],
    )

    def append() -> None:
        for stub in stubs:
            stub.AppendMessages(request)

    return append
