"""Files the embedded engine keeps beside its database file (snapshot documents, tool
output results): made durable before the row that names them commits, and swept at open
when no row names them (what a crash between the two leaves)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stray_files(
    data_dir: Path, root: Path, is_stray: Callable[[Path, str], bool], what: str
) -> int:
    """Remove the files `root/*/*` for which `is_stray(path, path relative to data_dir)`
    holds; a file that cannot be removed is logged and left for the next start. Returns
    how many were removed."""
    if not root.is_dir():
        return 0
    removed = 0
    for path in root.glob("*/*"):
        relative = path.relative_to(data_dir).as_posix()
        if path.is_file() and is_stray(path, relative):
            try:
                path.unlink()
                removed += 1
            except OSError as exc:
                log.warning(
                    f"removing a stray {what} failed",
                    extra={"path": relative, "detail": str(exc)[:300]},
                )
    if removed:
        log.info(f"removed {what}s no row names", extra={"files": removed})
    return removed
