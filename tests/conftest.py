"""Shared fixtures: a real server on a loopback port over a real DuckDB file.

`server` runs the server in this process (fast, still a real gRPC server and real
DuckDB file) on a `ManualClock` (the `clock` fixture): time moves only when a test
advances it, so windows and expiry are tested without sleeps or margins.
`spawn_server` runs `contextd serve` as its own process (on the real clock), for
restarts, signals and kill -9.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from hypothesis import settings as hypothesis_settings

from contextd.api.server import RunningServer, create_server
from contextd.config import Settings
from contextd.domain.clock import ManualClock, wall_clock_us
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc
from postgres_server import PostgresServer

# No per-example deadline: a deadline is a timed assertion, and on a loaded machine (CI, two
# cores shared) a slow example would fail a property that holds.
hypothesis_settings.register_profile("contextd", deadline=None)
hypothesis_settings.load_profile("contextd")

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    """Generate the client package's gRPC code (client/src/contextd_client/v1, git-ignored,
    as `make proto` does) when it is missing or older than proto/ or its generator:
    tests/test_client.py imports it next to the server's, and a copy generated from another
    version of the proto would not load beside the server's descriptors."""
    generated = ROOT / "client/src/contextd_client/v1/context_service_pb2.py"
    sources = [*ROOT.glob("proto/contextd/v1/*.proto"), ROOT / "client/codegen.py"]
    newest = max(p.stat().st_mtime for p in sources)
    if generated.exists() and generated.stat().st_mtime >= newest:
        return
    spec = importlib.util.spec_from_file_location("contextd_client_codegen", sources[-1])
    assert spec is not None and spec.loader is not None
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    codegen.generate(ROOT / "client/src")


USER = pb.ROLE_USER
ASSISTANT = pb.ROLE_ASSISTANT
TOOL_USE = pb.ROLE_TOOL_USE
TOOL_RESULT = pb.ROLE_TOOL_RESULT


def scope_pb(scope: str) -> pb.Scope:
    """A test's scope string as the wire's typed scope: "" is the default scope,
    "guild:G/channel:C/user:U" and "dm:U" the typed kinds, anything else a key."""
    if not scope:
        return pb.Scope()
    if scope.startswith("guild:"):
        guild, channel, user = (part.split(":", 1)[1] for part in scope.split("/"))
        return pb.Scope(channel=pb.ChannelScope(guild_id=guild, channel_id=channel, user_id=user))
    if scope.startswith("dm:"):
        return pb.Scope(direct_message=pb.DirectMessageScope(user_id=scope[3:]))
    return pb.Scope(key=scope)


def rendering(response: pb.BuildContextResponse, fmt: int) -> str:
    """The content of one rendering of a build response (AssertionError if absent)."""
    found = [r.content for r in response.renderings if r.format == fmt]
    assert len(found) == 1, f"expected one rendering of format {fmt}, got {len(found)}"
    return found[0]


@dataclass
class Client:
    """A thin test client over the real stub, with shorthands for common calls."""

    stub: pb_grpc.ContextServiceStub
    channel: grpc.Channel
    address: str

    def append(
        self,
        agent: str,
        *contents: str,
        thread: str = "t1",
        scope: str = "",
        role: int = USER,
        **fields: Any,
    ) -> pb.AppendMessagesResponse:
        messages = [pb.Message(role=role, content=c, **fields) for c in contents]  # type: ignore[arg-type]
        response: pb.AppendMessagesResponse = self.stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent=agent,
                scope=scope_pb(scope),
                thread=thread,
                messages=messages,
                create_agent_if_missing=True,
            )
        )
        return response

    def window(self, agent: str, thread: str = "t1", scope: str = "") -> list[pb.Message]:
        return self.list_messages(agent, thread=thread, scope=scope_pb(scope))

    def history(self, agent: str, thread: str = "t1", scope: str = "") -> list[pb.Message]:
        return self.list_messages(
            agent, thread=thread, scope=scope_pb(scope), range=pb.MESSAGE_RANGE_ALL
        )

    def list_messages(self, agent: str, **kwargs: Any) -> list[pb.Message]:
        """Every page of ListMessages, concatenated."""
        out: list[pb.Message] = []
        token = ""
        while True:
            resp = self.stub.ListMessages(
                pb.ListMessagesRequest(agent=agent, page_token=token, **kwargs)
            )
            out.extend(resp.messages)
            token = resp.next_page_token
            if not token:
                return out

    def contents(self, messages: list[pb.Message]) -> list[str]:
        return [m.content for m in messages]


