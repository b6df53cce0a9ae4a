"""Server assembly and life cycle: store, service, servicer, health, reflection, signals.

Shutdown order matters for durability and for what clients see: health goes NOT_SERVING
(load balancers stop sending); calls that arrive from then on are answered UNAVAILABLE
(SHUTTING_DOWN) by the server itself while the calls it had already received run to their
end, within the grace period; only then does the gRPC server stop (gRPC core ends a call
that reaches it after that with CANCELLED, which clients do not retry, so this window is
kept as short as the drain allows); last the store is closed, which flushes queued writes
and checkpoints.

Health also follows the store: NOT_SERVING after a fatal DuckDB error (until a restart)
and while the store's writer is stuck on one job for longer than the write timeout.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from contextd.adapters.open import open_store
from contextd.api.auth import AuthInterceptor
from contextd.api.errors import ErrorMappingInterceptor
from contextd.api.key_servicer import KeyServicer
from contextd.api.servicer import ContextServicer
from contextd.api.tool_output_servicer import ToolOutputServicer
from contextd.app.build.summarizer import AnthropicConfig, AnthropicSummarizer
from contextd.app.paging import PageTokens
from contextd.app.service import ContextService, Limits
from contextd.config import Settings
from contextd.domain.clock import MonotonicClock
from contextd.domain.errors import Unavailable
from contextd.domain.limits import ToolOutputLimits
from contextd.domain.rate import TenantRates
from contextd.ports.store import Store
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc
from contextd.v1 import key_service_pb2 as kpb
from contextd.v1 import key_service_pb2_grpc as kpb_grpc
from contextd.v1 import tool_output_service_pb2 as tpb
from contextd.v1 import tool_output_service_pb2_grpc as tpb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ContextService"].full_name
KEY_SERVICE_NAME = kpb.DESCRIPTOR.services_by_name["KeyService"].full_name
TOOL_OUTPUT_SERVICE_NAME = tpb.DESCRIPTOR.services_by_name["ToolOutputService"].full_name
MAX_REQUEST_BYTES = 256 << 20
APPEND_METHOD = f"/{SERVICE_NAME}/AppendMessages"
# How long a client refused during shutdown is told to wait before retrying (elsewhere).
SHUTDOWN_RETRY_AFTER_S = 1.0


class Admission(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Counts the ContextService calls being handled and, once the server is draining,
    answers new ones UNAVAILABLE (SHUTTING_DOWN) itself.

    Why: once grpc's own server.stop() has begun, gRPC core ends every call it has not
    yet handed to a handler with CANCELLED (grpc/grpc#41785), including a call the
    client sent just before the signal, and clients rightly do not retry CANCELLED. So
    the server first drains on its own terms: a call is admitted or refused when gRPC
    matches it to its handler (before its request body is read), admitted calls run to
    their end, refused ones get a retryable status, and grpc's stop comes only when no
    admitted call is left. Health and reflection calls are never refused or counted (a
    health check must still answer NOT_SERVING).
    """

    def __init__(self) -> None:
        # A plain lock (not the default RLock): taken twice per call.
        self._changed = threading.Condition(threading.Lock())
        self._running = 0
        self._draining = False

    @property
    def draining(self) -> bool:
        """Whether new calls are refused (the handler this returns for a method depends
        on it, and on nothing else of the call but the method)."""
        return self._draining

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or handler.unary_unary is None:
            return handler  # every ContextService method is unary; others pass through
        if not method.startswith((f"/{SERVICE_NAME}/", f"/{TOOL_OUTPUT_SERVICE_NAME}/")):
            return handler
        behavior = handler.unary_unary
        admitted = not self._draining

        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            if not admitted:
                raise Unavailable(
                    "the server is shutting down; retry (another server, or this one "
                    "after its restart)",
                    reason="SHUTTING_DOWN",
                    retry_after_s=SHUTDOWN_RETRY_AFTER_S,
                )
            with self._changed:
                self._running += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("call received", extra={"method": method})
            try:
                return behavior(request, context)
            finally:
                with self._changed:
                    self._running -= 1
                    if self._draining:  # only drain() waits on it
                        self._changed.notify_all()

        return grpc.unary_unary_rpc_method_handler(
            handle,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def drain(self, timeout: float | None) -> int:
        """Refuse calls from now on; wait (at most `timeout`) until no admitted call is
        being handled. Returns how many still are."""
        with self._changed:
            self._draining = True
            log.info("draining calls in flight", extra={"calls": self._running})
            self._changed.wait_for(lambda: self._running == 0, timeout)
            return self._running


class Interceptors(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """The server's interceptors (outermost first), run once per method and draining
    state rather than once per call.

    Why: gRPC runs interceptors on its one polling thread for every call, and each of
    ours wraps the method's handler in new closures and a new handler; at thousands of
    small calls a second that is a serial cost no handler thread can share. What each
    returns depends only on the method's handler, the method's name and (Admission) on
    whether the server is draining, so the composed handler is kept per (method,
    draining) and reused while the inner handler is the same object. Unknown methods
    (no handler) are never kept, so the cache holds at most two entries per served
    method. Per-call work (the key check, the caller, the admission count) still runs in
    the handlers, per call.

    `pools` names methods that run on a thread pool of their own (see `on_pool`).
    """

    def __init__(
        self,
        interceptors: Sequence[grpc.ServerInterceptor[Any, Any]],
        admission: Admission,
        pools: Mapping[str, futures.ThreadPoolExecutor] | None = None,
    ) -> None:
        self._interceptors = tuple(interceptors)
        self._admission = admission
        self._pools = dict(pools or {})
        self._composed: dict[
            tuple[str, bool],
            tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any] | None],
        ] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        key = (handler_call_details.method, self._admission.draining)
        kept = self._composed.get(key)
        if kept is not None and kept[0] is handler:
            return kept[1]
        composed = self._compose(0, handler, handler_call_details)
        pool = self._pools.get(handler_call_details.method)
        if composed is not None and pool is not None:
            composed = on_pool(composed, pool)
        if composed is not None and handler_call_details.method in BYTES_METHODS:
            composed = pass_bytes(composed)
        self._composed[key] = (handler, composed)
        return composed

    def _compose(
        self,
        at: int,
        handler: grpc.RpcMethodHandler[Any, Any],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if at == len(self._interceptors):
            return handler
        return self._interceptors[at].intercept_service(
            lambda d: self._compose(at + 1, handler, d), details
        )


def on_pool(
    handler: grpc.RpcMethodHandler[Any, Any], pool: futures.ThreadPoolExecutor
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` (a unary-unary one) run on `pool` instead of the server's pool.

    Why AppendMessages has a pool of its own: agents append between LLM calls, so an
    append must not wait for a thread that a slow call holds (a build waiting on its
    summary from the LLM, a long search), and a burst of appends, each holding its
    thread until its group commit answers, must not take the threads builds need. (A
    smaller pool for appends was measured too: 8 threads served no more single-message
    appends from 32 callers than 32 threads, paired rounds, so the default is as many as
    the server's pool.) grpcio picks the pool from the behaviour's
    `experimental_thread_pool` attribute (grpc/_server.py,
    `_select_thread_pool_for_behavior`); tests/test_server_pools.py fails if a grpcio
    release stops doing so.
    """
    behaviour = handler.unary_unary
    if behaviour is None:
        raise ValueError("only unary-unary methods run on a pool of their own")

    def run(request: Any, context: grpc.ServicerContext) -> Any:
        return behaviour(request, context)

    run.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return grpc.unary_unary_rpc_method_handler(
        run,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


# Methods whose behaviour answers with its response already serialized (`pass_bytes`).
BYTES_METHODS = frozenset({"/contextd.v1.ContextService/BuildContext"})


def pass_bytes(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` (a unary-unary one) whose behaviour may return its response already
    serialized: bytes are sent as they are, a message is serialized as before.

    Why: BuildContext, on every LLM call an agent makes, writes its response's bulk (the
    kept messages, up to 10,000 dropped ids) as wire bytes in the Rust core
    (`contextd.api.convert.build_response_bytes`); parsing them into a message only for
    gRPC to serialize it again cost about a third of the response's making. The check is
    made once per call, in the serializer gRPC calls anyway.
    """
    behaviour = handler.unary_unary
    serialize = handler.response_serializer
    if behaviour is None:
        raise ValueError("only unary-unary methods may return bytes")
    if serialize is None:
        return handler  # gRPC sends what the behaviour returns (bytes) unchanged

    def serializer(response: Any) -> bytes:
        if type(response) is bytes:
            return response
        return serialize(response)  # type: ignore[no-any-return]

    return grpc.unary_unary_rpc_method_handler(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=serializer,
    )


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    store: Store
    health: health.HealthServicer
    workers: futures.ThreadPoolExecutor
    append_workers: futures.ThreadPoolExecutor | None
    summarizer: AnthropicSummarizer
    admission: Admission
    service: ContextService | None = None
    sweeper: RetentionSweeper | None = None

    def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING, refuse new calls and drain those in flight, stop gRPC, then flush
        and close the store.

        Long background work of the store (removing a deleted agent's messages) stops
        first, so a DeleteAgent in flight returns at once instead of holding the drain.
        The worker pool is joined before the store closes: a handler whose call was
        cancelled at the end of the grace period may still be running, and closing DuckDB
        under it would turn a clean shutdown into a crash.
        """
        deadline = None if grace is None else time.monotonic() + grace
        self.health.enter_graceful_shutdown()
        if self.sweeper is not None:
            self.sweeper.stop()  # after its current chunk
        self.store.stop_background_work()
        self.admission.drain(0.0 if grace is None else grace)  # None: stop at once
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.server.stop(left).wait()
        self.workers.shutdown(wait=True, cancel_futures=True)
        if self.append_workers is not None:
            self.append_workers.shutdown(wait=True, cancel_futures=True)
        self.summarizer.close()
        self.store.close()


class RetentionSweeper:
    """Runs the retention sweep every `interval_s` seconds on its own thread (the first
    pass one interval after start); a pass that fails is logged and the next one retries.
    On PostgreSQL every replica runs one, and the store's lock lets one sweep at a time."""

    def __init__(self, service: ContextService, interval_s: float) -> None:
        self._service = service
        self._interval_s = interval_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="contextd-sweep", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval_s):
            try:
                report = self._service.sweep_retention(stop=self._stopping)
            except Exception:
                log.exception("retention sweep failed; the next pass retries")
                continue
            if report.expired_deleted or report.overflow_deleted:
                log.info(
                    "retention sweep deleted messages",
                    extra={
                        "threads": report.threads,
                        "expired_deleted": report.expired_deleted,
                        "overflow_deleted": report.overflow_deleted,
                    },
                )

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=30)


