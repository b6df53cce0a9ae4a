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
records), which also sheds the keys the cleanup removed.

Memory: about 9.6 bits per key of capacity (1% false positives, 7 probes), one
`bytearray`: 1.2 MB at the minimum capacity of a million keys.

Hand-written rather than a package: the filter is a few lines over a `bytearray` plus a
numpy build (numpy is already a dependency), and the one maintained binary package that
fits (rbloom) would add a dependency for no gain here. Python's `hash()` of a str is salted
per process, which is fine: the filter never leaves the process.

Thread safety: handler threads read while the writer adds. A reader holds one filter
object (the writer swaps in a rebuilt one by a single assignment) and reads bytes that
only ever gain bits; a key's bits are all set before its record is visible, so a retry
of an answered write always finds all of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

MIN_CAPACITY = 1_000_000
FALSE_POSITIVES = 0.01
_MASK64 = (1 << 64) - 1
_LOW32 = (1 << 32) - 1


class RequestFilter:
    """A Bloom filter of request keys (see idempotency.record_key): `maybe(key)` False
    means the key was never added."""

    __slots__ = ("_bits", "_k", "_m", "added", "capacity")

    def __init__(self, keys: Sequence[str] = (), capacity: int | None = None) -> None:
        """A filter holding `keys`, sized for `capacity` keys (default max(MIN_CAPACITY,
        2 x len(keys)))."""
        if capacity is None:
            capacity = max(MIN_CAPACITY, 2 * len(keys))
        self.capacity = max(1, capacity)
        # The optimal sizes for FALSE_POSITIVES: m = -n ln p / (ln 2)^2 bits, k = m/n ln 2.
        m = math.ceil(-self.capacity * math.log(FALSE_POSITIVES) / math.log(2) ** 2)
        self._m = max(64, (m + 7) // 8 * 8)
        self._k = max(1, round(self._m / self.capacity * math.log(2)))
        self._bits = bytearray(self._m // 8)
        self.add_many(keys)
        self.added = 0  # keys added since the build

    @property
    def nbytes(self) -> int:
        return len(self._bits)

    def add_many(self, keys: Sequence[str]) -> None:
        """Set the bits of `keys` in bulk, not counted in `added` (the build, at open and
        at a rebuild, on the writer: a million keys take a fraction of a second, where a
        Python loop would take seconds; its temporaries are a few arrays of 8 bytes a
        key, so the build reads the keys in chunks)."""
        if not keys:
            return
        hashes = np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys)).view(np.uint64)
        low = hashes & np.uint64(_LOW32)
        step = (hashes >> np.uint64(32)) | np.uint64(1)
        bits = np.frombuffer(self._bits, dtype=np.uint8)  # a view: writes go to the bytes
        m = np.uint64(self._m)
        for i in range(self._k):
            probe = (low + np.uint64(i) * step) % m
            masks = np.left_shift(np.uint8(1), (probe & np.uint64(7)).astype(np.uint8))
            np.bitwise_or.at(bits, probe >> np.uint64(3), masks)

    def _probes(self, key: str) -> Iterable[int]:
        # Double hashing (Kirsch and Mitzenmacher): the k probes from one 64-bit hash,
        # the same arithmetic as `add_many` (no probe overflows 64 bits).
        h = hash(key) & _MASK64
        low, step, m = h & _LOW32, (h >> 32) | 1, self._m
        return [(low + i * step) % m for i in range(self._k)]

    def add(self, key: str) -> None:
        """Note `key` (the writer, before its record is visible)."""
        bits = self._bits
        for i in self._probes(key):
            bits[i >> 3] |= 1 << (i & 7)
        self.added += 1

    def maybe(self, key: str) -> bool:
        """False: `key` was never added (certain). True: it may have been."""
        bits = self._bits
        return all(bits[i >> 3] >> (i & 7) & 1 for i in self._probes(key))

    def full(self) -> bool:
        """Whether as many keys were added since the build as it was sized for: time to
        build it again (larger, and without the keys removed since)."""
        return self.added >= self.capacity
