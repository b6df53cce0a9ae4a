"""A replica's cache of the messages its builds load, each validated by its row's version.

Every build of a hot thread loads its newest messages again: read whole, each became a
StoredMessage, then a HistoryItem that the trimmer costs. This cache keeps those objects
(with what `contextd.domain.context.derived` and the trimmer keep on them), by thread and
id, with the version of the row they were made from: the transaction that wrote it and
where (`xmin`, `ctid`; any update, or a delete and an insert again, makes a new one). A
build's read sends the tags (id and version) it holds for the range it reads; PostgreSQL
returns every row's tag, and the columns only of rows whose tag it did not send. So what
a build uses is what its own snapshot holds, whoever wrote it (other replicas write too):
the cache only saves sending and decoding the columns again.

Bounded: at most THREAD_MESSAGES messages per thread (the newest by id are kept when it
fills) and CACHE_MESSAGES and CACHE_CHARS over all threads (past either, it starts over).
Dict operations are atomic under the GIL; a lock orders the writers.
"""

from __future__ import annotations

import threading

from contextd.domain.model import ContextKey, StoredMessage

# A row's tag: its id and version, as the window read computes it (alias m). Tags hold no
# space: a read sends those it holds as one string, separated by spaces (one text
# parameter: a list of strings is adapted element by element, in Python).
MESSAGE_TAG = "m.id::text || '/' || m.xmin::text || ':' || m.ctid::text"
THREAD_MESSAGES = 4_096
CACHE_MESSAGES = 65_536
CACHE_CHARS = 64 * 2**20


class MessageCache:
    def __init__(self) -> None:
        # (tenant, context_id) -> (the thread's key, id -> (tag, message))
        self._threads: dict[
            tuple[str, int], tuple[ContextKey, dict[int, tuple[str, StoredMessage]]]
        ]
        self._threads = {}
        self._messages = 0
        self._chars = 0
        self._lock = threading.Lock()

    def held(
        self, key: ContextKey, context_id: int, low: int, high: int
    ) -> dict[str, StoredMessage]:
        """The messages held of the thread with ids in [low, high], by tag."""
        found = self._threads.get((key.tenant, context_id))
        if found is None or found[0] != key:
            return {}
        return {tag: m for i, (tag, m) in list(found[1].items()) if low <= i <= high}

    def newest(self, key: ContextKey, context_id: int, n: int) -> dict[str, StoredMessage]:
        """The thread's `n` messages held with the highest ids (its newest: ids grow
        along a thread), by tag."""
        found = self._threads.get((key.tenant, context_id))
        if found is None or found[0] != key or n <= 0:
            return {}
        entries = list(found[1].items())
        if len(entries) > n:
            entries = sorted(entries)[-n:]
        return {tag: m for _, (tag, m) in entries}

    def put(self, key: ContextKey, context_id: int, read: list[tuple[str, StoredMessage]]) -> None:
        """Keep messages just read of the thread, with their tags."""
        if not read:
            return
        chars = sum(len(m.content) + len(m.tool_calls) + len(m.metadata) for _, m in read)
        with self._lock:
            if self._messages + len(read) > CACHE_MESSAGES or self._chars + chars > CACHE_CHARS:
                self._threads.clear()
                self._messages = self._chars = 0
            if len(read) > CACHE_MESSAGES or chars > CACHE_CHARS:
                return
            thread_key = (key.tenant, context_id)
            found = self._threads.get(thread_key)
            if found is None or found[0] != key:
                if found is not None:
                    self._forget(found[1])
                found = (key, {})
                self._threads[thread_key] = found
            entries = found[1]
            for tag, message in read:
                old = entries.get(message.id)
                if old is not None:
                    self._forget({message.id: old})
                entries[message.id] = (tag, message)
                self._messages += 1
                self._chars += _chars(message)
            if len(entries) > THREAD_MESSAGES:
                kept = sorted(entries)[len(entries) - THREAD_MESSAGES // 2 :]
                self._forget(entries)
                fresh = {i: entries[i] for i in kept}
                self._threads[thread_key] = (key, fresh)
                self._messages += len(fresh)
                self._chars += sum(_chars(m) for _, m in fresh.values())

    def _forget(self, entries: dict[int, tuple[str, StoredMessage]]) -> None:
        self._messages -= len(entries)
        self._chars -= sum(_chars(m) for _, m in entries.values())


def _chars(message: StoredMessage) -> int:
    return len(message.content) + len(message.tool_calls) + len(message.metadata)
