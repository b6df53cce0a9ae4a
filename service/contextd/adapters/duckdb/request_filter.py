"""Which request keys this store may have recorded: a Bloom filter kept in memory.

Every write with a request id asks first whether the id was recorded (the handler's fast
path, `WriterMixin.remembered`, and the writer's own check before it writes). Almost
every id is fresh, and each lookup of `request_records` is a DuckDB statement (about half a
millisecond, its per-statement floor) on a path that costs a third of that in all. The
filter answers "absent" for certain, so a fresh id costs no statement; "maybe" (a key
recorded, or a false positive: about 1 in 100) falls back to the lookup, so a false
positive costs only that lookup, never a wrong answer.

The DuckDB store is one process with one writer, and every request record is written by
that writer: it adds each key before the record becomes visible anywhere a retry could
find it (before the commit, or the journal's write, and so before any caller is answered).
The filter is built at open from the table's keys (after the journal's replay has put its
records there) with a capacity of max(MIN_CAPACITY, 2 x rows); once as many keys were added
since as it holds, the writer builds it again from the table (and the journal's pending
records), which also sheds the keys the cleanup removed. That build runs on a thread of
its own (`Rebuild`), its scan and its hashing without the interpreter's lock, while the
writer goes on: every key the writer adds from the moment the build starts is also noted,
and added to the new filter before the writer swaps it in (between groups). A key
committed before the build's scan began is in the scan, one journaled then is in the
journal's keys the build was given, and any later one is noted: none is missed.

Memory: about 9.6 bits per key of capacity (1% false positives, 7 probes): 1.2 MB at the
minimum capacity of a million keys.

The bits live in the Rust core (`contextd.core.RequestFilter`, rust_core/src/
request_filter.rs): the build (at open, and the writer's rebuild when full) hashes and
sets the bits of an Arrow string column straight from its buffers with the interpreter's
lock released, about a tenth of a second per million keys, where the Python build (a
`str` and a `hash()` per key and numpy scatters) held the lock, and so every write, for
about a second. Its hash is fixed (not salted per process as Python's `hash()` is), which
does not matter either way: the filter never leaves the process.

Thread safety: handler threads read while the writer adds. A reader holds one filter
object (the writer swaps in a rebuilt one by a single assignment) and reads atomic words
that only ever gain bits; a key's bits are all set before its record is visible, so a
retry of an answered write always finds all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import pyarrow as pa

from contextd.core import RequestFilter as _Bits

MIN_CAPACITY = 1_000_000


class RequestFilter:
    """A Bloom filter of request keys (see idempotency.record_key): `maybe(key)` False
    means the key was never added."""

    __slots__ = ("_bits", "added", "capacity", "maybe", "rebuild")

    maybe: Callable[[str], bool]
    """False: the key was never added (certain). True: it may have been. (The core's own
    method, bound here: the handlers' fast path pays no Python frame for it.)"""

    def __init__(self, keys: Iterable[str] = (), capacity: int | None = None) -> None:
        """A filter holding `keys`, sized for `capacity` keys (default max(MIN_CAPACITY,
        2 x len(keys)))."""
        keys = list(keys)
        if capacity is None:
            capacity = max(MIN_CAPACITY, 2 * len(keys))
        self.capacity = max(1, capacity)
        self._bits = _Bits(self.capacity)
        self.maybe = self._bits.maybe
        self.add_many(keys)
        self.added = 0  # keys added since the build
        self.rebuild: Rebuild | None = None  # its successor being built, if any

    @property
    def nbytes(self) -> int:
        return self._bits.nbytes

    def bits(self) -> bytes:
        """A copy of the bits (tests compare two filters with it)."""
        return self._bits.to_bytes()

    def add_many(self, keys: Iterable[str]) -> None:
        """Set the bits of a few `keys` (the journal's pending ones at a build), not
        counted in `added`."""
        add = self._bits.add
        for key in keys:
            add(key)

    def add_arrow(self, column: Any) -> None:
        """Set the bits of every value of a pyarrow string array or chunked array (the
        build, at open and at a rebuild), not counted in `added`: read from the arrays'
        buffers by the core, with the interpreter's lock released."""
        chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
        for chunk in chunks:
            if pa.types.is_string(chunk.type):
                large = False
            elif pa.types.is_large_string(chunk.type):
                large = True
            else:  # e.g. string_view: a copy, still without a Python object per key
                chunk, large = chunk.cast(pa.large_string()), True
            if len(chunk) == 0:
                continue
            _, offsets, data = chunk.buffers()
            data = data if data is not None else b""  # every value empty: no data buffer
            self._bits.add_column(data, offsets, large, chunk.offset, len(chunk))

    def add(self, key: str) -> None:
        """Note `key` (the writer, before its record is visible)."""
        self._bits.add(key)
        self.added += 1
        if self.rebuild is not None:
            self.rebuild.noted.append(key)

    def full(self) -> bool:
        """Whether as many keys were added since the build as it was sized for: time to
        build it again (larger, and without the keys removed since)."""
        return self.added >= self.capacity


class Rebuild:
    """A new filter built on a thread of its own (`build` scans the table: on a cursor of
    its own, never the writer's), and the keys the writer added meanwhile (`noted`, only
    ever touched by the writer), which go into the new filter before it is swapped in."""

    __slots__ = ("_future", "_thread", "noted")

    def __init__(self, build: Callable[[], RequestFilter]) -> None:
        self.noted: list[str] = []
        self._future: Future[RequestFilter] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(build,), name="contextd-request-filter", daemon=True
        )
        self._thread.start()

    def _run(self, build: Callable[[], RequestFilter]) -> None:
        try:
            self._future.set_result(build())
        except BaseException as exc:  # handed to the writer, which logs it
            self._future.set_exception(exc)

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> RequestFilter:
        """The new filter with the noted keys added (raises what the build raised)."""
        rebuilt = self._future.result()
        for key in self.noted:
            rebuilt.add(key)
        return rebuilt

    def join(self, timeout: float | None) -> None:
        """Wait for the build (the store's close: its cursor must be done first)."""
        self._thread.join(timeout)
