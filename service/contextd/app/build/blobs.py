"""Base64 and binary-like blobs in message text, replaced by a stub. Pure functions.

A model reads nothing in a base64 image or a binary dump, but each costs about a token
per 1.5 to 4 characters, and cutting one in half (truncation) keeps the noise and loses
the size. So before anything is counted, every such blob in a stored message becomes
one line naming its kind, its size and the handle that fetches the whole text
(`handles.full_text_handle`); the text around it stays.

What counts as a blob:

* base64: a run of at least :data:`MIN_BASE64_CHARS` characters of the base64 alphabet
  (line breaks allowed inside; a short line at either end is text next to it), holding
  upper and lower case letters and digits, with the character entropy of encoded data
  (at least :data:`MIN_BASE64_ENTROPY` bits per character: hex, words and paths stay
  well below it). A ``data:<type>;base64,`` prefix
  names the kind; else the decoded first bytes do (PNG, JPEG, GIF, PDF, ZIP, gzip ...);
* hex: a run of at least :data:`MIN_HEX_CHARS` hex digits with no break, with the
  entropy of encoded bytes (at least :data:`MIN_HEX_ENTROPY` bits per character);
* binary: a text of at least :data:`MIN_BINARY_CHARS` characters of which at least a
  tenth are control characters (C0 other than tab and line breaks, DEL, C1) or U+FFFD
  (bytes that did not decode): the whole text is the blob.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from contextd.app.build.handles import full_text_handle
from contextd.app.build.memo import Memo
from contextd.domain.context import HistoryItem

MIN_BASE64_CHARS = 256
MIN_BASE64_ENTROPY = 4.9
MIN_HEX_CHARS = 512
MIN_HEX_ENTROPY = 3.5
MIN_BINARY_CHARS = 256

_BASE64 = re.compile(
    rf"(data:([\w.+-]+/[\w.+-]+);base64,)?([A-Za-z0-9+/=\r\n]{{{MIN_BASE64_CHARS},}})"
)
_ODD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd]")
_HEX = re.compile(rf"[0-9a-fA-F]{{{MIN_HEX_CHARS},}}")
# The base64 alphabet (with padding and line breaks) as UTF-8 bytes, each mapped to "a",
# every other byte to a space: a text holds a run of `MIN_BASE64_CHARS` such characters
# exactly when its bytes so mapped hold that many "a"s in a row (a character outside
# ASCII encodes as bytes >= 0x80, none of them in the alphabet).
_BASE64_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\r\n")
_RUN_TABLE = bytes(ord("a") if i in _BASE64_BYTES else ord(" ") for i in range(256))
_LONG_RUN = b"a" * MIN_BASE64_CHARS
# The bytes of `_ODD` below U+0080 (an ASCII text's odd characters are these alone).
_ODD_ASCII = bytes([*range(0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
_NOT_ODD_ASCII = bytes(i for i in range(256) if i not in _ODD_ASCII)
# `_may_hold_blob` stands for both patterns only while a hex blob is a base64 run too:
# hex digits are base64 characters, and the hex run is at least as long.
if MIN_HEX_CHARS < MIN_BASE64_CHARS or not set(b"0123456789abcdefABCDEF") <= _BASE64_BYTES:
    raise ImportError("blobs: a hex blob must be a base64 run too (see _may_hold_blob)")
_MAGIC = (
    (b"\x89PNG", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF8", "image/gif"),
    (b"%PDF", "application/pdf"),
    (b"PK\x03\x04", "application/zip"),
    (b"\x1f\x8b", "application/gzip"),
    (b"\x7fELF", "application/x-elf"),
    (b"RIFF", "audio/video (RIFF)"),
)


# The stubbed text of recently built messages, by (text, handle): every build of a hot
# thread sees the same newest messages again, and scanning each for blobs with the
# patterns above was a quarter of a warm build's time.
_MEMO: Memo[tuple[str, str], str] = Memo(8_192)


def _stubbed(text: str, handle: str) -> str:
    return _MEMO.get((text, handle), lambda key: replace_blobs(*key))


def stub_blobs(items: Sequence[HistoryItem]) -> tuple[list[HistoryItem], list[int]]:
    """``items`` with every blob of a stored message replaced by its stub, and the ids
    of the messages changed. Summaries (not stored messages yet) are left alone."""
    out: list[HistoryItem] = []
    changed: list[int] = []
    for item in items:
        if item.stub_memo:  # kept on a hot thread's item: it has no blob
            out.append(item)
            continue
        text = item.content if item.id > 0 and not item.is_summary else ""
        stubbed = _stubbed(text, full_text_handle(item)) if len(text) >= MIN_BASE64_CHARS else text
        if stubbed != text:
            out.append(replace(item, content=stubbed))
            changed.append(item.id)
        else:
            if item.cost_memo is not None:  # an item that keeps what builds derive
                object.__setattr__(item, "stub_memo", True)
            out.append(item)
    return out, changed


def replace_blobs(text: str, handle: str) -> str:
    """``text`` with its blobs replaced by stubs naming ``handle``, where the whole text
    is read back (`handles.full_text_handle`: a kept-aside tool output names its output,
    any other stored message ``message:<id>``)."""
    if _is_binary(text):
        return stub("binary data", len(text), len(text.encode("utf-8", "replace")), handle)
    if not _may_hold_blob(text):
        return text  # neither pattern can match: nothing to replace

    def b64(match: re.Match[str]) -> str:
        head, body, tail = _core(match.group(3))
        compact = "".join(body.split())
        if len(compact) < MIN_BASE64_CHARS or not _looks_encoded(compact):
            return match.group(0)
        kind = match.group(2) or _sniff(compact)
        size = len(compact) * 3 // 4 - compact.count("=")
        chars = len(match.group(0)) - len(head) - len(tail)
        return head + stub(f"base64 {kind}", chars, size, handle) + tail

    text = _BASE64.sub(b64, text)

    def hexdump(match: re.Match[str]) -> str:
        run = match.group(0)
        if _entropy(run.lower()) < MIN_HEX_ENTROPY:
            return run
        return stub("hex data", len(run), len(run) // 2, handle)

    return _HEX.sub(hexdump, text)


def _core(run: str) -> tuple[str, str, str]:
    """A run of base64 characters split into what surrounds the data and the data: line
    breaks at either end, and a short first or last line (a word next to the blob, not
    part of it: encoded lines are long, and a last one may be short only with padding)."""
    lines = run.split("\n")
    first, last = 0, len(lines)
    while first < last and len(lines[first].strip()) < 16:
        first += 1
    while last > first and len(lines[last - 1].strip()) < 16 and "=" not in lines[last - 1]:
        last -= 1
    head = "\n".join(lines[:first]) + ("\n" if first else "")
    tail = ("\n" if last < len(lines) else "") + "\n".join(lines[last:])
    return head, "\n".join(lines[first:last]), tail


def stub(kind: str, chars: int, size_bytes: int, handle: str) -> str:
    """The line that stands for a blob."""
    return f"[{kind}, {chars:,} chars, about {size_bytes:,} bytes, omitted; full text: {handle}]"


def _looks_encoded(s: str) -> bool:
    if not (any(c.isdigit() for c in s) and any(c.isupper() for c in s)):
        return False
    if not any(c.islower() for c in s):
        return False
    return _entropy(s) >= MIN_BASE64_ENTROPY


def _entropy(s: str) -> float:
    """Bits per character of ``s``'s character distribution."""
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values())


def _sniff(s: str) -> str:
    head = s[:24]
    try:
        raw = base64.b64decode(head[: len(head) // 4 * 4], validate=True)
    except (binascii.Error, ValueError):
        return "data"
    for magic, kind in _MAGIC:
        if raw.startswith(magic):
            return kind
    return "data"


def _may_hold_blob(text: str) -> bool:
    """Whether `text` holds a run of `MIN_BASE64_CHARS` base64 characters, which every
    match of `_BASE64` and of `_HEX` is: when it does not, neither can match. Why not the
    patterns alone: a regular expression tries a class run at every position, about 50
    ns a character (a build's scan of a new 500-character message took 25 us, a 6,000-
    character one 0.3 ms); mapping the bytes and searching a run of one byte are C loops
    over the text (2 to 6 us)."""
    return _LONG_RUN in text.encode("utf-8", "surrogatepass").translate(_RUN_TABLE)


def _is_binary(text: str) -> bool:
    if len(text) < MIN_BINARY_CHARS:
        return False
    if text.isascii():  # the odd characters counted by deleting the others (a C loop)
        odd = len(text.encode("ascii").translate(None, _NOT_ODD_ASCII))
    else:
        odd = len(_ODD.findall(text))
    return odd * 10 >= len(text)
