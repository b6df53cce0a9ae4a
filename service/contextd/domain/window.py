"""The rolling window: which messages of a thread are its context.

One definition, computed here once per call and handed to every reader (ListMessages,
GetContextStats, BuildContext, CompactContext, the status preamble's thread activity);
the store turns it into one SQL predicate (`storage.window_predicate`). A message is in
the window iff

- it was committed after the latest clear marker that applies to it (the agent's, or its
  thread's when that is later): `create_time > clear_after`. Clear markers and commit
  times come from the same server clock, so "appended after the clear" always means
  "in the window"; a client's time never takes part in this test.
- its own time is within the rolling window: `coalesce(source_time, create_time) >
  now - rolling_window`. A client's `source_time` decides the age of its message, so
  imported history older than the window is history only.

Clears only move markers; nothing is deleted, so the same history serves both the window
and history queries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from contextd.domain.retention import RetentionPolicy

# How far a client's source_time may lead the server's clock (clock skew). Appends reject
# more, so a message's own time is never more than this after its commit time.
MAX_SOURCE_LEAD_US = 5 * 60 * 1_000_000


@dataclass(frozen=True, slots=True)
class WindowSpec:
    """The window's two exclusive lower bounds, in microseconds since the epoch.

    `clear_after_us` is the clear marker compared with commit times (a thread's own
    marker, when later, is applied per thread: see `with_thread_clear`); `age_after_us`
    (now - rolling window) is compared with each message's own time.

    Retention (see retention.py) adds two bounds per thread, which the store evaluates
    against each thread's newest message: `expire_after_us` (now - ttl; None: no ttl)
    leaves out every message of a thread whose newest commit time is at or before it, and
    `max_messages` (0: no cap) leaves out every message whose tool group starts at or
    before the thread's last sequence - max_messages.
    """

    clear_after_us: int
    age_after_us: int
    max_messages: int = 0
    expire_after_us: int | None = None

    @property
    def retains(self) -> bool:
        """Whether retention bounds apply (a thread's window is then not simply every
        message after its markers)."""
        return bool(self.max_messages) or self.expire_after_us is not None

    def with_retention(self, policy: RetentionPolicy, now_us: int) -> WindowSpec:
        """This window under a scope's retention policy, at `now_us`."""
        expire = now_us - policy.ttl_us if policy.ttl_us else None
        if policy.max_messages == self.max_messages and expire == self.expire_after_us:
            return self  # equal to the copy (frozen), which every build made before
        return replace(self, max_messages=policy.max_messages, expire_after_us=expire)

    def with_thread_clear(self, thread_clear_us: int | None) -> WindowSpec:
        """The window of one thread: the later of the agent's and the thread's marker."""
        if thread_clear_us is None or thread_clear_us <= self.clear_after_us:
            return self
        return replace(self, clear_after_us=thread_clear_us)

    def holds(self, create_time_us: int, source_time_us: int | None) -> bool:
        """Whether a message committed at `create_time_us` with `source_time_us` is in
        this window: the predicate the store evaluates in SQL, for pure code and tests."""
        own_time = create_time_us if source_time_us is None else source_time_us
        return create_time_us > self.clear_after_us and own_time > self.age_after_us


def window_spec(
    now_us: int,
    rolling_window_us: int,
    agent_clear_us: int,
    thread_clear_us: int | None = None,
) -> WindowSpec:
    """The window at `now_us` of an agent (and of one of its threads, given its marker)."""
    return WindowSpec(agent_clear_us, now_us - rolling_window_us).with_thread_clear(thread_clear_us)
