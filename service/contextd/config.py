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


# Each served setting: its help. The flag is --name-with-dashes, the environment
# variable CONTEXTD_NAME, the type and default those of the Settings field.
_SERVE_OPTIONS: dict[str, str] = {
    "addr": "host:port to listen on",
    "data_dir": "directory of the DuckDB file",
    "max_message_bytes": "largest message accepted, content + tool_calls + metadata",
    "max_batch_messages": "most messages in one AppendMessages call",
    "workers": "gRPC handler threads",
    "grace_seconds": "how long shutdown waits for calls in flight",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "log_format": "json lines or plain text",
    "summary_model": "Anthropic model that writes compaction summaries (the API key is read "
    "from ANTHROPIC_API_KEY)",
    "summary_max_tokens": "max_tokens of a summary",
    "summary_timeout_seconds": "how long a summary may take before the extractive fallback is used",
    "anthropic_base_url": "Anthropic API base URL (unset: the SDK's, which also honours "
    "ANTHROPIC_BASE_URL)",
}
_CHOICES = {"log_format": ["json", "text"]}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings()
    for name, help_text in _SERVE_OPTIONS.items():
        env = f"CONTEXTD_{name.upper()}"
        default = getattr(defaults, name)
        kind = type(default) if isinstance(default, int | float) else str
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
    values["log_level"] = values["log_level"].upper()
    return Settings(**values)
