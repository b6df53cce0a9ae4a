"""The append journal: small appends made durable by one file write, applied to DuckDB later.

Why: a DuckDB transaction costs about 3.6 ms of CPU for one message (parsing, binding, the
scan of an Arrow batch, two index updates, the WAL), whatever it carries; a single-message
AppendMessages cannot be faster than that while each group commits its own transaction.
So the writer (writer.py) makes a small group durable by writing one record to this file
(one synchronous `write`), answers its callers, and applies many journaled groups
to DuckDB later in ONE transaction, which also records the number of the last group it
applied (`store_state.journal_applied_group`). When everything is applied the journal is
emptied: the next record is written at the start of the file, over the applied ones.

Why in place: a synchronous write that extends a file must also make the file's new size
durable (on ext4 a commit of the file system's own journal beside the data); one into
blocks the file already holds writes the data alone. Measured here (700-byte records,
O_DSYNC, four alternating rounds of 1,500): 0.30 ms on average and 55 us of CPU per write
at the end of a growing file, 0.18 ms and 44 us in place. So the file keeps its size
(the most a run between two applies wrote), and a clean close cuts it to nothing.

A record: magic, payload length, CRC-32 (of the group number and the payload), the group
number (increasing by one per group, never reused: it continues from the applied mark),
then the payload: everything the group's transaction would have written (`GroupWrite`):
the messages' columns, the threads it creates, summary pointers, expiry
markers, request records, and the id block it reserved.

At open (`Store.__init__`), the records after the applied mark are applied in one
transaction before anything reads the database. Reading stops at the first short or
damaged record (its write never completed, so its callers were never answered) and at
the first whose number does not follow the one before it: what lies after the newest
records is what was left of older, applied ones, whose numbers are all lower. A record
at or below the mark was applied before a crash (or lies behind an emptied journal):
skipped.
"""

from __future__ import annotations

import contextlib
import itertools
import marshal
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from contextd.adapters.duckdb.base import _ARROW_SCHEMA

MAGIC = b"CDJ1"
# magic, payload length, CRC-32 of (group number, payload), group number
_HEADER = struct.Struct("<4sIIQ")
_GROUP = struct.Struct("<Q")

# Groups of at least this many messages are committed to DuckDB directly (after what is
# journaled, in order): their transaction's cost is spread over many messages already.
DIRECT_ROWS = 256
DIRECT_CHARS = 1 << 20  # ...and so are those of this many characters of text
# The writer applies the journal when this much is pending after a group, whatever
# clients do: what a read after a burst, or a restart after a crash, waits for.
APPLY_ROWS = 2_000
APPLY_BYTES = 8 << 20
# ...and when it has been idle this long (seconds, monotonic): a steady single caller's
# appends are applied in batches, and an idle server's journal is empty.
APPLY_IDLE_S = 0.05


def journal_path(database: Path) -> Path:
    """The journal of a DuckDB file: beside it, like its WAL."""
    return database.with_name(database.name + ".journal")


# The payload's layout; a record of another version is not applied (the open fails, and
# the file is kept).
_PAYLOAD_VERSION = 1
_MARSHAL_VERSION = 4

# Columns of the messages, by name (base._ARROW_SCHEMA), as the writer builds them: plain
# Python values. A small group never becomes an Arrow table on the writer's hot path:
# building one costs about 15 microseconds per column whatever its length (0.4 ms for a
# single message), so the rows stay lists until many groups are applied at once.
Columns = dict[str, list[Any]]
# A request record's row: id_key, tenant, request_id, method, fingerprint, payload,
# create_time_us (the columns of request_records).
RequestRow = tuple[str, str, str, str, str, bytes, int]
# A new thread: context_id, first commit time, last commit time.
ThreadRow = tuple[int, int, int]

_TEXT_COLUMNS = ("content_short", "content_long", "tool_calls", "metadata")