def connect(address: str) -> Client:
    channel = grpc.insecure_channel(address)
    grpc.channel_ready_future(channel).result(timeout=15)
    return Client(pb_grpc.ContextServiceStub(channel), channel, address)  # type: ignore[no-untyped-call]


def db_rows(store: Any, sql: str) -> list[tuple[Any, ...]]:
    """Rows of `sql` read through a running server's own store (the DuckDB file is locked
    by it), on either engine: to prove what is stored, not what the API says."""
    if hasattr(store, "_pool"):  # PostgreSQL
        with store._pool.connection() as conn:
            return [tuple(r) for r in conn.execute(sql).fetchall()]
    store._cursor()  # the read barrier: journaled appends reach the tables first
    cur = store._con.cursor()  # reading only
    try:
        return [tuple(r) for r in cur.execute(sql).fetchall()]
    finally:
        cur.close()


@dataclass
class InProcessServer:
    running: RunningServer
    client: Client
    data_dir: Path


def ts(us: int) -> timestamp_pb2.Timestamp:
    """A Timestamp of `us` microseconds since the epoch."""
    t = timestamp_pb2.Timestamp()
    t.FromMicroseconds(us)
    return t


def span(us: int) -> duration_pb2.Duration:
    """A Duration of `us` microseconds."""
    d = duration_pb2.Duration()
    d.FromMicroseconds(us)
    return d


@pytest.fixture
def clock() -> ManualClock:
    """The in-process server's clock; it starts at the real time and moves only when
    the test advances it."""
    return ManualClock(wall_clock_us())


ENGINES = ("duckdb", "postgres")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that uses a server (or the `engine` fixture) runs on each engine, unless
    it is marked `duckdb_only` (it inspects the embedded file itself)."""
    if "engine" in metafunc.fixturenames:
        if metafunc.definition.get_closest_marker("duckdb_only"):
            engines = ["duckdb"]
        elif "postgres_dsn" in metafunc.definition.fixturenames:
            engines = ["postgres"]  # the test is about PostgreSQL itself (e.g. replicas)
        else:
            engines = list(ENGINES)
        metafunc.parametrize("engine", engines, scope="function")


@pytest.fixture
def store_url(engine: str, request: pytest.FixtureRequest) -> str:
    """The server's --store: "" for the embedded DuckDB file, or a fresh PostgreSQL
    database of the session's PostgreSQL server."""
    if engine == "duckdb":
        return ""
    dsn: str = request.getfixturevalue("postgres_dsn")
    return dsn


@pytest.fixture
def server(tmp_path: Path, clock: ManualClock, store_url: str) -> Iterator[InProcessServer]:
    # No periodic retention sweep: a test sweeps when it says so (through the service),
    # so that what a test reads never depends on when a background pass ran.
    settings = Settings(
        addr="127.0.0.1:0", data_dir=tmp_path / "data", store=store_url, sweep_interval_seconds=0
    )
    running = create_server(settings, clock=clock)
    client = connect(f"127.0.0.1:{running.port}")
    yield InProcessServer(running, client, settings.data_dir)
    client.channel.close()
    running.stop(grace=1)


@pytest.fixture
def client(server: InProcessServer) -> Client:
    return server.client


# The longest a signalled server may take to stop by design: the drain's grace (10 s),
# the writer's last jobs and the purger, each bounded by the write timeout (30 s), and
# the checkpoint at close.
STOP_BOUND_S = 90


