"""Scopes: the isolation boundary inside an agent, as one canonical string.

The wire has typed scopes (a user in a guild's channel, a user's direct messages) next to
free-form keys. The domain and the store keep one string per scope, so the typed kinds get
reserved prefixes that a free-form key may not use: two different scopes can never share a
string, and nothing falls back from one kind to another. The empty string is the agent's
default scope, a scope of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from contextd.domain.errors import InvalidArgument
from contextd.domain.validation import check_name, quote

DEFAULT_SCOPE = ""
MAX_SCOPE_ID_CHARS = 64
_ID = re.compile(r"[A-Za-z0-9._@\-]+")
_CHANNEL = re.compile(r"guild:([^/]+)/channel:([^/]+)/user:([^/]+)")
_DIRECT = re.compile(r"dm:([^/]+)")
RESERVED_PREFIXES = ("guild:", "dm:")


@dataclass(frozen=True, slots=True)
class ChannelScope:
    guild_id: str
    channel_id: str
    user_id: str


@dataclass(frozen=True, slots=True)
class DirectMessageScope:
    user_id: str


@dataclass(frozen=True, slots=True)
class KeyScope:
    key: str


ScopeKind = ChannelScope | DirectMessageScope | KeyScope | None


def _check_id(value: str, field: str) -> str:
    if not value or len(value) > MAX_SCOPE_ID_CHARS or not _ID.fullmatch(value):
        raise InvalidArgument(
            f"{field} must be 1 to {MAX_SCOPE_ID_CHARS} characters from [A-Za-z0-9._@-]; "
            f"got {quote(value)}",
            field=field,
        )
    return value


def channel_scope(guild_id: str, channel_id: str, user_id: str, field: str = "scope") -> str:
    return (
        f"guild:{_check_id(guild_id, f'{field}.channel.guild_id')}"
        f"/channel:{_check_id(channel_id, f'{field}.channel.channel_id')}"
        f"/user:{_check_id(user_id, f'{field}.channel.user_id')}"
    )


def direct_message_scope(user_id: str, field: str = "scope") -> str:
    return f"dm:{_check_id(user_id, f'{field}.direct_message.user_id')}"


def key_scope(key: str, field: str = "scope") -> str:
    check_name(key, f"{field}.key")
    if key.startswith(RESERVED_PREFIXES):
        raise InvalidArgument(
            f"{field}.key may not start with 'guild:' or 'dm:' (reserved for the typed "
            "scopes channel and direct_message); use those fields",
            field=f"{field}.key",
        )
    return key


def parse(scope: str) -> ScopeKind:
    """The typed form of a canonical scope string (None for the default scope)."""
    if not scope:
        return None
    channel = _CHANNEL.fullmatch(scope)
    if channel:
        return ChannelScope(*channel.groups())
    direct = _DIRECT.fullmatch(scope)
    if direct:
        return DirectMessageScope(direct.group(1))
    return KeyScope(scope)
