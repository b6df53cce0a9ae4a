"""The ceiling: a grpcio server that answers AppendMessages without doing anything.

It has contextd's process model -- one Python process, a sync ``grpc.server`` over a
``ThreadPoolExecutor`` of the same size (32), the same message size limits, the same
scheduling policy (``--scheduling``, batch by default) -- and answers
each request with one receipt per message (id, create_time, token_estimate and
token_count, as contextd fills them for an agent without a model), so the request and
response bytes match. Whatever it reaches is what any Python gRPC server reaches on this machine,
so contextd's append rate is reported as a share of it.

It also answers BuildContext with a canned reply of the size the caller names in its
metadata (``x-reply-bytes``, with ``x-reply-messages`` context messages and
``x-reply-ids`` dropped ids, as a real reply holds), built once per shape: the round trip
of a same-size reply with no work behind it, set beside contextd's BuildContext RPC.

Run: ``python -m bench.echo_server --port 0 --workers 32``; it prints one JSON line
``{"message": "echo serving", "port": N}`` on stderr and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from concurrent import futures
from types import FrameType

import grpc

from contextd.api.server import MAX_REQUEST_BYTES, apply_scheduling
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc


class EchoServicer(pb_grpc.ContextServiceServicer):
    """Receipts with made-up ids and the arrival time; nothing stored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_id = 1
        self._replies: dict[tuple[int, int, int], pb.BuildContextResponse] = {}

    def AppendMessages(
        self, request: pb.AppendMessagesRequest, context: grpc.ServicerContext
    ) -> pb.AppendMessagesResponse:
        count = len(request.messages)
        with self._lock:
            first = self._next_id
            self._next_id += count
        now_us = time.time_ns() // 1_000
        receipts = []
        for i, message in enumerate(request.messages):
            # An agent without a model counts by the estimate, so both fields carry it.
            estimate = (len(message.content) + 3) // 4
            receipt = pb.MessageReceipt(id=first + i, token_estimate=estimate, token_count=estimate)
            receipt.create_time.FromMicroseconds(now_us)
            receipts.append(receipt)
        return pb.AppendMessagesResponse(receipts=receipts)

    def BuildContext(
        self, request: pb.BuildContextRequest, context: grpc.ServicerContext
    ) -> pb.BuildContextResponse:
        meta = {k: str(v) for k, v in context.invocation_metadata()}
        shape = (
            int(meta.get("x-reply-messages", "0")),
            int(meta.get("x-reply-ids", "0")),
            int(meta.get("x-reply-bytes", "0")),
        )
        with self._lock:
            reply = self._replies.get(shape)
            if reply is None:
                reply = self._replies[shape] = canned_reply(*shape)
        return reply


ROLES = (pb.ROLE_USER, pb.ROLE_ASSISTANT)


def canned_reply(messages: int, ids: int, size: int) -> pb.BuildContextResponse:
    """A BuildContextResponse of ``messages`` context messages and ``ids`` dropped ids,
    the contents sized so that the whole serializes to ``size`` bytes (padded in
    system_prompt for the last few)."""
    reply = pb.BuildContextResponse(
        messages=[
            pb.ContextMessage(id=10_000_000 + i, role=ROLES[i % 2], sequence=i)
            for i in range(messages)
        ]
    )
    reply.stats.dropped_ids.extend(range(1_000_000, 1_000_000 + ids))
    reply.stats.budget_tokens = 8_000
    if messages:
        # Each content's length prefix takes 1-3 bytes besides its characters.
        each = max(0, (size - reply.ByteSize()) // messages - 3)
        while True:
            for message in reply.messages:
                message.content = "x" * each
            if reply.ByteSize() <= size or each == 0:
                break
            each -= 1 + (reply.ByteSize() - size) // messages
            each = max(0, each)
    # A few rounds: the padding's own length prefix grows with it.
    for _ in range(4):
        missing = size - reply.ByteSize()
        if missing <= 0:
            break
        reply.system_prompt += "x" * missing
    while reply.ByteSize() > size and reply.system_prompt:
        reply.system_prompt = reply.system_prompt[:-1]
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--workers", type=int, default=32)
    # contextd's default scheduling policy, so the ceiling is measured as contextd serves
    # (under it the echo served 0-10% more, paired rounds).
    parser.add_argument("--scheduling", choices=["batch", "normal"], default="batch")
    args = parser.parse_args()
    apply_scheduling(args.scheduling)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=args.workers),
        options=[
            ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_ContextServiceServicer_to_server(EchoServicer(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print(json.dumps({"message": "echo serving", "port": port}), file=sys.stderr, flush=True)
    stopping = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stopping.wait()
    server.stop(1).wait()


if __name__ == "__main__":
    main()
