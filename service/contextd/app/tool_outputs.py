"""Tool outputs kept aside: store, list, load, read, grep, delete, rank, excerpt.

Results are handled a chunk at a time (TOOL_OUTPUT_CHUNK_BYTES): a put re-chunks what
the client sends, hashes and classifies it on the way and hands each chunk to the
store's blob port; every read asks the store for the chunks it needs and no more. So no
call holds a large result whole, and each call's work is bounded by domain/limits.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from contextd.app.base import UseCases
from contextd.app.paging import page_size
from contextd.app.tool_output_reads import (
    Excerpt,
    ResultReader,
    _text,
    ranked_outputs,
)
from contextd.domain.context import ToolCall, parse_tool_calls
from contextd.domain.errors import InvalidArgument
from contextd.domain.idempotency import RequestRecord
from contextd.domain.limits import (
    DEFAULT_GREP_MATCHES,
    DEFAULT_READ_BYTES,
    DEFAULT_RELEVANT_K,
    INDEX_HEAD_CHARS,
    INDEX_TAIL_CHARS,
    MAX_EXCERPT_TOKENS,
    MAX_GREP_CONTEXT_LINES,
    MAX_GREP_LINE_CHARS,
    MAX_GREP_MATCHES,
    MAX_GREP_PATTERN_CHARS,
    MAX_GREP_SCAN_BYTES,
    MAX_READ_BYTES,
    MAX_RELEVANT_K,
    MAX_TOOL_ARGS_BYTES,
    MAX_TOOL_NAME_CHARS,
    PREVIEW_HEAD_CHARS,
    PREVIEW_TAIL_CHARS,
    TOOL_OUTPUT_CHUNK_BYTES,
    ToolOutputLimits,
)
from contextd.domain.model import ContextKey, NewMessage, Page, Role
from contextd.domain.tool_outputs import (
    KindSniffer,
    NewToolOutput,
    ToolOutputFilter,
    ToolOutputKind,
    ToolOutputPointer,
    check_filter,
    check_new_output,
    check_output_id,
    check_output_ids,
    check_query,
    new_output_id,
    output_key,
    preview_text,
    too_large,
    tool_output_handle,
    tool_output_not_found,
    with_tool_output,
)
from contextd.ports.tool_outputs import BlobUpload

CHUNK = TOOL_OUTPUT_CHUNK_BYTES
# A tool name an output can be stored under (domain/tool_outputs.py's rule).
_TOOL_NAME = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_TOOL_NAME_CHARS}}}")
# A line longer than this is cut into pieces by grep (a result without line breaks must
# not become one line held whole).
_MAX_GREP_LINE_BYTES = 1 << 20

RecordFor = Callable[[str], RequestRecord | None]
"""The request record of a put, given the SHA-256 of its result (a retry must send the
same bytes), or None without a request id."""


@dataclass(frozen=True, slots=True)
class Relevant:
    pointer: ToolOutputPointer
    score: float
    excerpts: tuple[Excerpt, ...]


@dataclass(frozen=True, slots=True)
class GrepMatch:
    line_number: int
    offset: int
    line: str
    before: tuple[str, ...]
    after: list[str]


@dataclass(frozen=True, slots=True)
class GrepResult:
    matches: list[GrepMatch]
    next_offset: int
    next_line_number: int
    scanned_bytes: int


def _chars(data: bytes) -> int:
    """Unicode code points in UTF-8 bytes: the bytes that are not continuation bytes."""
    if not data:
        return 0
    array = np.frombuffer(data, dtype=np.uint8)
    return int(np.count_nonzero((array & 0xC0) != 0x80))


class _Intake:
    """What a put learns from a result on its way through, without keeping it."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self.size = 0
        self.chars = 0
        self.sniffer = KindSniffer()
        self.head = bytearray()
        self.tail = bytearray()

    def feed(self, data: bytes) -> None:
        self.sha.update(data)
        self.size += len(data)
        self.chars += _chars(data)
        self.sniffer.feed(data)
        room = 4 * INDEX_HEAD_CHARS - len(self.head)
        if room > 0:
            self.head += data[:room]
        self.tail += data[-4 * INDEX_TAIL_CHARS :]
        if len(self.tail) > 4 * INDEX_TAIL_CHARS:
            del self.tail[: len(self.tail) - 4 * INDEX_TAIL_CHARS]

    def result_text(self, kind: ToolOutputKind) -> str:
        """What of the result ranking indexes: its first and last characters."""
        if kind == ToolOutputKind.BINARY:
            return ""
        # A NUL past the first 64 KiB leaves a result text: the index text drops it (a
        # PostgreSQL text column cannot hold one; it is no word to rank anyway).
        head = bytes(self.head).decode("utf-8", "ignore")[:INDEX_HEAD_CHARS]
        if self.size <= len(self.head):
            return head.replace("\x00", " ")
        tail = bytes(self.tail).decode("utf-8", "ignore")[-INDEX_TAIL_CHARS:]
        return f"{head}\n{tail}".replace("\x00", " ")


