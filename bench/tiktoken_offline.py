"""Load tiktoken's encodings without a network, the way tests/core_reference.py does.

tiktoken downloads ``*.tiktoken`` files on first use; CI and this machine have no general
internet. The ``bpe-openai`` crate that the Rust core is built against ships OpenAI's
original files (gzipped) and cargo has unpacked it to build the core, so we copy them into
a private tiktoken cache (file name = sha1 of the download URL). tiktoken verifies each
file's SHA-256, so a wrong file fails loudly instead of giving a wrong baseline.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
CACHE = Path(tempfile.gettempdir()) / "contextd-tiktoken-cache"


def _bpe_openai_data_dir() -> Path | None:
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
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
    names = ("o200k_base", "cl100k_base")
    keys = {n: hashlib.sha1(TIKTOKEN_URL.format(name=n).encode()).hexdigest() for n in names}
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


@functools.cache
def encoding(name: str) -> Any:
    """``tiktoken.get_encoding(name)`` from the offline cache (downloading as a last resort).

    Raises ``RuntimeError`` when it cannot be loaded: the counting benchmark is meaningless
    without its baseline, so it should say so rather than skip silently.
    """
    import tiktoken

    cache = _fill_cache()
    if cache is not None:
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(cache))
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:
        raise RuntimeError(
            f"tiktoken cannot load {name!r} offline (no bpe-openai crate data found via "
            "`cargo metadata --offline`) and the download failed"
        ) from exc
