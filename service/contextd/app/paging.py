"""Opaque, signed page tokens and page cutting.

A token carries the position after which the next page starts, the window fixed by the
first page (its clear marker and age limit), and a fingerprint of the request it was
issued for, so that a token reused with other parameters is rejected instead of silently
returning a wrong page. Tokens are signed with HMAC-SHA256 under a key kept in the data
directory: a client can read a token (it is only base64 JSON) but cannot forge or edit
one, and what a token decodes to is range-checked anyway before any query sees it.

Pages stop at a count and at a byte size (AIP-158 allows short pages), so a page of
messages near the size limit never becomes a response of hundreds of megabytes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from contextd.domain.errors import InvalidArgument

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
# A page stops once its items hold this many bytes (the last one may cross it).
# Below gRPC clients' default 4 MiB receive limit even with one 1 MiB message over it.
MAX_PAGE_BYTES = 2 << 20
_INT64 = (-(1 << 63), (1 << 63) - 1)
_MAX_POSITION_CHARS = 512
_NOT_OURS = "page_token is not a token this server issued"


@dataclass(frozen=True, slots=True)
class PageToken:
    position: tuple[Any, ...]
    # The window of the first page, (clear marker, age limit) in microseconds.
    window: tuple[int, int] | None = None


def page_size(requested: int) -> int:
    """The page size to use: the default for 0, at most MAX_PAGE_SIZE."""
    if requested < 0:
        raise InvalidArgument(
            f"page_size must not be negative (got {requested})", field="page_size"
        )
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    return min(requested, MAX_PAGE_SIZE)


def _fingerprint(params: tuple[Any, ...]) -> str:
    return hashlib.sha256(json.dumps(params).encode()).hexdigest()[:16]


def _in_range(value: object, kind: type) -> bool:
    if type(value) is not kind:
        return False
    if isinstance(value, int):
        return _INT64[0] <= value <= _INT64[1]
    if isinstance(value, str):
        return len(value) <= _MAX_POSITION_CHARS
    return True


class PageTokens:
    """Issues and checks the page tokens of one server's data (one signing key)."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _sign(self, body: bytes) -> str:
        return hmac.new(self._key, body, hashlib.sha256).hexdigest()[:32]

    def encode(self, token: PageToken, params: tuple[Any, ...]) -> str:
        body = json.dumps(
            {
                "p": list(token.position),
                "w": None if token.window is None else list(token.window),
                "f": _fingerprint(params),
            },
            separators=(",", ":"),
        ).encode()
        signed = body + b"." + self._sign(body).encode()
        return base64.urlsafe_b64encode(signed).decode()

    def decode(
        self, raw: str, params: tuple[Any, ...], shape: tuple[type, ...]
    ) -> PageToken | None:
        """The decoded token, or None for the first page; INVALID_ARGUMENT when it was not
        issued by this server, was edited, or was issued for other request parameters.

        `shape` is the type of each element of the position the list pages by (e.g. (int,
        int) for (time, id)).
        """
        if not raw:
            return None
        if len(raw) > 4 * _MAX_POSITION_CHARS:
            raise InvalidArgument(_NOT_OURS, field="page_token", reason="INVALID_PAGE_TOKEN")
        try:
            body, _, signature = base64.urlsafe_b64decode(raw.encode()).rpartition(b".")
            if not hmac.compare_digest(signature, self._sign(body).encode()):
                raise ValueError("bad signature")
            decoded = json.loads(body)
            position = tuple(decoded["p"])
            window = decoded["w"]
            fingerprint = decoded["f"]
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(
                _NOT_OURS, field="page_token", reason="INVALID_PAGE_TOKEN"
            ) from exc
        well_formed = (
            len(position) == len(shape)
            and all(_in_range(v, t) for v, t in zip(position, shape, strict=True))
            and (
                window is None
                or (
                    type(window) is list
                    and len(window) == 2
                    and all(_in_range(v, int) for v in window)
                )
            )
        )
        if not well_formed:
            raise InvalidArgument(_NOT_OURS, field="page_token", reason="INVALID_PAGE_TOKEN")
        if fingerprint != _fingerprint(params):
            raise InvalidArgument(
                "page_token was issued for a request with other parameters",
                field="page_token",
                reason="INVALID_PAGE_TOKEN",
            )
        return PageToken(position=position, window=None if window is None else tuple(window))

    def cut(
        self,
        rows: Sequence[T],
        size: int,
        params: tuple[Any, ...],
        position_of: Callable[[T], tuple[Any, ...]],
        window: tuple[int, int] | None = None,
        bytes_of: Callable[[T], int] | None = None,
    ) -> tuple[list[T], str]:
        """The page out of `size + 1` rows read, and the token of the next page ("" on
        the last): reading one row more than the page tells whether another page exists.
        With `bytes_of`, the page also stops after the item that reaches MAX_PAGE_BYTES."""
        end = min(len(rows), size)
        if bytes_of is not None:
            total = 0
            for i in range(end):
                total += bytes_of(rows[i])
                if total >= MAX_PAGE_BYTES:
                    end = i + 1
                    break
        if end >= len(rows):
            return list(rows), ""
        page = list(rows[:end])
        return page, self.encode(PageToken(position_of(page[-1]), window), params)
