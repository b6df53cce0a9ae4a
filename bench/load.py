"""The load generator: many concurrent AppendMessages callers in one asyncio process.

Why asyncio: 32 blocking client threads in Python would spend the client's CPU on thread
switches and the GIL, and on a 2-core machine the client competes with the server for
CPU. ``grpc.aio`` runs all callers on one event loop over one channel. The client reports
its own CPU use so the report can say when it, not the server, was the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
import uuid
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


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def _tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of process ``pid`` and of each of its descendants, by PID (processes that
    end while being read are left out)."""
    out: dict[int, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[proc.pid] = float(times.user + times.system)
    return out


def _tree_cpu_since(pid: int, before: dict[int, float]) -> float:
    """CPU seconds the tree of ``pid`` used since ``before``: a backend started meanwhile
    counts whole (it is new), one that ended meanwhile is lost (a pool keeps its
    connections, so that is rare)."""
    return sum(t - before.get(p, 0.0) for p, t in _tree_cpu(pid).items())


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@functools.cache
def _history(n: int) -> list[corpus.Message]:
    return corpus.conversation(n, tools=False)


def _request(pb: Any, caller: int, batch: int, offset: int) -> Any:
    history = _history(5_000 + batch)[offset : offset + batch]
    return pb.AppendMessagesRequest(
        agent=AGENT,
        thread=f"caller-{caller}",
        messages=messages_pb(pb, history),
        create_agent_if_missing=True,
    )


async def _drive(
    address: str,
    server_pid: int,
    concurrency: int,
    batch: int,
    warmup: float,
    windows: int,
    window_s: float,
    store_pid: int | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    import grpc

    from contextd.v1 import context_service_pb2 as pb
    from contextd.v1 import context_service_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        await channel.channel_ready()
        stub = pb_grpc.ContextServiceStub(channel)  # type: ignore[no-untyped-call]
        requests = [_request(pb, k, batch, k * batch % 5_000) for k in range(concurrency)]
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        calls = 0
        stop = False
        measuring = False
        latencies: list[float] = []

        async def caller(request: Any) -> None:
            nonlocal calls
            while not stop:
                # A request id of its own per call, as the official client sends (a
                # uuid4): the store records each append under it (the echo server
                # ignores it). The caller waits for each response before the next call,
                # so its one message is changed in place.
                request.request_id = uuid.uuid4().hex
                sent = time.perf_counter()
                response = await stub.AppendMessages(request, metadata=metadata)
                if measuring:  # calls that end inside the measured windows
                    latencies.append(time.perf_counter() - sent)
                if len(response.receipts) != batch:
                    raise AssertionError(f"{len(response.receipts)} receipts for {batch}")
                calls += 1

        tasks = [asyncio.create_task(caller(r)) for r in requests]
        await asyncio.sleep(warmup)
        rates: list[float] = []
        store0 = _tree_cpu(store_pid) if store_pid else {}
        cpu0, server0, wall0 = time.process_time(), _cpu(server_pid), time.perf_counter()
        measuring = True
        for _ in range(windows):
            start_calls, start = calls, time.perf_counter()
            await asyncio.sleep(window_s)
            rates.append((calls - start_calls) / (time.perf_counter() - start))
        measuring = False
        cpu = time.process_time() - cpu0
        server_cpu = _cpu(server_pid) - server0
        wall = time.perf_counter() - wall0
        store_cpu = _tree_cpu_since(store_pid, store0) / wall if store_pid else None
        stop = True
        await asyncio.gather(*tasks)
    return {
        "calls_per_s": rates,
        "client_cpu": cpu / wall,
        "server_cpu": server_cpu / wall,
        "store_cpu": store_cpu,
        "latency_ms": {
            "p50": _percentile(latencies, 0.50) * 1e3,
            "p99": _percentile(latencies, 0.99) * 1e3,
            "samples": len(latencies),
        },
    }


def child_load(
    address: str,
    server_pid: int,
    concurrency: int,
    batch: int,
    seconds: float,
    windows: int = 3,
    warmup: float = 0.5,
    store_pid: int | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    """Drive ``concurrency`` callers for ``seconds`` (split into ``windows`` rate samples),
    each call with ``api_key`` when given (``authorization: Bearer``).

    Returns the calls/s of each window, the p50 and p99 latency of the calls that ended
    in them (ms, as the caller sees it, client queueing included), and the CPU use (1.0 =
    one core) of this client, of the server process ``server_pid`` and, when given, of
    the process tree of ``store_pid`` (a PostgreSQL postmaster and its backends) over the
    measured windows.
    """
    return asyncio.run(
        _drive(
            address,
            server_pid,
            concurrency,
            batch,
            warmup,
            windows,
            seconds / windows,
            store_pid,
            api_key,
        )
    )


def child_loads(phases: list[dict[str, Any]], seconds: float, warmup: float = 0.5) -> list[Any]:
    """:func:`child_load` for each of ``phases`` (its keyword arguments but ``seconds`` and
    ``warmup``), one after another in this one process: a load phase costs its own
    duration, not a Python start-up and the imports as well, so servers can be taken in
    turn load by load without making the quick run slower."""
    return [child_load(**phase, seconds=seconds, warmup=warmup) for phase in phases]