def is_loopback(addr: str) -> bool:
    """Whether `addr` (host:port) listens on a loopback address only."""
    host = addr.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_credentials(settings: Settings) -> grpc.ServerCredentials | None:
    """TLS credentials from the PEM files the settings name (None: plaintext).

    Raises ValueError with a one-line reason for a half configuration or a file that
    cannot be read, before anything is opened: a server meant to encrypt must never fall
    back to plaintext.
    """
    if not (settings.tls_cert or settings.tls_key or settings.tls_client_ca):
        return None
    if not (settings.tls_cert and settings.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")

    def read(path: str, flag: str) -> bytes:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read {flag} {path}: {exc.strerror}") from exc
        if b"-----BEGIN " not in data:
            raise ValueError(f"{flag} {path} is not a PEM file")
        return data

    cert = read(settings.tls_cert, "--tls-cert")
    key = read(settings.tls_key, "--tls-key")
    client_ca = read(settings.tls_client_ca, "--tls-client-ca") if settings.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def create_server(settings: Settings, clock: MonotonicClock | None = None) -> RunningServer:
    """Build and start a server; port 0 in settings.addr binds a free port (for tests).

    `clock` is the server's one clock (commit times, clear markers, window ages, expiry);
    the default follows the wall clock and never goes back. Tests pass a ManualClock.
    """
    server_credentials(settings)  # a bad TLS configuration fails before anything opens
    store = open_store(settings, clock)
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
                snapshot_max_messages=settings.snapshot_max_messages,
                snapshot_max_bytes=settings.snapshot_max_bytes,
                tenant_max_bytes=settings.tenant_max_bytes,
            ),
            PageTokens(store.page_token_key()),
        )
        service.tool_output_limits = ToolOutputLimits(
            inline_bytes=settings.tool_output_inline_bytes,
            compress_bytes=settings.tool_output_compress_bytes,
            max_bytes=settings.tool_output_max_bytes,
        )
        workers = futures.ThreadPoolExecutor(
            max_workers=settings.workers, thread_name_prefix="contextd-rpc"
        )
        append_workers = (
            futures.ThreadPoolExecutor(
                max_workers=settings.append_workers, thread_name_prefix="contextd-append"
            )
            if settings.append_workers
            else None
        )
        admission = Admission()
        rates = (
            TenantRates(settings.tenant_max_rps, store.clock) if settings.tenant_max_rps else None
        )
        exposed = not is_loopback(settings.addr) and not settings.insecure
        if exposed and not store.any_active_key():
            raise OSError(
                f"refusing to serve {settings.addr} without API keys: anyone who can "
                "reach it would read every context. Create a key first (`contextd keys "
                "create --direct`), listen on a loopback address, or pass --insecure"
            )
        server = grpc.server(
            workers,
            # The error mapping wraps the others, so every refusal gets its details; the
            # key is checked before the call is admitted.
            interceptors=[
                Interceptors(
                    [ErrorMappingInterceptor(), AuthInterceptor(service, rates), admission],
                    admission,
                    {APPEND_METHOD: append_workers} if append_workers is not None else None,
                )
            ],
            options=[
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        servicer = ContextServicer(service)
        pb_grpc.add_ContextServiceServicer_to_server(  # type: ignore[no-untyped-call]
            servicer, server
        )
        kpb_grpc.add_KeyServiceServicer_to_server(  # type: ignore[no-untyped-call]
            KeyServicer(service, servicer), server
        )
        tpb_grpc.add_ToolOutputServiceServicer_to_server(  # type: ignore[no-untyped-call]
            ToolOutputServicer(service, servicer), server
        )
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                KEY_SERVICE_NAME,
                TOOL_OUTPUT_SERVICE_NAME,
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        credentials = server_credentials(settings)
        try:
            if credentials is None:
                port = server.add_insecure_port(settings.addr)
            else:
                port = server.add_secure_port(settings.addr, credentials)
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

    def follow_store(serving: bool) -> None:
        """The store turned unable to serve (a fatal error, a stuck writer) or able again."""
        status = health_pb2.HealthCheckResponse.SERVING
        if not serving:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME, TOOL_OUTPUT_SERVICE_NAME):
            health_servicer.set(name, status)  # ignored once shutdown has begun

    follow_store(True)
    store.watch(follow_store)
    return RunningServer(
        server=server,
        port=port,
        store=store,
        health=health_servicer,
        workers=workers,
        append_workers=append_workers,
        summarizer=summarizer,
        admission=admission,
        service=service,
        sweeper=(
            RetentionSweeper(service, settings.sweep_interval_seconds)
            if settings.sweep_interval_seconds
            else None
        ),
    )


def apply_scheduling(policy: str) -> str:
    """Put every thread of this process under the named Linux scheduling policy (and
    so every thread they start later: threads inherit it). Returns the policy in effect.

    Why "batch" is the default: a handler blocks until the writer's group commit
    answers it, and gRPC's threads block on the network, so each call wakes threads
    several times. Under the normal policy a woken thread preempts the running one,
    which often holds Python's GIL: it is put aside with the lock held, and the woken
    thread runs only to find the lock taken and sleep again. Measured under 32
    single-message callers (py-spy --gil): answering a group's callers was 11% of the
    GIL-held time, 3% under batch, and the GIL was held about half as long per call.
    SCHED_BATCH threads are not preempted on a wake-up (their turn comes at the
    scheduler's tick or when the running thread blocks); an idle core still takes a
    woken thread at once. No privilege is needed to choose it. Elsewhere than Linux,
    or if the system refuses, the process keeps its policy.
    """
    if policy != "batch" or not hasattr(os, "SCHED_BATCH"):  # Linux only
        return "normal"
    try:
        tasks = [int(t) for t in os.listdir("/proc/self/task")]
        for task in tasks:
            os.sched_setscheduler(task, os.SCHED_BATCH, os.sched_param(0))
    except OSError as exc:
        log.warning("cannot use the batch scheduling policy", extra={"error": str(exc)})
        return "normal"
    return "batch"


def serve(settings: Settings) -> None:
    """Run until SIGTERM or SIGINT, then shut down gracefully."""
    scheduling = apply_scheduling(settings.scheduling)
    running = create_server(settings)
    log.info(
        "contextd serving",
        extra={
            "addr": settings.addr,
            "port": running.port,
            "store": "postgresql" if settings.uses_postgres else str(settings.database_path),
            "schema_version": running.store.schema_version(),
            "tls": bool(settings.tls_cert),
            "client_certificates": bool(settings.tls_client_ca),
            "scheduling": scheduling,
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