def _plain(columns: Columns) -> Columns:
    """`columns` with every value a plain Python one (marshal refuses subclasses)."""
    return {
        name: pa.array(values, _ARROW_SCHEMA.field(name).type).to_pylist()
        for name, values in columns.items()
    }


@dataclass(slots=True)
class GroupWrite:
    """What one group of appends writes to DuckDB (see `MessagesMixin._apply_group`)."""

    columns: Columns  # the messages
    new_threads: list[ThreadRow]  # threads it creates
    summaries: dict[int, int]  # context id -> id of its newest stored summary
    expiries: dict[int, tuple[int, int, int]]  # context id -> (clear marker, through, outputs)
    requests: list[RequestRow]  # request records
    high_water: int | None  # the message id high-water mark it reserved, if it did

    @property
    def rows(self) -> int:
        return len(self.columns["id"])

    def text_chars(self) -> int:
        """Characters of its messages' text columns: what bounds a journaled group."""
        return sum(len(v) for name in _TEXT_COLUMNS for v in self.columns[name] if v)

    def table(self, schema: pa.Schema) -> pa.Table:
        return pa.table(self.columns, schema=schema)

    def threads_table(self) -> pa.Table:
        ids, first, last = zip(*self.new_threads, strict=True)
        return pa.table(
            {
                "context_id": pa.array(ids, pa.int64()),
                "first_us": pa.array(first, pa.int64()),
                "last_us": pa.array(last, pa.int64()),
            }
        )

    def requests_table(self) -> pa.Table:
        names = ("id_key", "tenant", "request_id", "method", "fingerprint")
        cols: dict[str, Any] = {n: [r[i] for r in self.requests] for i, n in enumerate(names)}
        cols["payload"] = pa.array([r[5] for r in self.requests], pa.binary())
        cols["create_time_us"] = pa.array([r[6] for r in self.requests], pa.int64())
        return pa.table(cols)

    def encode(self) -> bytes:
        """The payload: plain values by `marshal` (a microsecond or two for a message;
        the record's CRC guards it, and only this process's own writer writes it)."""

        def body(columns: Columns) -> tuple[Any, ...]:
            return (
                _PAYLOAD_VERSION,
                columns,
                self.new_threads,
                sorted(self.summaries.items()),
                sorted(self.expiries.items()),
                self.requests,
                self.high_water,
            )

        # Written in marshal's format version 4 (stable since Python 3.4; newer Pythons
        # read it), never "the current" one, so a journal left by a crash still reads
        # after the interpreter is upgraded. A clean stop leaves the journal empty anyway.
        try:
            return marshal.dumps(body(self.columns), _MARSHAL_VERSION)
        except ValueError:  # a value of a subclass (an IntEnum, a NumPy integer)
            return marshal.dumps(body(_plain(self.columns)), _MARSHAL_VERSION)

    @staticmethod
    def decode(payload: bytes) -> GroupWrite:
        version, columns, threads, summaries, expiries, requests, high_water = marshal.loads(
            payload
        )
        if version != _PAYLOAD_VERSION:
            raise ValueError(f"journal record of payload version {version}")
        return GroupWrite(
            columns=columns,
            new_threads=[tuple(t) for t in threads],
            summaries=dict(summaries),
            expiries={c: tuple(v) for c, v in expiries},
            requests=[tuple(r) for r in requests],
            high_water=high_water,
        )

    @staticmethod
    def merged(groups: list[GroupWrite]) -> GroupWrite:
        """The groups as one write, in their order: rows concatenated; a later summary
        pointer wins; expiry markers by their maximum (each UPDATE keeps the greatest, so
        one update with the maxima writes what the updates one by one would)."""
        if len(groups) == 1:
            return groups[0]
        summaries: dict[int, int] = {}
        expiries: dict[int, tuple[int, int, int]] = {}
        marks = [g.high_water for g in groups if g.high_water is not None]
        for g in groups:
            summaries.update(g.summaries)
            for c, v in g.expiries.items():
                old = expiries.get(c)
                expiries[c] = (
                    v if old is None else (max(old[0], v[0]), max(old[1], v[1]), max(old[2], v[2]))
                )
        return GroupWrite(
            columns={
                name: list(itertools.chain.from_iterable(g.columns[name] for g in groups))
                for name in groups[0].columns
            },
            new_threads=[t for g in groups for t in g.new_threads],
            summaries=summaries,
            expiries=expiries,
            requests=[r for g in groups for r in g.requests],
            high_water=max(marks) if marks else None,
        )


