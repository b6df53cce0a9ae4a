"""The load generator: many concurrent AppendMessages callers in one asyncio process.

Why asyncio: 32 blocking client threads in Python would spend the client's CPU on thread
switches and the GIL, and on a 2-core machine the client competes with the server for
CPU. ``grpc.aio`` runs all callers on one event loop over one channel. The client reports
its own CPU use so the report can say when it, not the server, was the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psutil  # type: ignore[import-untyped,unused-ignore]

from bench import corpus
from contextd.api.server import MAX_REQUEST_BYTES

AGENT = "bench-append"
# The server's own message size limits, both ways, so large batches and windows fit.
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
]


def messages_pb(pb: Any, history: list[corpus.Message]) -> list[Any]:
    """``history`` as ``contextd.v1.Message`` protos (``pb`` is the generated module)."""
    return [pb.Message(role=m.role, content=m.content) for m in history]


@contextlib.contextmanager
def populated_stub(
    address: str,
    agent: str,
    threads: Sequence[tuple[str, list[corpus.Message]]],
    *,
    model: str,
    batch: int = 10_000,
) -> Iterator[Any]:
    """A blocking ``ContextServiceStub`` to ``address`` after ``CreateAgent(agent, model)``
    and ``AppendMessages`` of each ``(thread, history)`` in calls of ``batch`` messages;
    the channel is closed when the block ends."""
    import grpc

    from contextd.v1 import context_service_pb2 as pb
    from contextd.v1 import context_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.ContextServiceStub(channel)  # type: ignore[no-untyped-call]
        stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name=agent, model=model)))
        for thread, history in threads:
            for start in range(0, len(history), batch):
                stub.AppendMessages(
                    pb.AppendMessagesRequest(
                        agent=agent,
                        thread=thread,
                        messages=messages_pb(pb, history[start : start + batch]),
                    )
                )
        yield stub


def _request(pb: Any, caller: int, batch: int, offset: int) -> Any:
    history = corpus.conversation(offset + batch, tools=False)[offset:]
    return pb.AppendMessagesRequest(
        agent=AGENT,
        thread=f"caller-{caller}",
        messages=messages_pb(pb, history),
        create_agent_if_missing=True,
    )


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def _drive(
    address: str,
    server_pid: int,
    concurrency: int,
    batch: int,
    warmup: float,
    windows: int,
    window_s: float,
) -> dict[str, Any]:
    import grpc

    from contextd.v1 import context_service_pb2 as pb
    from contextd.v1 import context_service_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        await channel.channel_ready()
        stub = pb_grpc.ContextServiceStub(channel)  # type: ignore[no-untyped-call]
        requests = [_request(pb, k, batch, k * batch % 5_000) for k in range(concurrency)]
        calls = 0
        stop = False

        async def caller(request: Any) -> None:
            nonlocal calls
            while not stop:
                response = await stub.AppendMessages(request)
                if len(response.receipts) != batch:
                    raise AssertionError(f"{len(response.receipts)} receipts for {batch}")
                calls += 1

        tasks = [asyncio.create_task(caller(r)) for r in requests]
        await asyncio.sleep(warmup)
        rates: list[float] = []
        cpu0, server0, wall0 = time.process_time(), _cpu(server_pid), time.perf_counter()
        for _ in range(windows):
            start_calls, start = calls, time.perf_counter()
            await asyncio.sleep(window_s)
            rates.append((calls - start_calls) / (time.perf_counter() - start))
        cpu = time.process_time() - cpu0
        server_cpu = _cpu(server_pid) - server0
        wall = time.perf_counter() - wall0
        stop = True
        await asyncio.gather(*tasks)
    return {"calls_per_s": rates, "client_cpu": cpu / wall, "server_cpu": server_cpu / wall}


def child_load(
    address: str,
    server_pid: int,
    concurrency: int,
    batch: int,
    seconds: float,
    windows: int = 3,
    warmup: float = 0.5,
) -> dict[str, Any]:
    """Drive ``concurrency`` callers for ``seconds`` (split into ``windows`` rate samples).

    Returns the calls/s of each window and the CPU use (1.0 = one core) of this client
    and of the server process ``server_pid`` over the measured windows.
    """
    return asyncio.run(
        _drive(address, server_pid, concurrency, batch, warmup, windows, seconds / windows)
    )