@dataclass
class ServerProcess:
    """`contextd serve` as a child process on a free loopback port."""

    data_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[str] | None = None
    port: int = 0
    log_path: Path = Path()

    def start(self) -> Client:
        env = {
            **os.environ,
            "CONTEXTD_DATA_DIR": str(self.data_dir),
            "CONTEXTD_ADDR": "127.0.0.1:0",
            "CONTEXTD_LOG_FORMAT": "json",
            **self.extra_env,
        }
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Logs go to a file, not a pipe: an unread pipe would fill and block the server.
        self.log_path = self.data_dir.parent / f"server-{time.monotonic_ns()}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "contextd", "serve"],
                env=env,
                stderr=log,
                stdout=subprocess.DEVNULL,
                text=True,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for line in self.log_path.read_text().splitlines():
                if '"contextd serving"' in line:
                    self.port = int(json.loads(line)["port"])
                    return connect(f"127.0.0.1:{self.port}")
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.proc.kill()
        raise AssertionError("server did not start:\n" + self.log_path.read_text())

    def log(self) -> str:
        return self.log_path.read_text()

    def signal(self, signum: int) -> int:
        """Send `signum` and wait for the process to exit; its exit status.

        The wait is the longest a stop may take by design (the drain's grace, then the
        writer's last jobs, each bounded by the write timeout, and a checkpoint), so a
        loaded machine never fails a test here; past it the server is stuck: it is
        killed and the failure shows its log's tail."""
        assert self.proc is not None
        self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout=STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise AssertionError(
                f"the server did not stop within {STOP_BOUND_S} s of signal {signum}:\n"
                + self.log()[-5000:]
            ) from None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGTERM)


SpawnServer = Callable[..., ServerProcess]
"""Starts (tracks, and at the end kills) a `contextd serve` process on a data dir."""


@pytest.fixture
def spawn_server(tmp_path: Path, store_url: str) -> Iterator[SpawnServer]:
    """`contextd serve` processes on the test's engine (CONTEXTD_STORE unless the test
    sets its own), killed at the end if still running."""
    started: list[ServerProcess] = []

    class Tracked(ServerProcess):
        def __init__(self, data_dir: Path | None = None, **kwargs: Any) -> None:
            env = dict(kwargs.pop("extra_env", {}))
            if store_url:
                env.setdefault("CONTEXTD_STORE", store_url)
            super().__init__(data_dir or tmp_path / "data", extra_env=env, **kwargs)
            started.append(self)

    yield Tracked
    for proc in started:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One real PostgreSQL server for the session (started on first use, about 1 s). Do not
    stop or kill it: crash tests make a `PostgresServer` of their own."""
    with PostgresServer() as server:
        yield server


@pytest.fixture
def postgres_dsn(postgres: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """The DSN of a fresh empty database for this test alone, dropped afterwards (each
    costs a few MB on disk, and the session's server outlives the test)."""
    stem = re.sub(r"[^a-z0-9_]+", "_", request.node.name.lower())[:40]
    name = f"t_{stem}_{uuid.uuid4().hex[:8]}"
    yield postgres.create_database(name)
    postgres.drop_database(name)


@contextmanager
def summary_in_flight(client: Client, fake: Any, summary: str) -> Iterator[dict[str, Any]]:
    """Thirty turns on a1/t1 (the agent must exist), then a summarizing build (budget
    2,000) whose summary (`summary`) the fake LLM holds: the block runs while it is in
    flight. On leaving, the summary is released and the build awaited; the yielded dict
    then holds its "response" or its "error" (an RpcError)."""
    from fake_anthropic import full_checkpoint

    for i in range(30):
        client.append("a1", f"turn {i} " + "w " * 200, role=USER if i % 2 == 0 else ASSISTANT)
    fake.reply_text(full_checkpoint(summary))
    fake.hold()
    outcome: dict[str, Any] = {}

    def build() -> None:
        request = pb.BuildContextRequest(
            agent="a1", thread="t1", options=pb.BuildOptions(summarize=True, budget_tokens=2_000)
        )
        try:
            outcome["response"] = client.stub.BuildContext(request, timeout=60)
        except grpc.RpcError as exc:
            outcome["error"] = exc

    builder = threading.Thread(target=build)
    builder.start()
    try:
        assert fake.arrived.wait(30), "the build never asked for a summary"
        yield outcome
    finally:
        fake.release()
        builder.join(60)
    assert not builder.is_alive()