class JournalFile:
    """The file: written by the writer thread only, read once at open.

    `size` is the journal's length (the end of its newest record; 0 when empty), not the
    file's: the file keeps the blocks of earlier runs, rewritten in place (see above)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        created = not path.exists()
        # O_DSYNC: each write returns only once its data (and the size that reaches it)
        # is on disk, as a write followed by fdatasync would, in one system call. Why: a
        # system call releases the GIL, and the writer thread must win it back from every
        # handler thread before it answers anyone; under many callers each release costs
        # the writer (and so each group's callers) a wait for the GIL, so one is cheaper
        # than two. Not O_APPEND: records are written at an offset (Linux appends every
        # write of an O_APPEND file at its end, whatever the offset).
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DSYNC, 0o600)
        if created:  # the file's name must survive a crash too
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        self._size = self._scan()[1]

    def _scan(self) -> tuple[list[tuple[int, bytes]], int]:
        """The newest run of whole records from the start of the file, and where it ends."""
        length = os.fstat(self._fd).st_size
        data = os.pread(self._fd, length, 0) if length else b""
        out: list[tuple[int, bytes]] = []
        at = 0
        while at + _HEADER.size <= len(data):
            magic, size, crc, group = _HEADER.unpack_from(data, at)
            start = at + _HEADER.size
            payload = data[start : start + size]
            if magic != MAGIC or len(payload) != size:
                break
            if zlib.crc32(payload, zlib.crc32(_GROUP.pack(group))) != crc:
                break
            if out and group != out[-1][0] + 1:
                break  # what is left of an older run (see the module)
            out.append((group, payload))
            at = start + size
        return out, at

    def records(self) -> list[tuple[int, bytes]]:
        """The whole records from the start, in order: (group number, payload); stops at
        the first short or damaged one (a write that never completed) and at the first
        that does not follow the one before it (an older run's)."""
        return self._scan()[0]

    def append(self, group: int, payload: bytes) -> None:
        """Write one record after the others, durably (the file is O_DSYNC: the write
        returns once the record is on disk). On failure the file is cut back to where the
        journal ends, so the record can never be replayed (its callers are told it
        failed); if even that fails, OSError is raised with `cut_back` False."""
        crc = zlib.crc32(payload, zlib.crc32(_GROUP.pack(group)))
        record = _HEADER.pack(MAGIC, len(payload), crc, group) + payload
        at = self._size
        try:
            view = memoryview(record)
            while view:
                written = os.pwrite(self._fd, view, at)
                view, at = view[written:], at + written
        except OSError as exc:
            try:  # everything after the journal goes (older runs' records are applied)
                os.ftruncate(self._fd, self._size)
                os.fdatasync(self._fd)
            except OSError:
                exc.cut_back = False  # type: ignore[attr-defined]
                raise exc from None
            exc.cut_back = True  # type: ignore[attr-defined]
            raise
        self._size = at

    @property
    def size(self) -> int:
        return self._size

    def empty(self) -> None:
        """Empty the journal (everything in it is applied): the next record is written at
        the start of the file, over the applied ones. Nothing is written now: should a
        crash come before the next record, the applied ones are skipped by their numbers
        (so are those a shorter newer run leaves behind it)."""
        self._size = 0

    def close(self) -> None:
        """Close the file; an empty journal's file is cut to nothing (a stopped store's
        journal holds no record). Not synced: records left by a crash are applied ones."""
        if self._size == 0:
            with contextlib.suppress(OSError):  # tidiness only: the records are applied
                os.ftruncate(self._fd, 0)
        os.close(self._fd)
