"""Retention: how much of a context is kept, and for how long.

A *context* here is one thread of an agent in one scope (tenant, agent, scope, thread):
the unit a window, a clear and a build are about. Its retention policy is the agent's
(`Agent.retention`), unless one of the agent's scope overrides matches the scope: then
the first matching override's policy applies, whole (its fields are not merged with the
agent's).

- `max_messages` (0: no cap): the window holds at most the thread's newest N messages by
  sequence (compaction summaries are numbered like any message and count). A cap never
  splits a tool group: when the N-th newest message is a tool result whose tool_use is
  older, the boundary moves toward newer messages, so the whole group leaves the window
  and the window holds fewer than N. With `delete_overflow` the sweep deletes what fell
  out; without it the messages stay in the history (MESSAGE_RANGE_ALL).
- `ttl` (0: never): a context whose newest message (its last update: any append,
  restores and stored summaries included) is `ttl` or more old is expired. Every read of
  the window sees it empty at once; the sweep deletes its messages. A message appended
  after expiry starts it again: the append writes a clear marker at the moment the
  context expired (last update + ttl) in its own transaction, so nothing from before the
  expiry reappears, even when the sweep has not run.

The default policy keeps everything: no cap, no expiry, history kept indefinitely.

Scope patterns are written over a scope's canonical form (see scopes.py): a pattern
without `*` names one scope exactly (`dm:42`, `guild:1/channel:2/user:3`, `support`); a
pattern ending in `*` names every scope whose canonical form starts with what comes
before it (`dm:*`, `guild:123/*`, `guild:123/channel:9/*`, `ticket-*`); `*` alone names
every scope, the default scope included. `*` may appear only once, at the end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from contextd.domain.errors import InvalidArgument


def quote(value: str, limit: int = 40) -> str:
    """A short rendering of a client's value (as validation.quote, which this module
    cannot import: the model imports this one)."""
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value):,} chars)"


SECOND_US = 1_000_000
# Bounds of a policy (see check_policy).
MAX_RETAINED_MESSAGES = 1_000_000
MIN_TTL_US = SECOND_US
MAX_TTL_US = 3650 * 86_400 * SECOND_US
MAX_RETENTION_OVERRIDES = 32
MAX_SCOPE_PATTERN_CHARS = 256
_PATTERN = re.compile(r"[A-Za-z0-9._:@/\-]*\*?")

# Update mask paths of the agent's retention settings.
RETENTION_FIELDS = frozenset({"retention", "retention_overrides"})

# The event a sweep records per thread it removed messages of.
SWEPT_EVENT = "retention.swept"


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """How much of a context is kept (0 means "no limit" for both bounds)."""

    max_messages: int = 0
    ttl_us: int = 0
    delete_overflow: bool = False

    @property
    def keeps_everything(self) -> bool:
        return not self.max_messages and not self.ttl_us

    def expire_time_us(self, last_update_us: int | None) -> int | None:
        """When a context last updated at `last_update_us` expires (None: never)."""
        if not self.ttl_us or last_update_us is None:
            return None
        return last_update_us + self.ttl_us

    def expired(self, last_update_us: int | None, now_us: int) -> bool:
        expire = self.expire_time_us(last_update_us)
        return expire is not None and expire <= now_us

    def expired_through_us(self, now_us: int) -> int:
        """The time at or before which a context's newest message makes it expired now,
        and a tool output is old enough for the sweep (now - ttl); 0 without a ttl."""
        return now_us - self.ttl_us if self.ttl_us else 0


KEEP_EVERYTHING = RetentionPolicy()


@dataclass(frozen=True, slots=True)
class ScopeRetention:
    """A policy for the scopes a pattern names (see the module's docstring)."""

    scope_pattern: str
    policy: RetentionPolicy


def matches(pattern: str, scope: str) -> bool:
    """Whether `pattern` names the canonical scope `scope`."""
    if pattern.endswith("*"):
        return scope.startswith(pattern[:-1])
    return scope == pattern


def policy_for(
    default: RetentionPolicy, overrides: Sequence[ScopeRetention], scope: str
) -> RetentionPolicy:
    """The policy of a scope: the first override whose pattern names it, else `default`."""
    for override in overrides:
        if matches(override.scope_pattern, scope):
            return override.policy
    return default


def check_pattern(pattern: str, field: str) -> None:
    if not pattern or len(pattern) > MAX_SCOPE_PATTERN_CHARS or not _PATTERN.fullmatch(pattern):
        raise InvalidArgument(
            f"{field} must be 1 to {MAX_SCOPE_PATTERN_CHARS} characters from "
            "[A-Za-z0-9._:@/-], optionally ending in one '*' (e.g. 'dm:*', 'guild:123/*'); "
            f"got {quote(pattern)}",
            field=field,
        )


def check_policy(policy: RetentionPolicy, field: str) -> None:
    if not 0 <= policy.max_messages <= MAX_RETAINED_MESSAGES:
        raise InvalidArgument(
            f"{field}.max_messages must be 0 (no cap) to {MAX_RETAINED_MESSAGES:,}; "
            f"got {policy.max_messages}",
            field=f"{field}.max_messages",
        )
    if policy.ttl_us and not MIN_TTL_US <= policy.ttl_us <= MAX_TTL_US:
        raise InvalidArgument(
            f"{field}.ttl must be unset or zero (never expires), or 1 s to 3650 days; got "
            f"{policy.ttl_us / SECOND_US:g} s",
            field=f"{field}.ttl",
        )
    if policy.delete_overflow and not policy.max_messages:
        raise InvalidArgument(
            f"{field}.delete_overflow needs max_messages: without a cap nothing overflows",
            field=f"{field}.delete_overflow",
        )


def check_retention(
    policy: RetentionPolicy,
    overrides: Sequence[ScopeRetention],
    field: str = "agent",
) -> None:
    """INVALID_ARGUMENT naming the first bad field (`agent.retention.ttl`,
    `agent.retention_overrides[2].scope_pattern`, ...)."""
    check_policy(policy, f"{field}.retention")
    if len(overrides) > MAX_RETENTION_OVERRIDES:
        raise InvalidArgument(
            f"{field}.retention_overrides holds {len(overrides)} overrides; at most "
            f"{MAX_RETENTION_OVERRIDES}",
            field=f"{field}.retention_overrides",
        )
    seen: set[str] = set()
    for i, override in enumerate(overrides):
        where = f"{field}.retention_overrides[{i}]"
        check_pattern(override.scope_pattern, f"{where}.scope_pattern")
        if override.scope_pattern in seen:
            raise InvalidArgument(
                f"{where}.scope_pattern {quote(override.scope_pattern)} is given twice",
                field=f"{where}.scope_pattern",
            )
        seen.add(override.scope_pattern)
        check_policy(override.policy, f"{where}.policy")


def _policy_json(policy: RetentionPolicy) -> dict[str, Any]:
    return {
        "max_messages": policy.max_messages,
        "ttl_us": policy.ttl_us,
        "delete_overflow": policy.delete_overflow,
    }


def _policy_of(value: dict[str, Any]) -> RetentionPolicy:
    return RetentionPolicy(
        int(value.get("max_messages", 0)),
        int(value.get("ttl_us", 0)),
        bool(value.get("delete_overflow", False)),
    )


def retention_json(policy: RetentionPolicy, overrides: Sequence[ScopeRetention]) -> dict[str, Any]:
    """The part of an agent's settings JSON that holds retention (empty for the default,
    so agents without a policy store exactly what they stored before)."""
    out: dict[str, Any] = {}
    if policy != KEEP_EVERYTHING:
        out["retention"] = _policy_json(policy)
    if overrides:
        out["retention_overrides"] = [
            {"scope_pattern": o.scope_pattern, "policy": _policy_json(o.policy)} for o in overrides
        ]
    return out


def retention_of(settings: dict[str, Any]) -> tuple[RetentionPolicy, tuple[ScopeRetention, ...]]:
    """The retention in an agent's settings JSON (the default when it holds none)."""
    policy = _policy_of(settings["retention"]) if "retention" in settings else KEEP_EVERYTHING
    overrides = tuple(
        ScopeRetention(str(o["scope_pattern"]), _policy_of(o.get("policy", {})))
        for o in settings.get("retention_overrides", [])
    )
    return policy, overrides


def has_retention(settings_json: str) -> bool:
    """Whether an agent's settings JSON holds any retention (the sweep's filter)."""
    settings = json.loads(settings_json)
    return "retention" in settings or bool(settings.get("retention_overrides"))
