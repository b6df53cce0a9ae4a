"""Reading stored tool outputs without use-case state: ranges, excerpts and relevance
ranking over the store's ports. The tool output use cases (app/tool_outputs.py) and a
build's excerpts (app/build/excerpts.py) both read through here."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from contextd import core
from contextd.app.relevance_cache import indexes_of
from contextd.domain.limits import (
    EXCERPT_PASSAGE_CHARS,
    MAX_EXCERPT_SCAN_BYTES,
    MAX_RELEVANCE_CANDIDATES,
    TOOL_OUTPUT_CHUNK_BYTES,
)
from contextd.domain.tool_outputs import ToolOutputFilter, ToolOutputKind, ToolOutputPointer
from contextd.ports.tool_outputs import ToolOutputStore

CHUNK = TOOL_OUTPUT_CHUNK_BYTES


@dataclass(frozen=True, slots=True)
class Excerpt:
    output_id: str
    offset: int
    length: int
    text: str
    part: str  # "whole", "head", "match" or "tail"


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _align(data: bytes, i: int) -> int:
    """`i` moved forward past UTF-8 continuation bytes (a character's start)."""
    while 0 < i < len(data) and (data[i] & 0xC0) == 0x80:
        i += 1
    return i


class ResultReader:
    """Reads parts of stored results: ranges and excerpts. It holds nothing but the
    store, so a build (app/build/excerpts.py) reads excerpts the way
    SelectRelevantToolOutputs does."""

    def __init__(self, store: ToolOutputStore) -> None:
        self._store = store

    def read_range(self, pointer: ToolOutputPointer, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the result (shorter at its end)."""
        end = min(pointer.size_bytes, offset + length)
        if end <= offset:
            return b""
        first, last = offset // CHUNK, (end - 1) // CHUNK
        chunks = self._store.read_tool_output_chunks(pointer, first, last - first + 1)
        data = b"".join(chunks)
        return data[offset - first * CHUNK : end - first * CHUNK]

    def excerpts(self, pointer: ToolOutputPointer, query: str, budget_tokens: int) -> list[Excerpt]:
        """Parts of a result within about `budget_tokens` tokens: the whole result when it
        fits; else its head, the passages that best match `query` and its tail, in result
        order. Looks for matches in at most MAX_EXCERPT_SCAN_BYTES after the head."""
        if budget_tokens <= 0 or pointer.kind == ToolOutputKind.BINARY:
            return []
        budget = 4 * budget_tokens  # characters, about bytes for mostly-ASCII text
        size = pointer.size_bytes
        if size <= budget:
            data = self.read_range(pointer, 0, size)
            return [Excerpt(pointer.id, 0, size, _text(data), "whole")]
        quarter = budget // 4
        head = self.read_range(pointer, 0, quarter)
        head_end = _align(head, len(head) - 1) if len(head) < size else len(head)
        cut = head.rfind(b"\n", 0, head_end)
        head_end = cut + 1 if cut > quarter // 2 else _last_char_start(head, head_end)
        tail_start = max(head_end, size - quarter)
        tail = self.read_range(pointer, tail_start, size - tail_start)
        skip = _align(tail, 0)
        newline = tail.find(b"\n", 0, len(tail) // 2)
        skip = newline + 1 if newline >= 0 else skip
        tail, tail_start = tail[skip:], tail_start + skip
        parts = [Excerpt(pointer.id, 0, head_end, _text(head[:head_end]), "head")]
        room = budget - head_end - len(tail)
        middle_end = min(tail_start, head_end + MAX_EXCERPT_SCAN_BYTES)
        if room > 0 and middle_end > head_end:
            parts += self._matching_passages(pointer, query, head_end, middle_end, room)
        parts.append(Excerpt(pointer.id, tail_start, len(tail), _text(tail), "tail"))
        return sorted(parts, key=lambda e: e.offset)

    def _range_pieces(self, pointer: ToolOutputPointer, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of the result, one stored chunk read at a time."""
        index = start // CHUNK
        while start < end:
            chunks = self._store.read_tool_output_chunks(pointer, index, 1)
            if not chunks:
                return
            base = index * CHUNK
            yield chunks[0][start - base : end - base]
            index += 1
            start = base + CHUNK

    def _matching_passages(
        self, pointer: ToolOutputPointer, query: str, start: int, end: int, room: int
    ) -> list[Excerpt]:
        """The passages of [start, end) that best match `query` (BM25 over passages of
        about EXCERPT_PASSAGE_CHARS bytes cut at line breaks) within `room` bytes."""
        offsets: list[int] = []
        texts: list[str] = []
        pending = bytearray()
        position = start  # the offset of pending[0]
        for data in self._range_pieces(pointer, start, end):
            pending += data
            while len(pending) >= 2 * EXCERPT_PASSAGE_CHARS:
                stop = _passage_end(pending)
                offsets.append(position)
                texts.append(_text(bytes(pending[:stop])))
                del pending[:stop]
                position += stop
        if pending:
            offsets.append(position)
            texts.append(_text(bytes(pending)))
        index = core.Bm25Index()
        index.add(list(range(len(texts))), texts)
        ids, _scores = index.search(query, min(len(texts), 64))
        chosen: list[Excerpt] = []
        for i in ids:
            text = texts[i]
            length = len(text.encode("utf-8", "replace"))
            if length > room:
                continue
            room -= length
            chosen.append(Excerpt(pointer.id, offsets[i], length, text, "match"))
        return chosen


def _passage_end(data: bytearray) -> int:
    """Where the passage at the start of `data` ends: after its last line break within
    EXCERPT_PASSAGE_CHARS bytes, else there (at a character's start)."""
    cut = data.rfind(b"\n", 0, EXCERPT_PASSAGE_CHARS)
    if cut >= EXCERPT_PASSAGE_CHARS // 2:
        return cut + 1
    return max(1, _last_char_start(bytes(data[: EXCERPT_PASSAGE_CHARS + 1]), EXCERPT_PASSAGE_CHARS))


def _last_char_start(data: bytes, i: int) -> int:
    """`i` moved back to a character's start."""
    while 0 < i < len(data) and (data[i] & 0xC0) == 0x80:
        i -= 1
    return i


def ranked_outputs(
    store: ToolOutputStore, where: ToolOutputFilter, query: str, k: int, keyword: bool = False
) -> tuple[list[tuple[ToolOutputPointer, float]], int]:
    """The best k outputs of the filter for `query` that match at all, highest first,
    and how many outputs were ranked: BM25 over the scope's cached index (see
    app/relevance_cache.py); the keyword scorer, and a scope too large to cache, rank the
    filter's newest MAX_RELEVANCE_CANDIDATES."""
    if not keyword:
        # The cached index holds the whole scope, outputs of expired contexts included
        # (it cannot tell them apart); those are left out here, and while they took some
        # of the k places the index is asked again for twice as many.
        wanted = k
        while True:
            found = indexes_of(store).search(store, where, query, wanted)
            if found is None:
                break
            hits, ranked = found
            pointers = {
                p.id: p
                for p in store.find_tool_outputs(
                    where.tenant,
                    where.agent,
                    where.scope,
                    [i for i, _ in hits],
                    where.expired_through_us,
                )
            }
            kept = [(pointers[i], s) for i, s in hits if i in pointers]
            if len(kept) >= k or len(hits) < wanted or wanted >= ranked:
                return kept[:k], ranked
            wanted *= 2
    candidates = store.tool_output_index(where, MAX_RELEVANCE_CANDIDATES)
    return rank(query, candidates, k, keyword), len(candidates)


def rank(
    query: str, candidates: list[tuple[ToolOutputPointer, str]], k: int, keyword: bool
) -> list[tuple[ToolOutputPointer, float]]:
    """The best k candidates for `query`, highest score first (ties: older first), only
    those that match at all. BM25 over each candidate's index text, or keyword overlap
    with its tool description."""
    if not candidates:
        return []
    if keyword:
        scores = core.keyword_scores(query, [p.tool_description for p, _ in candidates])
        order = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: (-scores[i], i))
        return [(candidates[i][0], float(scores[i])) for i in order[:k]]
    index = core.Bm25Index()
    index.add(list(range(len(candidates))), [text for _, text in candidates])
    ids, values = index.search(query, k)
    return [(candidates[i][0], float(s)) for i, s in zip(ids, values, strict=True) if s > 0]
