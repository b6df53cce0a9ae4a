"""Large tool outputs through a `contextd serve` process, on both engines: a 200 MB result
streams in and out with the server's memory staying within 100 MB of its idle level, and
a kill -9 during a streamed put leaves no half-visible output (nor its data)."""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest
from test_tool_outputs import Tools

from conftest import SpawnServer
from contextd.v1 import tool_output_service_pb2 as tpb
from waiting import wait_until

MiB = 1 << 20


def _rss(pid: int) -> int:
    """The process's resident set size in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """Samples a process's RSS every 20 ms in a thread; `peak` is the highest seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss(self.pid))
            self._stop.wait(0.02)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss(self.pid))


def _piece(i: int) -> bytes:
    """Piece i of a large result: 1 MiB, partly compressible, the same on every call."""
    return random.Random(i).randbytes(256 << 10) * 4


def _chunks_left(store_url: str) -> int:
    with psycopg.connect(store_url) as conn:
        row = conn.execute("SELECT count(*) FROM tool_output_chunks").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.slow
def test_a_200_mb_output_streams_in_and_out_in_bounded_memory(spawn_server: SpawnServer) -> None:
    server = spawn_server()
    client = server.start()
    assert server.proc is not None
    tools = Tools(client.channel)
    # Warm up every path once (imports, pools, first allocations), then take the idle level.
    warm = tools.stream_put(iter([_piece(0), _piece(1)]))
    assert len(tools.get([warm.id])[warm.id]) == 2 * MiB
    time.sleep(0.5)
    idle = _rss(server.proc.pid)
    pieces = 200
    sent = hashlib.sha256()

    def stream() -> Iterator[bytes]:
        for i in range(pieces):
            piece = _piece(i)
            sent.update(piece)
            yield piece

    with PeakRss(server.proc.pid) as rss:
        pointer = tools.stream_put(stream(), tool="dump")
        assert pointer.size_bytes == pieces * MiB
        assert pointer.sha256 == sent.hexdigest()
        received = hashlib.sha256()
        size = 0
        for message in tools.stub.GetToolOutputs(
            tpb.GetToolOutputsRequest(agent="a1", ids=[pointer.id])
        ):
            assert message.offset == size
            received.update(message.chunk)
            size += len(message.chunk)
        assert size == pieces * MiB and received.hexdigest() == sent.hexdigest()
    assert rss.peak - idle < 100 * MiB, f"peak {rss.peak / MiB:.0f} MiB, idle {idle / MiB:.0f} MiB"


def test_kill_9_during_a_streamed_put_leaves_no_half_visible_output(
    spawn_server: SpawnServer, store_url: str
) -> None:
    server = spawn_server()
    tools = Tools(server.start().channel)
    kept = tools.stream_put(iter([_piece(7), _piece(8), b"end"]), tool="before")
    halfway = threading.Event()
    release = threading.Event()
    failure: list[BaseException] = []

    def stream() -> Iterator[bytes]:
        for i in range(6):
            yield _piece(i)
        halfway.set()
        release.wait(30)  # the server is killed while it waits for the rest
        yield b"never sent"

    def put() -> None:
        try:
            tools.stream_put(stream(), tool="cut_off")
        except grpc.RpcError as exc:
            failure.append(exc)

    putter = threading.Thread(target=put)
    putter.start()
    assert halfway.wait(30)
    # The pieces sent reach the server and its storage:
    if store_url:  # written, in a transaction no other connection sees
        wait_until(lambda: _chunks_left(store_url) >= 3, "the pieces sent are stored")
        assert _chunks_left(store_url) == 3
    else:  # written, to a temporary file
        tool_outputs = server.data_dir / "tool_outputs"
        wait_until(lambda: any(tool_outputs.rglob(".*.chunks.tmp")), "the pieces sent are written")
    assert [p.id for p in tools.pointers()] == [kept.id]
    server.kill9()
    release.set()
    putter.join(30)
    assert failure and isinstance(failure[0], grpc.RpcError)

    restarted = spawn_server(data_dir=server.data_dir)
    tools = Tools(restarted.start().channel)
    assert [p.id for p in tools.pointers()] == [kept.id]
    assert tools.get([kept.id])[kept.id] == _piece(7) + _piece(8) + b"end"
    if store_url:
        assert _chunks_left(store_url) == 3  # the kept output's; none of the cut-off one
    else:
        files = sorted(p.name for p in (server.data_dir / "tool_outputs").rglob("*") if p.is_file())
        assert files == [f"{kept.id}.chunks"]
