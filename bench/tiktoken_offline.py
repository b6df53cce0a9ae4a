"""Load tiktoken's encodings without a network (used by the benchmarks and the tests).

tiktoken downloads ``*.tiktoken`` files on first use; CI and this machine have no general
internet. The ``bpe-openai`` crate that the Rust core is built against ships OpenAI's
original files (gzipped) and cargo has unpacked it to build the core, so we copy them into
a private tiktoken cache (file name = sha1 of the download URL) and point tiktoken at it
while it loads. tiktoken verifies each file's SHA-256, so a wrong file fails loudly
instead of giving a wrong baseline.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
CACHE = Path(tempfile.gettempdir()) / "contextd-tiktoken-cache"
NAMES = ("o200k_base", "cl100k_base")


def _cargo() -> str | None:
    """``cargo`` on PATH, else rustup's default ``~/.cargo/bin/cargo``."""
    found = shutil.which("cargo")
    if found is not None:
        return found
    fallback = Path.home() / ".cargo" / "bin" / "cargo"
    return str(fallback) if fallback.is_file() else None


def _bpe_openai_data_dir() -> Path | None:
    """The ``data/`` folder of the ``bpe-openai`` crate the Rust core builds against."""
    cargo = _cargo()
    if cargo is None:
        return None
    try:
        out = subprocess.run(
            [
                cargo,
                "metadata",
                "--offline",
                "--format-version",
                "1",
                "--manifest-path",
                str(REPO / "rust_core" / "Cargo.toml"),
            ],
            capture_output=True,
            check=True,
            text=True,
            timeout=120,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for package in json.loads(out)["packages"]:
        if package["name"] == "bpe-openai":
            data = Path(package["manifest_path"]).parent / "data"
            if data.is_dir():
                return data
    return None


@functools.cache
def _fill_cache() -> Path | None:
    """Put the encodings where tiktoken's cache looks; ``None`` if no offline copy exists."""
    keys = {n: hashlib.sha1(TIKTOKEN_URL.format(name=n).encode()).hexdigest() for n in NAMES}
    if all((CACHE / k).exists() for k in keys.values()):
        return CACHE
    data = _bpe_openai_data_dir()
    if data is None:
        return None
    CACHE.mkdir(parents=True, exist_ok=True)
    for name, key in keys.items():
        target = CACHE / key
        if not target.exists():
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(gzip.decompress((data / f"{name}.tiktoken.gz").read_bytes()))
            tmp.replace(target)
    return CACHE


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Set an environment variable for the duration of the block, then restore it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@functools.cache
def encoding(name: str) -> Any:
    """``tiktoken.get_encoding(name)`` from the offline cache (downloading as a last resort).

    Raises ``RuntimeError`` when tiktoken is not installed or the encoding cannot be
    loaded: the counting benchmark is meaningless without its baseline, so it says so
    rather than skip silently (the tests turn it into a skip).
    """
    try:
        import tiktoken
    except ImportError as exc:
        raise RuntimeError("tiktoken is not installed") from exc

    cache = _fill_cache()
    try:
        if cache is None:
            return tiktoken.get_encoding(name)
        with _env("TIKTOKEN_CACHE_DIR", str(cache)):
            return tiktoken.get_encoding(name)
    except Exception as exc:
        raise RuntimeError(
            f"tiktoken cannot load {name!r}: "
            + (
                "the offline copy was rejected"
                if cache is not None
                else "no bpe-openai crate data found via `cargo metadata --offline`"
            )
            + " and the download failed"
        ) from exc
