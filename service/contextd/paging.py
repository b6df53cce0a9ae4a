"""Opaque page tokens.

A token carries the position after which the next page starts, the window start fixed by
the first page, and a fingerprint of the request it was issued for, so that a token reused
with other parameters is rejected instead of silently returning a wrong page.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from contextd.errors import InvalidArgument

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


@dataclass(frozen=True, slots=True)
class PageToken:
    position: tuple[Any, ...]
    window_start_us: int | None = None


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


def encode(token: PageToken, params: tuple[Any, ...]) -> str:
    body = {"p": list(token.position), "w": token.window_start_us, "f": _fingerprint(params)}
    return base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).decode()


def decode(raw: str, params: tuple[Any, ...], shape: tuple[type, ...]) -> PageToken | None:
    """The decoded token, or None for the first page; INVALID_ARGUMENT when malformed.

    `shape` is the type of each element of the position the list pages by (e.g. (int,
    int) for (time, id)): a token is only base64 JSON, so one edited by hand must fail
    here, not later as an internal error.
    """
    if not raw:
        return None
    try:
        body = json.loads(base64.urlsafe_b64decode(raw.encode()))
        position = tuple(body["p"])
        window = body["w"]
        fingerprint = body["f"]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(
            "page_token is not a token this server issued", field="page_token"
        ) from exc
    well_formed = (
        len(position) == len(shape)
        and all(type(v) is t for v, t in zip(position, shape, strict=True))
        and (window is None or type(window) is int)
    )
    if not well_formed:
        raise InvalidArgument("page_token is not a token this server issued", field="page_token")
    if fingerprint != _fingerprint(params):
        raise InvalidArgument(
            "page_token was issued for a request with other parameters", field="page_token"
        )
    return PageToken(position=position, window_start_us=window)


def cut_page(
    rows: Sequence[T],
    size: int,
    params: tuple[Any, ...],
    position_of: Callable[[T], tuple[Any, ...]],
    window_start_us: int | None = None,
) -> tuple[list[T], str]:
    """The page out of `size + 1` rows read, and the token of the next page ("" on the
    last): reading one row more than the page tells whether another page exists."""
    if len(rows) <= size:
        return list(rows), ""
    page = list(rows[:size])
    return page, encode(PageToken(position_of(page[-1]), window_start_us), params)
