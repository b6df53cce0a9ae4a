"""The embedded engine's signing key of page tokens: a file in the data directory."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

KEY_FILE = "page_token.key"


def load_or_create_key(data_dir: Path) -> bytes:
    """The signing key of this data directory, created on first use (0600, atomic)."""
    path = data_dir / KEY_FILE
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    data_dir.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(32))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(temporary, path)  # fails if another process created the key first
    except FileExistsError:
        pass
    finally:
        temporary.unlink()
    return path.read_bytes()
