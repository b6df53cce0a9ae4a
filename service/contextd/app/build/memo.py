"""A bounded memo for pure functions of message text that every build of a hot thread
would otherwise recompute on the same newest messages (blob stubs, specifics found in the
kept messages).

Hand-written rather than `functools.lru_cache`: the bound is on entries and the whole
memo is dropped when full (one `dict.clear`, no per-hit bookkeeping on the hot path), and
each operation on a dict is atomic under the GIL, so threads of the server share it
without a lock. Results are never stale: the key is the whole input.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Memo(Generic[K, V]):
    def __init__(self, entries: int) -> None:
        self._entries = entries
        self._found: dict[K, V] = {}

    def get(self, key: K, compute: Callable[[K], V]) -> V:
        found = self._found.get(key)
        if found is None:
            found = compute(key)
            if len(self._found) >= self._entries:
                self._found.clear()
            self._found[key] = found
        return found

    def put(self, key: K, value: V) -> None:
        if len(self._found) >= self._entries:
            self._found.clear()
        self._found[key] = value

    def clear(self) -> None:
        self._found.clear()

    def peek(self, key: K) -> V | None:
        return self._found.get(key)
