"""Server settings, from flags with environment variables as defaults.

Every serve option has an environment variable (CONTEXTD_*) so a process manager can
configure the server without flags; a flag, when given, wins. (`max_group_rows`, the
writer's group-commit limit, and `delete_chunk_rows`, how many messages of a deleted agent
one writer job removes, are tuning knobs for tests and benchmarks, not options.)
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ADDR = "127.0.0.1:50051"
DEFAULT_DATA_DIR = "./data"
DATABASE_FILE = "contextd.duckdb"
POSTGRES_SCHEMES = ("postgres://", "postgresql://")


@dataclass(frozen=True, slots=True)
class Settings:
    addr: str = DEFAULT_ADDR
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    max_message_bytes: int = 1 << 20
    max_batch_messages: int = 10_000
    snapshot_max_messages: int = 10_000
    snapshot_max_bytes: int = 16 << 20
    max_group_rows: int = 50_000
    delete_chunk_rows: int = 5_000
    workers: int = 32
    # Handler threads of AppendMessages alone (0: it shares `workers`); see
    # api/server.py, on_pool.
    append_workers: int = 32
    # Linux scheduling policy of the server's threads (api/server.py, apply_scheduling).
    scheduling: str = "batch"
    grace_seconds: float = 10.0
    write_timeout_seconds: float = 30.0
    # DuckDB's memory_limit, e.g. "2GB" ("": DuckDB's own, 80% of RAM); the default keeps
    # an import's resident set flat (adapters/duckdb/store.py, DEFAULT_MEMORY_LIMIT).
    store_memory_limit: str = "128MB"
    # DuckDB's checkpoint_threshold: the WAL size at which a commit also checkpoints (the
    # writer checkpoints sooner when idle; adapters/duckdb/checkpoints.py).
    store_checkpoint_threshold: str = "256MB"
    log_level: str = "INFO"
    log_format: str = "json"
    summary_model: str = "claude-haiku-4-5"
    summary_max_tokens: int = 2048
    summary_timeout_seconds: float = 30.0
    anthropic_base_url: str | None = None
    # "" (or "duckdb"): the embedded DuckDB file in data_dir; a postgres:// or
    # postgresql:// URL: a PostgreSQL database shared by any number of replicas.
    store: str = ""
    store_pool_size: int = 16
    # TLS: PEM files of the server's certificate chain and key (both or neither); with a
    # client CA, clients must present a certificate it signed (mutual TLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Serve without API keys on a non-loopback address (anyone who can reach it is the
    # tenant "default" with every role): only behind something that authenticates.
    insecure: bool = False
    # Most calls a second per tenant on this server (0: no limit).
    tenant_max_rps: float = 0.0
    # How often the retention sweep runs (seconds; 0: never). See app/retention.py.
    sweep_interval_seconds: float = 60.0
    # Tool outputs: results up to this size stay in the pointer's row; above the second
    # they are compressed; the third is the largest a stream may carry.
    tool_output_inline_bytes: int = 32 << 10
    tool_output_compress_bytes: int = 64 << 10
    tool_output_max_bytes: int = 1 << 30
    # Most bytes one tenant stores, messages and snapshots (0: no limit).
    tenant_max_bytes: int = 0
    # Memory of the DuckDB engine's hot cache of what builds read (0: off).
    hot_cache_bytes: int = 256 << 20

    @property
    def uses_postgres(self) -> bool:
        return self.store.startswith(POSTGRES_SCHEMES)

    @property
    def database_path(self) -> Path:
        return self.data_dir / DATABASE_FILE


# Each served setting: its help. The flag is --name-with-dashes, the environment
# variable CONTEXTD_NAME, the type and default those of the Settings field.
_SERVE_OPTIONS: dict[str, str] = {
    "addr": "host:port to listen on",
    "store": "where contexts are kept: unset (or duckdb) for the embedded DuckDB file in "
    "--data-dir, or a postgresql://user@host:port/db URL shared by several replicas",
    "store_pool_size": "most PostgreSQL connections this server opens (PostgreSQL only)",
    "tls_cert": "PEM file of the server's certificate chain: serve gRPC over TLS (with --tls-key)",
    "tls_key": "PEM file of the server's private key (with --tls-cert)",
    "tls_client_ca": "PEM file of the CA that signs client certificates: require them (mutual "
    "TLS; needs --tls-cert and --tls-key)",
    "data_dir": "directory of the DuckDB file and of snapshot documents",
    "max_message_bytes": "largest message accepted, content + tool_calls + metadata",
    "max_batch_messages": "most messages in one AppendMessages call",
    "snapshot_max_messages": "most messages a SaveSnapshot keeps (more is RESOURCE_EXHAUSTED)",
    "snapshot_max_bytes": "most bytes (content + tool_calls + metadata) a SaveSnapshot keeps "
    "(more is RESOURCE_EXHAUSTED)",
    "workers": "gRPC handler threads (every method but AppendMessages, see --append-workers)",
    "append_workers": "gRPC handler threads that serve AppendMessages, apart from --workers "
    "so appends and reads never wait for each other's threads (0: AppendMessages shares "
    "--workers)",
    "scheduling": "Linux scheduling policy of the server's threads: batch (a thread woken "
    "by another waits for the running one's turn to end instead of preempting it: many "
    "small calls then cost less CPU, as a running thread that holds Python's lock is not "
    "put aside) or normal (the system's default)",
    "grace_seconds": "how long shutdown waits for calls in flight",
    "write_timeout_seconds": "how long a call waits for the store's writer before it is "
    "answered UNAVAILABLE (STORE_BUSY)",
    "store_memory_limit": "DuckDB's memory limit, e.g. 2GB (empty: DuckDB's own default, 80%% "
    "of the machine's memory); a call that needs more is answered RESOURCE_EXHAUSTED",
    "store_checkpoint_threshold": "WAL size at which a DuckDB commit also checkpoints, e.g. "
    "256MB (the writer checkpoints a smaller WAL whenever it is idle); larger: fewer stalls "
    "under a sustained import, longer replay after a crash",
    "insecure": "allow serving without API keys on a non-loopback address (every caller is "
    "the default tenant, with every role)",
    "tenant_max_rps": "most calls per second of one tenant on this server, in bursts of as "
    "many (0: no limit); beyond it RESOURCE_EXHAUSTED (TENANT_RATE_LIMITED) with a retry delay",
    "sweep_interval_seconds": "how often the retention sweep deletes what agents' retention "
    "policies let go (expired contexts, overflow), in small chunks (0: never; on PostgreSQL "
    "one replica sweeps at a time)",
    "tool_output_inline_bytes": "tool outputs up to this many bytes are kept in their "
    "pointer's row (at most 1 MiB); larger ones are stored in 1 MiB chunks",
    "tool_output_compress_bytes": "stored tool outputs over this many bytes are compressed (zstd)",
    "tool_output_max_bytes": "largest tool output a StreamPutToolOutput may store",
    "tenant_max_bytes": "most bytes one tenant stores: content + tool_calls + metadata of its "
    "messages, and its snapshots (0: no limit); a write that would pass it is "
    "RESOURCE_EXHAUSTED (TENANT_STORAGE_EXHAUSTED)",
    "hot_cache_bytes": "most bytes of memory the DuckDB engine keeps of what builds read "
    "(threads' columns and recent content, agents, status), least recently used out first "
    "(0: off; every build then reads by SQL)",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "json lines or plain text",
    "summary_model": "Anthropic model that writes compaction summaries (the API key is read "
    "from ANTHROPIC_API_KEY)",
    "summary_max_tokens": "max_tokens of a summary",
    "summary_timeout_seconds": "how long a summary may take before the extractive fallback is used",
    "anthropic_base_url": "Anthropic API base URL (unset: the SDK's, which also honours "
    "ANTHROPIC_BASE_URL)",
}
_CHOICES = {
    "log_format": ["json", "text"],
    "log_level": ["DEBUG", "INFO", "WARNING", "ERROR"],
    "scheduling": ["batch", "normal"],
}
_MEMORY_SIZE = re.compile(r"\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)", re.IGNORECASE)
# Numbers must be above zero, except these, which may be zero.
_MAY_BE_ZERO = {
    "append_workers",
    "grace_seconds",
    "tenant_max_rps",
    "sweep_interval_seconds",
    "tenant_max_bytes",
    "hot_cache_bytes",
}


def _number(kind: type[int] | type[float], name: str) -> Callable[[str], int | float]:
    """argparse type of a numeric option: a bad or out-of-range value is reported by
    argparse like any bad flag, never as a traceback at start-up."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if value < 0 or (value == 0 and name not in _MAY_BE_ZERO):
            raise argparse.ArgumentTypeError(
                f"{text!r} must be {'zero or more' if name in _MAY_BE_ZERO else 'above zero'}"
            )
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _memory_size(text: str) -> str:
    """argparse type of the memory limit: a size DuckDB understands ("" for its default),
    checked here so that a typo is a one-line start-up error, not a DuckDB traceback."""
    text = text.strip()
    if text and not _MEMORY_SIZE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a size like 512MB or 2GB")
    return text


