"""The append journal: small appends made durable by one file write, applied to DuckDB later.

Why: a DuckDB transaction costs about 3.6 ms of CPU for one message (parsing, binding, the
scan of an Arrow batch, two index updates, the WAL), whatever it carries; a single-message
AppendMessages cannot be faster than that while each group commits its own transaction.
So the writer (writer.py) makes a small group durable by appending one record to this file
(one `write` and one `fdatasync`), answers its callers, and applies many journaled groups
to DuckDB later in ONE transaction, which also records the number of the last group it
applied (`store_state.journal_applied_group`). When everything is applied the file is
truncated.

A record: magic, payload length, CRC-32 (of the group number and the payload), the group
number (increasing by one per group, never reused: it continues from the applied mark),
then the payload: everything the group's transaction would have written (`GroupWrite`):
the messages as an Arrow IPC stream, the threads it creates, summary pointers, expiry
markers, request records, and the id block it reserved.

At open (`Store.__init__`), the records after the applied mark are applied in one
transaction before anything reads the database; reading stops at the first short or
damaged record (its write never completed, so its callers were never answered). A record
at or below the mark was applied before a crash that came before the truncation: skipped.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

MAGIC = b"CDJ1"
# magic, payload length, CRC-32 of (group number, payload), group number
_HEADER = struct.Struct("<4sIIQ")
_GROUP = struct.Struct("<Q")
_LENGTH = struct.Struct("<I")

# Groups of at least this many messages are committed to DuckDB directly (after what is
# journaled, in order): their transaction's cost is spread over many messages already.
DIRECT_ROWS = 256
DIRECT_BYTES = 1 << 20  # ...and so are those of this many bytes of Arrow columns
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


# Made once: `pa.ipc.new_stream` reads environment variables on every call.
_IPC_OPTIONS = pa.ipc.IpcWriteOptions()


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.RecordBatchStreamWriter(sink, table.schema, options=_IPC_OPTIONS) as stream:
        stream.write_table(table)
    return bytes(sink.getvalue())


def _table(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


@dataclass(slots=True)
class GroupWrite:
    """What one group of appends writes to DuckDB (see `MessagesMixin._apply_group`)."""

    batch: pa.Table  # the messages, in the table's column order
    new_threads: pa.Table | None  # context_id, first_us, last_us of threads it creates
    summaries: dict[int, int]  # context id -> id of its newest stored summary
    expiries: dict[int, tuple[int, int, int]]  # context id -> (clear marker, through, outputs)
    requests: pa.Table | None  # request records (see base._request_rows)
    high_water: int | None  # the message id high-water mark it reserved, if it did

    @property
    def rows(self) -> int:
        return int(self.batch.num_rows)

    def encode(self) -> bytes:
        tables = [self.batch, self.new_threads, self.requests]
        blobs = [b"" if t is None else _ipc(t) for t in tables]
        head = json.dumps(
            {
                "summaries": sorted(self.summaries.items()),
                "expiries": [[c, *v] for c, v in sorted(self.expiries.items())],
                "high_water": self.high_water,
                "sizes": [len(b) for b in blobs],
            }
        ).encode()
        return b"".join([_LENGTH.pack(len(head)), head, *blobs])

    @staticmethod
    def decode(payload: bytes) -> GroupWrite:
        (size,) = _LENGTH.unpack_from(payload)
        head = json.loads(payload[_LENGTH.size : _LENGTH.size + size])
        at = _LENGTH.size + size
        tables: list[pa.Table | None] = []
        for n in head["sizes"]:
            tables.append(_table(payload[at : at + n]) if n else None)
            at += n
        batch, new_threads, requests = tables
        assert batch is not None
        return GroupWrite(
            batch=batch,
            new_threads=new_threads,
            summaries={int(c): int(s) for c, s in head["summaries"]},
            expiries={int(e[0]): (int(e[1]), int(e[2]), int(e[3])) for e in head["expiries"]},
            requests=requests,
            high_water=head["high_water"],
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
        threads = [g.new_threads for g in groups if g.new_threads is not None]
        requests = [g.requests for g in groups if g.requests is not None]
        return GroupWrite(
            batch=pa.concat_tables([g.batch for g in groups]),
            new_threads=pa.concat_tables(threads) if threads else None,
            summaries=summaries,
            expiries=expiries,
            requests=pa.concat_tables(requests) if requests else None,
            high_water=max(marks) if marks else None,
        )


class JournalFile:
    """The file: appended by the writer thread only, read once at open."""

    def __init__(self, path: Path) -> None:
        self.path = path
        created = not path.exists()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        if created:  # the file's name must survive a crash too
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        self._size = os.fstat(self._fd).st_size

    def records(self) -> list[tuple[int, bytes]]:
        """The whole records from the start, in order: (group number, payload); stops at
        the first short or damaged one (a write that never completed)."""
        data = os.pread(self._fd, self._size, 0) if self._size else b""
        out: list[tuple[int, bytes]] = []
        at = 0
        while at + _HEADER.size <= len(data):
            magic, length, crc, group = _HEADER.unpack_from(data, at)
            start = at + _HEADER.size
            payload = data[start : start + length]
            if magic != MAGIC or len(payload) != length:
                break
            if zlib.crc32(payload, zlib.crc32(_GROUP.pack(group))) != crc:
                break
            out.append((group, payload))
            at = start + length
        return out

    def append(self, group: int, payload: bytes) -> None:
        """Write one record and sync it. On failure the file is cut back to where it was,
        so the record can never be replayed (its callers are told it failed); if even that
        fails, OSError is raised with `cut_back` False."""
        crc = zlib.crc32(payload, zlib.crc32(_GROUP.pack(group)))
        record = _HEADER.pack(MAGIC, len(payload), crc, group) + payload
        try:
            view = memoryview(record)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            os.fdatasync(self._fd)
        except OSError as exc:
            try:
                os.ftruncate(self._fd, self._size)
                os.fdatasync(self._fd)
            except OSError:
                exc.cut_back = False  # type: ignore[attr-defined]
                raise exc from None
            exc.cut_back = True  # type: ignore[attr-defined]
            raise
        self._size += len(record)

    @property
    def size(self) -> int:
        return self._size

    def truncate(self) -> None:
        """Empty the file (everything in it is applied). Not synced: if a crash undoes it,
        the records are skipped by their group numbers."""
        os.ftruncate(self._fd, 0)
        self._size = 0

    def close(self) -> None:
        os.close(self._fd)
