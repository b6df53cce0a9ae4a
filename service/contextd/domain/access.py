"""API keys: who may call, as which tenant, with which role.

A key is `ctxd_<key id>_<secret>`. The key id (public, 16 hex characters) finds the
record; the secret (32 random bytes, URL-safe base64) is shown once, when the key is
created, and only its SHA-256 is stored. A plain hash suffices because the secret is 256
random bits, not a password: there is nothing to guess, so a slow hash would only slow
every call. Comparisons are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from contextvars import ContextVar
from dataclasses import dataclass
from enum import IntEnum

from contextd.domain.errors import InvalidArgument, NotFound, Unauthenticated
from contextd.domain.validation import quote

KEY_PREFIX = "ctxd"
_TOKEN = re.compile(r"ctxd_([0-9a-f]{16})_([A-Za-z0-9_-]{43})")
MAX_KEY_NAME_CHARS = 128


class KeyRole(IntEnum):
    """What a key may do; each role includes the ones below it. The values equal the
    proto enum's and are what the store keeps."""

    READ = 1  # reads, lists, builds
    WRITE = 2  # and every write of contexts: agents, appends, clears, status, compaction
    ADMIN = 3  # and the keys of its tenant


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    tenant: str
    role: KeyRole
    name: str
    create_time_us: int
    revoke_time_us: int | None = None

    @property
    def active(self) -> bool:
        return self.revoke_time_us is None


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling: the tenant every call of theirs is confined to, their role, and
    the key they used ("" for the local operator of a server without keys)."""

    tenant: str
    role: KeyRole
    key_id: str = ""


def new_secret() -> tuple[str, str, str]:
    """A fresh key: (key id, the token to hand out once, the hash to store)."""
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    return key_id, f"{KEY_PREFIX}_{key_id}_{secret}", secret_hash(secret)


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_token(token: str) -> tuple[str, str] | None:
    """(key id, secret) of a well-formed token, else None."""
    match = _TOKEN.fullmatch(token)
    return (match.group(1), match.group(2)) if match else None


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(secret_hash(secret), stored_hash)


def check_key_name(name: str) -> str:
    if len(name) > MAX_KEY_NAME_CHARS or any(c < " " for c in name):
        raise InvalidArgument(
            f"key name must be at most {MAX_KEY_NAME_CHARS} printable characters",
            field="name",
        )
    return name


def key_not_found(key_id: str) -> NotFound:
    return NotFound(f"no API key {quote(key_id)} in this tenant", reason="KEY_NOT_FOUND")


_KEYLESS_REFUSED = "this server needs an API key: send `authorization: Bearer <key>`"
_KEY_REFUSED = "the API key is unknown or revoked"


def keyless_refused() -> Unauthenticated:
    """The refusal of a call without a key by a server that has an active key."""
    return Unauthenticated(_KEYLESS_REFUSED)


def key_refused() -> Unauthenticated:
    """The refusal of a call whose key is unknown, revoked or does not match."""
    return Unauthenticated(_KEY_REFUSED)


class KeyRefused(Unauthenticated):
    """A store found, in the write of a call admitted before its key was confirmed
    (`owed_key_check`), that the key no longer stands: nothing of the call was written."""


def refused(caller: Caller) -> KeyRefused:
    """The refusal of `caller`, admitted unconfirmed, whose key (or, without one, the
    absence of any active key) no longer stands."""
    return KeyRefused(_KEY_REFUSED if caller.key_id else _KEYLESS_REFUSED)


# The caller of the running call whose key the store has not confirmed yet: set (by the
# gRPC edge, api/auth.py) only for a call admitted from what this replica knows of its
# key, on a store whose writes confirm it (`confirms_owed_keys`); None otherwise.
#
# Why: on PostgreSQL a key (or, without one, "no active key exists") is a row any replica
# may revoke (or create) at any moment, so every call read it: a round trip of its own
# before the handler. A key's tenant, role and secret never change, only whether it is
# active; so a replica that saw a key active admits it again at once, and the call's own
# write checks, in its transaction (for a one-message append, in its one statement), that
# the key is still active; a call that writes nothing is checked before it is answered.
# A key revoked before a call begins is refused either way, and nothing of that call is
# written.
_OWED_KEY_CHECK: ContextVar[Caller | None] = ContextVar("contextd_owed_key_check", default=None)


def owed_key_check() -> Caller | None:
    """The caller whose key this call's first write must confirm (None: nothing owed)."""
    return _OWED_KEY_CHECK.get()


def owe_key_check(caller: Caller | None) -> object:
    """Record (or, with None, clear) the check owed for the running call; returns the
    token that restores the state before."""
    return _OWED_KEY_CHECK.set(caller)


def key_check_paid() -> None:
    """The running call's key was confirmed (or refused): nothing is owed any more."""
    _OWED_KEY_CHECK.set(None)


def key_check_answered(owed: Caller, stands: bool) -> None:
    """A store read whether `owed`'s key still stands: nothing is owed any more, and
    KeyRefused when it does not."""
    key_check_paid()
    if not stands:
        raise refused(owed)


def restore_key_check(token: object) -> None:
    _OWED_KEY_CHECK.reset(token)  # type: ignore[arg-type]
