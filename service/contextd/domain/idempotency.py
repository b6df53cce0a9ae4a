"""Retry-safe writes: a request id remembered with the response of the write it made.

A client that retries a write (its connection broke, the call timed out, the server was
restarting) cannot know whether the first attempt committed. With a `request_id`, the
store records (tenant, request_id) with a fingerprint of the request and a payload from
which the first response is rebuilt, in the same transaction as the write itself: either
both are durable or neither is. A retry then writes nothing and gets the first response;
the same id with a different request is refused, since answering it with the first
response would be wrong and writing it would break the first call's guarantee.

The payload is opaque bytes here: the layer that wrote it reads it back (the API layer
stores the serialized response message; compaction stores the id of its summary).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contextd.domain.errors import InvalidArgument

MAX_REQUEST_ID_CHARS = 128
# Records live at least this long: a client's retries all happen well inside it.
RETENTION_US = 24 * 3600 * 1_000_000
# The writer removes older records at most this many per pass, so a pass holds it for
# milliseconds; a pass that found a full chunk makes the next one come sooner.
CLEANUP_CHUNK = 1000
CLEANUP_EVERY_US = 60 * 1_000_000
CLEANUP_BACKLOG_EVERY_US = 1_000_000
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]+")


def record_key(tenant: str, request_id: str) -> str:
    """The one-column key of a record: the request id, a tab, the tenant.

    A request id never holds a tab (it is printable ASCII), so the first tab ends it and
    two (tenant, request_id) pairs never share a key. One column, because the store finds
    a record by an index only on a single-column key: a lookup over the pair scanned the
    whole table (milliseconds per write at a day of records, on the one writer).
    """
    return f"{request_id}\t{tenant}"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What a write with a request id records, and how its response is kept.

    `encode` turns the write's result (what the store's write returns: an Agent, a clear
    time, an append's receipts...) into the payload stored with the id.
    """

    tenant: str
    request_id: str
    method: str
    fingerprint: str
    encode: Callable[[Any], bytes]

    @property
    def key(self) -> str:
        return record_key(self.tenant, self.request_id)

    def with_encoder(self, encode: Callable[[Any], bytes]) -> RequestRecord:
        return RequestRecord(self.tenant, self.request_id, self.method, self.fingerprint, encode)


@dataclass(frozen=True, slots=True)
class Remembered:
    """A recorded request: what it was and the payload of its response, or the write's
    result itself (`result`, when not None), from which `replay` encodes the payload with
    the retry's own encoder: a store that records a write in the very statement that
    makes it cannot run the encoder on values the database assigns (see the PostgreSQL
    one-statement append)."""

    method: str
    fingerprint: str
    payload: bytes
    result: Any = None


class AlreadyDone(Exception):
    """The write was done before under the same request id: here is its payload."""

    def __init__(self, payload: bytes) -> None:
        super().__init__("request already done")
        self.payload = payload


def check_request_id(request_id: str) -> str:
    """The request id, if it is 1 to 128 printable ASCII characters (space included, as
    the contract says); INVALID_ARGUMENT otherwise."""
    if len(request_id) > MAX_REQUEST_ID_CHARS or not _PRINTABLE_ASCII.fullmatch(request_id):
        raise InvalidArgument(
            f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters "
            "(e.g. a UUID)",
            field="request_id",
        )
    return request_id


def replay(record: RequestRecord, found: Remembered) -> bytes:
    """The payload of the first call, or REQUEST_ID_REUSED when `record` is another
    request under the same id."""
    if found.method != record.method or found.fingerprint != record.fingerprint:
        # "contextd.v1.AppendMessagesRequest" -> "AppendMessages"
        first = found.method.rsplit(".", 1)[-1].removesuffix("Request")
        raise InvalidArgument(
            f"request_id was already used for a different {first} "
            "request; use a new request_id for a new request",
            reason="REQUEST_ID_REUSED",
            field="request_id",
        )
    if found.result is not None:
        return record.encode(found.result)
    return found.payload
