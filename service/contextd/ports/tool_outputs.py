"""Tool outputs as the use cases see them: pointers in the store, results behind a blob
port (see domain/tool_outputs.py).

What every engine must do:
- A result is written a chunk at a time (`BlobUpload.write`: raw chunks of exactly
  TOOL_OUTPUT_CHUNK_BYTES, the last one shorter) and never held whole; it becomes
  visible only with its pointer (`save_tool_output`), whole, or not at all: an upload
  aborted, or cut off by a crash, leaves nothing a read can see.
- Reads name the tenant, agent and scope: an output of another one is never returned.
- `read_tool_output_chunks` returns raw chunks (decompressed); DataLoss when stored data
  is missing or does not decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from contextd.domain.idempotency import RequestRecord
from contextd.domain.tool_outputs import ToolOutputFilter, ToolOutputPointer

if TYPE_CHECKING:
    from contextd.domain.model import ContextKey
    from contextd.ports.store import RetainedThread


IndexedOutput = tuple[str, int, str, str | None, str | None, str, str, int]
"""(id, create_time_us, thread, task_id, query_id, tool_name, index_text, id_hash):
id_hash is the engine's own hash of the id (DuckDB's hash, PostgreSQL's hashtext), the
term the fingerprint sums."""


class BlobUpload(Protocol):
    """A result being stored, chunk by chunk, not yet visible."""

    @property
    def stored_bytes(self) -> int:
        """Bytes written to storage so far (after compression)."""

    def write(self, chunk: bytes) -> None:
        """Store the next raw chunk."""

    def abort(self) -> None:
        """Drop what was written (idempotent; also after a failed save)."""


class ToolOutputStore(Protocol):
    def begin_tool_output_blob(self, tenant: str, output_id: str, compress: bool) -> BlobUpload:
        """Start storing a large result; nothing is visible until `save_tool_output`."""

    def save_tool_output(
        self,
        pointer: ToolOutputPointer,
        inline: bytes | None,
        upload: BlobUpload | None,
        index_text: str,
        record: RequestRecord | None = None,
    ) -> ToolOutputPointer:
        """Make the output visible: its pointer with the inline result, or with the
        upload's chunks, both or neither. `index_text` is what relevance ranking reads."""

    def list_tool_outputs(
        self, where: ToolOutputFilter, after: tuple[int, str] | None, limit: int
    ) -> list[ToolOutputPointer]:
        """By (create time, id), strictly after `after`."""

    def tool_output_index(
        self, where: ToolOutputFilter, limit: int
    ) -> list[tuple[ToolOutputPointer, str]]:
        """The newest `limit` outputs of the filter with their index texts, oldest first."""

    def find_tool_outputs(
        self,
        tenant: str,
        agent: str,
        scope: str,
        ids: Sequence[str],
        expired_through_us: int = 0,
    ) -> list[ToolOutputPointer]:
        """The outputs of these ids in this agent and scope (others are left out), less
        those `expired_through_us` leaves out (see ToolOutputFilter)."""

    def read_tool_output_chunks(
        self, pointer: ToolOutputPointer, first: int, count: int
    ) -> list[bytes]:
        """Raw chunks `first` .. `first + count - 1` of the result (an inline result is
        chunk 0)."""

    def delete_tool_outputs(
        self, where: ToolOutputFilter, record: RequestRecord | None = None
    ) -> int:
        """Delete the pointers and their stored data; returns how many."""

    def delete_expired_tool_outputs(
        self, thread: RetainedThread, cutoff_us: int, limit: int
    ) -> int:
        """Delete at most `limit` outputs of the thread's context (tenant, agent, scope,
        thread) stored at or before `cutoff_us`, and their stored data, provided the
        thread's newest message is still at or before `cutoff_us`, or `cutoff_us` is at
        or before its `outputs_expired_through_us` (checked in the delete's transaction:
        an append that just arrived keeps them). Returns how many (fewer than `limit`:
        none are left)."""

    def tool_calls_declaring(self, key: ContextKey, call_id: str) -> str | None:
        """The `tool_calls` text of the thread's newest stored message that declares the
        call id (None: no such message), so a result kept aside can name its tool."""

    def tool_output_fingerprint(self, tenant: str, agent: str, scope: str) -> tuple[int, int, int]:
        """(count, sum of create_time_us, sum of the ids' hashes as `tool_output_docs`
        gives them) of the scope's outputs: what a cached relevance index checks itself
        against. Every put and delete changes it; the ids' hashes tell apart a delete and
        a put of the same moment on two replicas, which the count and times alone would
        not. (An engine's hash, not a parse of the id's hex digits in SQL: that cost
        10 ms per call at 100,000 outputs.)"""

    def tool_output_docs(
        self, tenant: str, agent: str, scope: str, after: tuple[int, str] | None, limit: int
    ) -> list[IndexedOutput]:
        """The scope's outputs by (create time, id), strictly after `after`, as a
        relevance index reads them."""