_memory_size.__name__ = "size"


def _store_url(text: str) -> str:
    """argparse type of --store: the embedded engine or a PostgreSQL URL, checked at
    start-up so a typo is one line, not a driver traceback."""
    text = text.strip()
    if text in ("", "duckdb"):
        return ""
    if not text.startswith(POSTGRES_SCHEMES):
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is neither duckdb nor a postgresql:// URL")
    return text


_store_url.__name__ = "store"


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    for name, help_text in _SERVE_OPTIONS.items():
        env = f"CONTEXTD_{name.upper()}"
        default = getattr(defaults, name)
        kind: Callable[[str], object] = str
        if isinstance(default, bool):
            parser.add_argument(
                f"--{name.replace('_', '-')}",
                action="store_true",
                default=os.environ.get(env, "").lower() in ("1", "true", "yes"),
                help=f"{help_text} (env {env}=1)",
            )
            continue
        if name == "log_level":
            kind = str.upper
        elif name in ("store_memory_limit", "store_checkpoint_threshold"):
            kind = _memory_size
        elif name == "store":
            kind = _store_url
        elif isinstance(default, int | float):
            kind = _number(type(default), name)
        # A string default goes through `type`, so a bad environment value is reported
        # by argparse like a bad flag, not as a traceback.
        raw = os.environ.get(env, None if default is None else str(default))
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=raw,
            choices=_CHOICES.get(name),
            help=f"{help_text} (env {env}; default %(default)s)",
        )


def settings_from_args(args: argparse.Namespace) -> Settings:
    values = {name: getattr(args, name) for name in _SERVE_OPTIONS}
    values["data_dir"] = Path(values["data_dir"])
    return Settings(**values)
