"""Stored chunks: each raw chunk compressed on its own (zstd) when the result is over the
compression threshold, so any chunk can be read without the ones before it."""

from __future__ import annotations

import threading

import zstandard

from contextd.domain.errors import DataLoss
from contextd.domain.limits import TOOL_OUTPUT_CHUNK_BYTES

# zstd level 3: the library's default, fast enough to compress at disk speed.
_LEVEL = 3
_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    found: zstandard.ZstdCompressor | None = getattr(_local, "c", None)
    if found is None:
        found = _local.c = zstandard.ZstdCompressor(level=_LEVEL)
    return found


def _decompressor() -> zstandard.ZstdDecompressor:
    found: zstandard.ZstdDecompressor | None = getattr(_local, "d", None)
    if found is None:
        found = _local.d = zstandard.ZstdDecompressor()
    return found


def encode_chunk(raw: bytes, compress: bool) -> bytes:
    return _compressor().compress(raw) if compress else raw


def decode_chunk(stored: bytes, compressed: bool, output_id: str) -> bytes:
    if not compressed:
        return stored
    try:
        return _decompressor().decompress(stored, max_output_size=TOOL_OUTPUT_CHUNK_BYTES)
    except zstandard.ZstdError as exc:
        raise unreadable(output_id, "a chunk does not decompress") from exc


def unreadable(output_id: str, why: str) -> DataLoss:
    return DataLoss(
        f"the stored result of tool output {output_id!r} is unreadable ({why}); restore it "
        "from a backup or delete the output",
        reason="TOOL_OUTPUT_UNREADABLE",
    )