class ToolOutputCalls(UseCases):
    """Tool outputs (see proto/contextd/v1/tool_output_service.proto)."""

    # The server's settings (api/server.py sets them from config.py).
    tool_output_limits: ToolOutputLimits = ToolOutputLimits()

    # ------------------------------------------------------------------ appends

    def keep_tool_results_aside(
        self, key: ContextKey, messages: Sequence[NewMessage]
    ) -> list[NewMessage]:
        """The messages of an append, with every TOOL_RESULT over the inline threshold
        stored aside (its content becomes a preview with the handle) and every reference
        to a stored output resolved (an empty content becomes its preview)."""
        out = list(messages)
        limit = min(self.tool_output_limits.inline_bytes, CHUNK)
        for i, m in enumerate(messages):
            handle = tool_output_handle(m.metadata) if m.metadata else None
            if handle is not None and m.role != Role.TOOL_RESULT:
                raise InvalidArgument(
                    "only a TOOL_RESULT may name a tool output",
                    field=f"messages[{i}].tool_output_id",
                )
            if m.role != Role.TOOL_RESULT:
                continue
            if handle is not None:
                found = self._store.find_tool_outputs(
                    key.tenant,
                    key.agent,
                    key.scope,
                    [handle[0]],
                    self._expired_through(key.tenant, key.agent, key.scope),
                )
                if not found:
                    error = tool_output_not_found(handle[0])
                    error.field = f"messages[{i}].tool_output_id"
                    raise error
                content = m.content or self._preview(found[0])
                metadata = with_tool_output(m.metadata, handle[0], found[0].size_bytes, i)
                out[i] = replace(m, content=content, metadata=metadata)
                continue
            if len(m.content) <= limit // 4 or len(m.content.encode()) <= limit:
                continue
            data = m.content.encode()
            call = self._call_answered(key, messages[:i], m.tool_call_id)
            pointer = self.put_tool_output(
                NewToolOutput(
                    tenant=key.tenant,
                    agent=key.agent,
                    scope=key.scope,
                    thread=key.thread,
                    tool_name=call.name if call else "tool_result",
                    tool_description="a tool result appended to the conversation",
                    args_json=(
                        _args_of(call.arguments_json)
                        if call
                        else json.dumps({"tool_call_id": m.tool_call_id})
                    ),
                ),
                [data],
            )
            out[i] = replace(
                m,
                content=self._preview(pointer, data),
                metadata=with_tool_output(m.metadata, pointer.id, pointer.size_bytes, i),
            )
        return out

    def _call_answered(
        self, key: ContextKey, earlier: Sequence[NewMessage], call_id: str
    ) -> ToolCall | None:
        """The tool call a result answers, when it names a tool that an output can be
        stored under: declared earlier in the same append, else by the thread's newest
        stored message declaring the call id."""
        if not call_id:
            return None
        for m in reversed(earlier):
            call = _call_in(m.tool_calls, call_id)
            if call is not None:
                return call
        return _call_in(self._store.tool_calls_declaring(key, call_id) or "", call_id)

    def _preview(self, pointer: ToolOutputPointer, data: bytes | None = None) -> str:
        """Head, handle and tail of a stored result (read from the store unless given);
        the whole text when it is short."""
        size = pointer.size_bytes
        head_bytes, tail_bytes = 4 * PREVIEW_HEAD_CHARS, 4 * PREVIEW_TAIL_CHARS
        if size <= head_bytes + tail_bytes:
            return _text(data if data is not None else self.read_range(pointer, 0, size))
        if data is not None:
            head_data, tail_data = data[:head_bytes], data[-tail_bytes:]
        else:
            head_data = self.read_range(pointer, 0, head_bytes)
            tail_data = self.read_range(pointer, size - tail_bytes, tail_bytes)
        head = head_data.decode("utf-8", "ignore")[:PREVIEW_HEAD_CHARS]
        tail = tail_data.decode("utf-8", "ignore")[-PREVIEW_TAIL_CHARS:]
        return preview_text(pointer.id, head, tail, len(head.encode()), size)

    # ------------------------------------------------------------------ writes

    def put_tool_output(
        self,
        output: NewToolOutput,
        pieces: Iterable[bytes],
        record_for: RecordFor | None = None,
        max_bytes: int | None = None,
    ) -> ToolOutputPointer:
        """Store a result given in pieces of any size; returns its pointer once durable.

        The result is re-chunked here; at most one chunk and one piece are held at a
        time. Small results stay inline in the pointer's row. When `pieces` raises (the
        client went away) or the result passes `max_bytes`, nothing is stored. The
        result's bytes count toward the tenant's stored-bytes quota, admitted piece by
        piece as they arrive (TENANT_STORAGE_EXHAUSTED, nothing stored, once one would
        pass it).
        """
        output = check_new_output(output)
        with self._quota.admitting_as_it_comes(output.tenant, "this tool output") as grow:
            return self._put_tool_output(output, _metered(pieces, grow), record_for, max_bytes)

    def _put_tool_output(
        self,
        output: NewToolOutput,
        pieces: Iterable[bytes],
        record_for: RecordFor | None,
        max_bytes: int | None,
    ) -> ToolOutputPointer:
        limits = self.tool_output_limits
        limit = limits.max_bytes if max_bytes is None else max_bytes
        inline_limit = min(limits.inline_bytes, CHUNK)
        output_id = new_output_id()
        intake = _Intake()
        buffer = bytearray()
        upload: BlobUpload | None = None
        try:
            for piece in pieces:
                if not piece:
                    continue
                intake.feed(piece)
                if intake.size > limit:
                    raise too_large(intake.size, limit, "result" if max_bytes else "chunk")
                buffer += piece
                while len(buffer) >= CHUNK and intake.size > inline_limit:
                    if upload is None:
                        upload = self._store.begin_tool_output_blob(
                            output.tenant, output_id, compress=limits.compress_bytes < CHUNK
                        )
                    upload.write(bytes(buffer[:CHUNK]))
                    del buffer[:CHUNK]
            inline: bytes | None = None
            if upload is None and intake.size <= inline_limit:
                inline = bytes(buffer)
            else:
                if upload is None:
                    upload = self._store.begin_tool_output_blob(
                        output.tenant,
                        output_id,
                        compress=intake.size > limits.compress_bytes,
                    )
                if buffer:
                    upload.write(bytes(buffer))
            buffer.clear()
            kind = intake.sniffer.kind(inline)
            now = self._clock.tick()
            digest = intake.sha.hexdigest()
            pointer = ToolOutputPointer(
                id=output_id,
                key=output_key(output.tool_name, output.args_json, now),
                tenant=output.tenant,
                agent=output.agent,
                scope=output.scope,
                thread=output.thread,
                tool_name=output.tool_name,
                tool_description=output.tool_description,
                args_json=output.args_json,
                task_id=output.task_id,
                query_id=output.query_id,
                size_bytes=intake.size,
                # The character estimate (chars + 3) // 4 (of the bytes, when binary).
                token_count=((intake.size if kind == ToolOutputKind.BINARY else intake.chars) + 3)
                // 4,
                create_time_us=now,
                kind=kind,
                stored_inline=inline is not None,
                stored_bytes=intake.size if upload is None else upload.stored_bytes,
                sha256=digest,
            )
            index_text = "\n".join(
                (
                    output.tool_name,
                    output.tool_description,
                    output.args_json,
                    intake.result_text(kind),
                )
            )
            record = record_for(digest) if record_for is not None else None
            saved = self._store.save_tool_output(pointer, inline, upload, index_text, record)
            upload = None  # saved (or aborted by the store): no longer ours to drop
            return saved
        finally:
            if upload is not None:
                upload.abort()

    def delete_tool_outputs(
        self, where: ToolOutputFilter, record: RequestRecord | None = None
    ) -> int:
        deleted = self._store.delete_tool_outputs(check_filter(where), record)
        if deleted:
            self._quota.forget(where.tenant)  # their bytes no longer count
        return deleted

    # ------------------------------------------------------------------ reads

    def _expired_through(self, tenant: str, agent: str, scope: str) -> int:
        """now - ttl of the scope's retention (0 without one): reads leave out what the
        sweep may delete (see ToolOutputFilter). The agent is read afresh, not from a
        cache, so a policy changed on another replica applies at once; outputs put
        under an agent that does not exist have no policy."""
        found = self._store.find_agent(tenant, agent)
        if found is None:
            return 0
        return found.retention_for(scope).expired_through_us(self._clock.now_us())

    def _visible(self, where: ToolOutputFilter) -> ToolOutputFilter:
        return replace(
            where, expired_through_us=self._expired_through(where.tenant, where.agent, where.scope)
        )

    def list_tool_outputs(
        self, where: ToolOutputFilter, requested_size: int, token: str
    ) -> Page[ToolOutputPointer]:
        check_filter(where)
        size = page_size(requested_size)
        params = (
            "tool_outputs",
            where.tenant,
            where.agent,
            where.scope,
            where.thread,
            where.task_id,
            where.query_id,
            where.tool_name,
        )
        position = self._pages.decode(token, params, (int, str))
        after = (int(position.position[0]), str(position.position[1])) if position else None
        rows = self._store.list_tool_outputs(self._visible(where), after, size + 1)
        return Page(*self._pages.cut(rows, size, params, lambda p: (p.create_time_us, p.id)))

    def tool_output(self, tenant: str, agent: str, scope: str, output_id: str) -> ToolOutputPointer:
        check_output_id(output_id)
        found = self._store.find_tool_outputs(
            tenant, agent, scope, [output_id], self._expired_through(tenant, agent, scope)
        )
        if not found:
            raise tool_output_not_found(output_id)
        return found[0]

    def find_tool_outputs(
        self, tenant: str, agent: str, scope: str, ids: list[str]
    ) -> tuple[list[ToolOutputPointer], list[str]]:
        """The pointers of `ids` found in this agent and scope, in the order asked, and
        the ids not found."""
        ids = check_output_ids(ids)
        expired_through = self._expired_through(tenant, agent, scope)
        found = {
            p.id: p
            for p in self._store.find_tool_outputs(tenant, agent, scope, ids, expired_through)
        }
        return [found[i] for i in ids if i in found], [i for i in ids if i not in found]

    def result_chunks(self, pointer: ToolOutputPointer) -> Iterator[bytes]:
        """The whole result, a chunk at a time; DATA_LOSS at the end when it is not the
        result stored (its SHA-256 differs) or is cut short."""
        sha = hashlib.sha256()
        size = 0
        index = 0
        while size < pointer.size_bytes:
            chunks = self._store.read_tool_output_chunks(pointer, index, 1)
            if not chunks:
                break
            sha.update(chunks[0])
            size += len(chunks[0])
            index += 1
            yield chunks[0]
        if size != pointer.size_bytes or sha.hexdigest() != pointer.sha256:
            from contextd.adapters.blobs.codec import unreadable  # domain error, no I/O

            raise unreadable(pointer.id, "it is not the result stored")

    def read_range(self, pointer: ToolOutputPointer, offset: int, length: int) -> bytes:
        return ResultReader(self._store).read_range(pointer, offset, length)

    def excerpts(self, pointer: ToolOutputPointer, query: str, budget_tokens: int) -> list[Excerpt]:
        return ResultReader(self._store).excerpts(pointer, query, budget_tokens)

    def read_tool_output(
        self, tenant: str, agent: str, scope: str, output_id: str, offset: int, length: int
    ) -> tuple[ToolOutputPointer, bytes]:
        if offset < 0:
            raise InvalidArgument("offset must not be negative", field="offset")
        if length < 0 or length > MAX_READ_BYTES:
            raise InvalidArgument(
                f"length must be 0 (for {DEFAULT_READ_BYTES:,}) to {MAX_READ_BYTES:,} bytes",
                field="length",
            )
        pointer = self.tool_output(tenant, agent, scope, output_id)
        if offset > pointer.size_bytes:
            raise InvalidArgument(
                f"offset {offset:,} is past the end of the result ({pointer.size_bytes:,} bytes)",
                field="offset",
            )
        return pointer, self.read_range(pointer, offset, length or DEFAULT_READ_BYTES)

    def grep_tool_output(
        self,
        tenant: str,
        agent: str,
        scope: str,
        output_id: str,
        pattern: str,
        context_lines: int = 0,
        ignore_case: bool = False,
        max_matches: int = 0,
        offset: int = 0,
        line_number: int = 0,
    ) -> GrepResult:
        if not pattern or len(pattern) > MAX_GREP_PATTERN_CHARS:
            raise InvalidArgument(
                f"pattern must be 1 to {MAX_GREP_PATTERN_CHARS} characters", field="pattern"
            )
        if not 0 <= context_lines <= MAX_GREP_CONTEXT_LINES:
            raise InvalidArgument(
                f"context_lines must be 0 to {MAX_GREP_CONTEXT_LINES}", field="context_lines"
            )
        if not 0 <= max_matches <= MAX_GREP_MATCHES:
            raise InvalidArgument(
                f"max_matches must be 0 (for {DEFAULT_GREP_MATCHES}) to {MAX_GREP_MATCHES}",
                field="max_matches",
            )
        if offset < 0 or line_number < 0:
            raise InvalidArgument("offset and line_number must not be negative", field="offset")
        pointer = self.tool_output(tenant, agent, scope, output_id)
        if offset > pointer.size_bytes:
            raise InvalidArgument("offset is past the end of the result", field="offset")
        return _grep(
            self._lines(pointer, offset),
            pattern,
            context_lines,
            ignore_case,
            max_matches or DEFAULT_GREP_MATCHES,
            offset,
            line_number or 1,
        )

    def _lines(self, pointer: ToolOutputPointer, offset: int) -> Iterator[tuple[int, bytes]]:
        """(offset, line without its break) from `offset` on, a chunk read at a time;
        lines longer than _MAX_GREP_LINE_BYTES come in pieces."""
        index = offset // CHUNK
        skip = offset - index * CHUNK
        pending = bytearray()
        start = offset
        while True:
            chunks = self._store.read_tool_output_chunks(pointer, index, 1)
            if not chunks:
                break
            data = chunks[0][skip:]
            skip = 0
            index += 1
            position = 0
            while position < len(data):
                newline = data.find(b"\n", position)
                end = len(data) if newline < 0 else newline
                pending += data[position:end]
                if newline < 0:
                    position = len(data)
                    if len(pending) >= _MAX_GREP_LINE_BYTES:
                        yield start, bytes(pending)
                        start += len(pending)
                        pending.clear()
                    continue
                yield start, bytes(pending)
                start += len(pending) + 1
                pending.clear()
                position = newline + 1
        if pending:
            yield start, bytes(pending)

    # ------------------------------------------------------------------ relevance

    def select_relevant(
        self,
        query: str,
        where: ToolOutputFilter,
        k: int = 0,
        keyword: bool = False,
        excerpt_tokens: int = 0,
    ) -> tuple[list[Relevant], bool]:
        """The k outputs of the filter most relevant to `query`, highest first, and
        whether this is the fallback (nothing matched: the filter's outputs, oldest
        first, at most k)."""
        check_query(query)
        check_filter(where)
        if not 0 <= k <= MAX_RELEVANT_K:
            raise InvalidArgument(f"k must be 0 (for {DEFAULT_RELEVANT_K}) to {MAX_RELEVANT_K}")
        if not 0 <= excerpt_tokens <= MAX_EXCERPT_TOKENS:
            raise InvalidArgument(
                f"excerpt_tokens must be 0 to {MAX_EXCERPT_TOKENS:,}", field="excerpt_tokens"
            )
        k = k or DEFAULT_RELEVANT_K
        where = self._visible(where)
        ranked, _ = ranked_outputs(self._store, where, query, k, keyword)
        fallback = not ranked
        if fallback:
            ranked = [(p, 0.0) for p in self._store.list_tool_outputs(where, None, k)]
        return [
            Relevant(p, score, tuple(self.excerpts(p, query, excerpt_tokens)))
            for p, score in ranked
        ], fallback


