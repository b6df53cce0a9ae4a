"""The ceiling: a grpcio server that answers AppendMessages without doing anything.

It has contextd's process model -- one Python process, a sync ``grpc.server`` over a
``ThreadPoolExecutor`` of the same size (32), the same message size limits -- and answers
each request with one receipt per message (id, create_time, token_estimate and
token_count, as contextd fills them for an agent without a model), so the request and
response bytes match. Whatever it reaches is what any Python gRPC server reaches on this machine,
so contextd's append rate is reported as a share of it.

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

from contextd.api.server import MAX_REQUEST_BYTES
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc


class EchoServicer(pb_grpc.ContextServiceServicer):
    """Receipts with made-up ids and the arrival time; nothing stored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_id = 1

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--workers", type=int, default=32)
    args = parser.parse_args()
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
