"""Server assembly and life cycle: store, service, servicer, health, reflection, signals.

Shutdown order matters for durability: health goes NOT_SERVING (load balancers stop
sending), the gRPC server stops accepting and drains calls in flight for the grace
period, and only then is the store closed, which flushes queued writes and checkpoints.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from contextd.clock import MonotonicClock
from contextd.config import Settings
from contextd.grpc_errors import ErrorMappingInterceptor
from contextd.paging import PageTokens, load_or_create_key
from contextd.service import ContextService, Limits
from contextd.servicer import ContextServicer
from contextd.storage import Store
from contextd.summarizer import AnthropicConfig, AnthropicSummarizer
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ContextService"].full_name
MAX_REQUEST_BYTES = 256 << 20


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    store: Store
    health: health.HealthServicer
    workers: futures.ThreadPoolExecutor
    summarizer: AnthropicSummarizer

    def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING, drain calls in flight, then flush and close the store.

        The worker pool is joined before the store closes: a handler whose call was
        cancelled at the end of the grace period may still be running, and closing DuckDB
        under it would turn a clean shutdown into a crash.
        """
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        self.workers.shutdown(wait=True, cancel_futures=True)
        self.summarizer.close()
        self.store.close()


def create_server(settings: Settings, clock: MonotonicClock | None = None) -> RunningServer:
    """Build and start a server; port 0 in settings.addr binds a free port (for tests).

    `clock` is the server's one clock (commit times, clear markers, window ages, expiry);
    the default follows the wall clock and never goes back. Tests pass a ManualClock.
    """
    store = Store.open(settings.database_path, max_group_rows=settings.max_group_rows, clock=clock)
    try:
        summarizer = AnthropicSummarizer(
            AnthropicConfig(
                model=settings.summary_model,
                max_tokens=settings.summary_max_tokens,
                base_url=settings.anthropic_base_url,
                timeout_s=settings.summary_timeout_seconds,
            )
        )
        service = ContextService(
            store,
            summarizer,
            Limits(
                max_message_bytes=settings.max_message_bytes,
                max_batch_messages=settings.max_batch_messages,
            ),
            PageTokens(load_or_create_key(settings.data_dir)),
        )
        workers = futures.ThreadPoolExecutor(
            max_workers=settings.workers, thread_name_prefix="contextd-rpc"
        )
        server = grpc.server(
            workers,
            interceptors=[ErrorMappingInterceptor()],
            options=[
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_ContextServiceServicer_to_server(  # type: ignore[no-untyped-call]
            ContextServicer(service), server
        )
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        try:
            port = server.add_insecure_port(settings.addr)
        except RuntimeError as exc:  # grpcio's way of saying the bind failed
            port = 0
            cause: BaseException | None = exc
        else:
            cause = None
        if port == 0:
            raise OSError(
                f"cannot listen on {settings.addr}: the address is in use or not local "
                "(set CONTEXTD_ADDR or --addr to another host:port)"
            ) from cause
        server.start()
    except BaseException:
        store.close()
        raise
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(
        server=server,
        port=port,
        store=store,
        health=health_servicer,
        workers=workers,
        summarizer=summarizer,
    )


def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    running = create_server(settings)
    log.info(
        "contextd serving",
        extra={
            "addr": settings.addr,
            "port": running.port,
            "database": str(settings.database_path),
            "schema_version": running.store.schema_version(),
        },
    )
    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("shutting down", extra={"signal": signal.Signals(signum).name})
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stopping.wait()
    running.stop(settings.grace_seconds)
    log.info("contextd stopped")