def _call_in(tool_calls: str, call_id: str) -> ToolCall | None:
    """The call of this id in a tool_calls text, when its name is a valid tool name."""
    for call in parse_tool_calls(tool_calls) if tool_calls else []:
        if call.id == call_id:
            return call if _TOOL_NAME.fullmatch(call.name) else None
    return None


def _args_of(arguments_json: str) -> str:
    """A call's arguments as the args of its stored output (a JSON object; anything else
    under "arguments")."""
    try:
        parsed = json.loads(arguments_json) if arguments_json.strip() else {}
    except (ValueError, RecursionError):
        parsed = arguments_json
    if not isinstance(parsed, dict):
        parsed = {"arguments": parsed}
    text = json.dumps(parsed, ensure_ascii=False)
    return text if len(text.encode()) <= MAX_TOOL_ARGS_BYTES else "{}"


def _metered(pieces: Iterable[bytes], grow: Callable[[int], None]) -> Iterator[bytes]:
    """The pieces, each admitted by the quota before it is handed on."""
    for piece in pieces:
        grow(len(piece))
        yield piece


def _grep(
    lines: Iterator[tuple[int, bytes]],
    pattern: str,
    context: int,
    ignore_case: bool,
    max_matches: int,
    offset: int,
    line_number: int,
) -> GrepResult:
    """Scan lines for a literal pattern; stop at max_matches (after their context lines)
    or at MAX_GREP_SCAN_BYTES, at a line's start."""
    needle = pattern.lower() if ignore_case else pattern
    before: deque[str] = deque(maxlen=context or 1)
    matches: list[GrepMatch] = []
    waiting: list[GrepMatch] = []  # matches still taking lines after them
    scanned = 0
    next_offset, next_line = offset, line_number
    number = line_number
    for start, raw in lines:
        line = _text(raw)
        for match in waiting:
            match.after.append(line[:MAX_GREP_LINE_CHARS])
        waiting = [m for m in waiting if len(m.after) < context]
        if len(matches) >= max_matches and not waiting:
            return GrepResult(matches, start, number, scanned)
        if len(matches) < max_matches and needle in (line.lower() if ignore_case else line):
            found = GrepMatch(
                number,
                start,
                line[:MAX_GREP_LINE_CHARS],
                tuple(before) if context else (),
                [],
            )
            matches.append(found)
            if context:
                waiting.append(found)
        if context:
            before.append(line[:MAX_GREP_LINE_CHARS])
        scanned += len(raw) + 1
        number += 1
        next_offset, next_line = start + len(raw) + 1, number
        if scanned >= MAX_GREP_SCAN_BYTES:
            return GrepResult(matches, next_offset, next_line, scanned)
        if len(matches) >= max_matches and not waiting:
            return GrepResult(matches, next_offset, next_line, scanned)
    return GrepResult(matches, 0, next_line, scanned)
