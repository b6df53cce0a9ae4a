"""Server settings, from flags with environment variables as defaults.

Every setting has an environment variable (CONTEXTD_*) so a process manager can configure
the server without flags; a flag, when given, wins.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ADDR = "127.0.0.1:50051"
DEFAULT_DATA_DIR = "./data"
DATABASE_FILE = "contextd.duckdb"


@dataclass(frozen=True, slots=True)
class Settings:
    addr: str = DEFAULT_ADDR
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    max_message_bytes: int = 1 << 20
    max_batch_messages: int = 10_000
    max_group_rows: int = 50_000
    workers: int = 32
    grace_seconds: float = 10.0
    log_level: str = "INFO"
    log_format: str = "json"
    summary_model: str = "claude-haiku-4-5"
    summary_max_tokens: int = 2048
    summary_timeout_seconds: float = 30.0
    anthropic_base_url: str | None = None

    @property
    def database_path(self) -> Path:
        return self.data_dir / DATABASE_FILE


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = Settings()
    parser.add_argument(
        "--addr",
        default=_env("CONTEXTD_ADDR", d.addr),
        help="host:port to listen on (env CONTEXTD_ADDR; default %(default)s)",
    )
    parser.add_argument(
        "--data-dir",
        default=_env("CONTEXTD_DATA_DIR", str(d.data_dir)),
        help="directory of the DuckDB file (env CONTEXTD_DATA_DIR; default %(default)s)",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=int(_env("CONTEXTD_MAX_MESSAGE_BYTES", str(d.max_message_bytes))),
        help="largest message accepted, content + tool_calls + metadata "
        "(env CONTEXTD_MAX_MESSAGE_BYTES; default %(default)s)",
    )
    parser.add_argument(
        "--max-batch-messages",
        type=int,
        default=int(_env("CONTEXTD_MAX_BATCH_MESSAGES", str(d.max_batch_messages))),
        help="most messages in one AppendMessages call "
        "(env CONTEXTD_MAX_BATCH_MESSAGES; default %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=int(_env("CONTEXTD_WORKERS", str(d.workers))),
        help="gRPC handler threads (env CONTEXTD_WORKERS; default %(default)s)",
    )
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=float(_env("CONTEXTD_GRACE_SECONDS", str(d.grace_seconds))),
        help="how long shutdown waits for calls in flight "
        "(env CONTEXTD_GRACE_SECONDS; default %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default=_env("CONTEXTD_LOG_LEVEL", d.log_level),
        help="DEBUG, INFO, WARNING or ERROR (env CONTEXTD_LOG_LEVEL; default %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        choices=["json", "text"],
        default=_env("CONTEXTD_LOG_FORMAT", d.log_format),
        help="json lines or plain text (env CONTEXTD_LOG_FORMAT; default %(default)s)",
    )

    parser.add_argument(
        "--summary-model",
        default=_env("CONTEXTD_SUMMARY_MODEL", d.summary_model),
        help="Anthropic model that writes compaction summaries "
        "(env CONTEXTD_SUMMARY_MODEL; default %(default)s); the API key is "
        "read from ANTHROPIC_API_KEY",
    )
    parser.add_argument(
        "--summary-max-tokens",
        type=int,
        default=int(_env("CONTEXTD_SUMMARY_MAX_TOKENS", str(d.summary_max_tokens))),
        help="max_tokens of a summary (env CONTEXTD_SUMMARY_MAX_TOKENS; default %(default)s)",
    )
    parser.add_argument(
        "--summary-timeout-seconds",
        type=float,
        default=float(_env("CONTEXTD_SUMMARY_TIMEOUT_SECONDS", str(d.summary_timeout_seconds))),
        help="how long a summary may take before the extractive fallback "
        "is used (env CONTEXTD_SUMMARY_TIMEOUT_SECONDS; default %(default)s)",
    )
    parser.add_argument(
        "--anthropic-base-url",
        default=os.environ.get("CONTEXTD_ANTHROPIC_BASE_URL"),
        help="Anthropic API base URL (env CONTEXTD_ANTHROPIC_BASE_URL; "
        "default: the SDK's, which also honours ANTHROPIC_BASE_URL)",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings(
        addr=args.addr,
        data_dir=Path(args.data_dir),
        max_message_bytes=args.max_message_bytes,
        max_batch_messages=args.max_batch_messages,
        workers=args.workers,
        grace_seconds=args.grace_seconds,
        log_level=args.log_level.upper(),
        log_format=args.log_format,
        summary_model=args.summary_model,
        summary_max_tokens=args.summary_max_tokens,
        summary_timeout_seconds=args.summary_timeout_seconds,
        anthropic_base_url=args.anthropic_base_url,
    )
