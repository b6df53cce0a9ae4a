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
from dataclasses import dataclass
from enum import IntEnum

from contextd.domain.errors import InvalidArgument, NotFound
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
