"""The SQL of the reads of messages that several of the store's modules send.

The statements that list a thread's messages (`SELECT_MESSAGES`, `window_predicate`), the
build's window reads (`WINDOW_BOUNDS`, `WINDOW_PAGE`, `PAGE_IDS`, `WINDOW_MESSAGES`,
`NARROW_COLUMNS`, `UNREAD_ORPHANS`) and the appended rows' read (`APPENDED_MESSAGES`,
`APPENDED_JOIN`, at most `APPENDED_ROWS` rows) are read by the appends' and listing's
module (messages.py), the build's first read (build_reads.py), the window's reads
(window_reads.py, window_pages.py), threads.py and search.py. They live apart so that
each of those takes them from one place, the SQL is read in one room, and no reader
imports the appends' module for them; with them, the two helpers that read their
parameters and results (`context_tenant`, `page_table`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from contextd.adapters.postgres.message_cache import MESSAGE_TAG
from contextd.adapters.rows import MESSAGE_COLUMNS
from contextd.domain.window import WindowSpec
from contextd.ports.store import ContextRef

_M_COLUMNS = ", ".join("m." + c.strip() for c in MESSAGE_COLUMNS.split(","))
# MESSAGE_COLUMNS names agent, scope and thread, which live in the thread's row here.
SELECT_MESSAGES = (
    _M_COLUMNS.replace("m.agent", "t.agent")
    .replace("m.scope", "t.scope")
    .replace("m.thread", "t.thread")
)


# MESSAGE_COLUMNS without agent, scope and thread (positions 2 to 4), which a read of
# one thread's messages takes from its key.
_KEYLESS_MESSAGES = ", ".join(
    c for c in _M_COLUMNS.split(", ") if c not in ("m.agent", "m.scope", "m.thread")
)


# `window_messages_from`: every row's tag, whether the replica sent it (it holds that
# message at that version), and the columns of the others. The subquery (kept apart by
# OFFSET 0) computes each row's tag once; `m.*` there instead cost four times the time.
WINDOW_MESSAGES = (
    "SELECT q.tag, q.held, "
    + ", ".join(
        f"CASE WHEN q.held THEN NULL ELSE q.{c[2:]} END" for c in _KEYLESS_MESSAGES.split(", ")
    )
    + f" FROM (SELECT {_KEYLESS_MESSAGES}, {MESSAGE_TAG} AS tag, "
    f"{MESSAGE_TAG} = ANY(string_to_array(%s, ' ')) AS held "
    "FROM messages m WHERE m.tenant = %s AND m.context_id = %s AND m.sequence >= %s "
    "AND m.id BETWEEN %s AND %s AND {predicate} AND NOT m.is_summary "
    "ORDER BY m.sequence OFFSET 0) q ORDER BY q.sequence"
)


def window_predicate(window: WindowSpec, thread_alias: str | None = "t") -> tuple[str, list[int]]:
    """The SQL of "message m is in the window": the same definition as the embedded
    engine's (see contextd.domain.window). With a threads alias, each thread's own clear
    marker applies where it is later than the window's."""
    if thread_alias:
        clear = f"greatest(%s::bigint, coalesce({thread_alias}.last_clear_us, %s::bigint))"
        params = [window.clear_after_us, window.clear_after_us]
    else:
        clear, params = "%s::bigint", [window.clear_after_us]
    sql = f"m.create_time_us > {clear} AND coalesce(m.source_time_us, m.create_time_us) > %s"
    params.append(window.age_after_us)
    if window.retains:
        # Retention compares with the thread's newest message, which its row (kept
        # current by every append) records.
        if thread_alias:
            row = f"{thread_alias}.{{}}"
        else:
            row = (
                "(SELECT x.{} FROM threads x WHERE x.tenant = m.tenant "
                "AND x.context_id = m.context_id)"
            )
        if window.expire_after_us is not None:
            sql += f" AND {row.format('last_message_time_us')} > %s"
            params.append(window.expire_after_us)
        if window.max_messages:
            sql += f" AND coalesce(m.group_start, m.sequence) > {row.format('last_sequence')} - %s"
            params.append(window.max_messages)
    return f"({sql})", params


# The columns `window_columns` reads, with the function that encodes each as binary.
NARROW_COLUMNS = (
    ("int8send", "id"),
    ("int2send", "role"),
    ("int4send", "token_count"),
    ("int4send", "chars"),
    ("int8send", "group_id"),
    ("int8send", "sequence"),
)

# `window_bounds`: the thread's row; its oldest stored message (with message_count, holes
# show); the window's first message (the first commit after the window's bounds; commit
# times never go back within a thread) with the counts before it; the newest message's
# ordinal; the summary's last message, if in the thread, and the message after it.
WINDOW_BOUNDS = (
    """
WITH s AS MATERIALIZED (
    -- by (tenant, id) alone: no plan may look for it along the thread
    SELECT m.context_id, m.sequence, m.ordinal, m.tools_total FROM messages m
    WHERE m.tenant = %s AND m.id = %s AND NOT m.is_summary
)
SELECT t.last_sequence, t.totals_through, t.message_count, t.min_source_time_us IS NULL,
       (SELECT min(x.sequence) FROM messages x
         WHERE x.tenant = t.tenant AND x.context_id = t.context_id),
       f.sequence, f.id, f.ordinal, f.tools_total - f.tool::int,
       (SELECT x.ordinal FROM messages x WHERE x.tenant = t.tenant
         AND x.context_id = t.context_id AND NOT x.is_summary
         ORDER BY x.sequence DESC LIMIT 1),
       s.sequence, s.ordinal, s.tools_total, a.id, a.sequence,
       g.context_id, g.ordinal, p.oldest_ordinal, p.ids, p.roles, p.tokens, p.chars, p.groups,
       p.sequences, p.ordinals, p.tools, p.tags, p.fresh, f.create_time_us
FROM threads t
LEFT JOIN LATERAL (
    SELECT m.sequence, m.id, m.ordinal, m.tools_total, m.create_time_us,
           (m.group_id >= 0 OR m.role = 4) AS tool
    FROM messages m
    WHERE m.tenant = t.tenant AND m.context_id = t.context_id
      AND m.create_time_us > %s AND NOT m.is_summary
    ORDER BY m.create_time_us, m.sequence LIMIT 1) f ON true
LEFT JOIN s ON s.context_id = t.context_id
LEFT JOIN LATERAL (
    SELECT m.id, m.sequence FROM messages m
    WHERE m.tenant = t.tenant AND m.context_id = t.context_id
      AND m.sequence > s.sequence AND NOT m.is_summary
    ORDER BY m.sequence LIMIT 1) a ON true
LEFT JOIN LATERAL (
    -- the first page: the newest rows of the window after the summary; with each row's
    -- tag, and the columns of those whose tag the replica did not send (message_cache.py)
    SELECT min(q.id) AS oldest_id, min(q.ordinal) AS oldest_ordinal, """
    + ", ".join(
        f"coalesce(string_agg({send}({column}), ''::bytea ORDER BY sequence DESC), "
        f"''::bytea) AS {name}"
        for send, column, name in (
            ("int8send", "id", "ids"),
            ("int2send", "role", "roles"),
            ("int4send", "token_count", "tokens"),
            ("int4send", "chars", "chars"),
            ("int8send", "group_id", "groups"),
            ("int8send", "sequence", "sequences"),
            ("int8send", "coalesce(ordinal, -1)", "ordinals"),
            ("int8send", "coalesce(tools_total, -1)", "tools"),
        )
    )
    + """,
           array_agg(q.tag ORDER BY q.sequence DESC) AS tags,
           json_agg(json_build_array(q.tag, """
    + ", ".join("q." + c[2:] for c in _KEYLESS_MESSAGES.split(", "))
    + """) ORDER BY q.sequence DESC) FILTER (WHERE NOT q.held) AS fresh
    -- each row's tag computed once (in q0), then looked up among those sent
    FROM (SELECT q0.*, q0.tag IN (SELECT unnest(string_to_array(%s, ' '))) AS held
          FROM (SELECT """
    + _KEYLESS_MESSAGES
    + """, m.chars, m.ordinal, m.tools_total, """
    + MESSAGE_TAG
    + """ AS tag
          FROM messages m
          WHERE m.tenant = t.tenant AND m.context_id = t.context_id AND NOT m.is_summary
            AND m.sequence >= CASE WHEN s.sequence >= f.sequence
                                   THEN coalesce(a.sequence, 9223372036854775807)
                                   ELSE f.sequence END
          ORDER BY m.sequence DESC LIMIT %s) q0) q) p ON true
LEFT JOIN LATERAL (
    -- the message `held` ids before the page's oldest, by (tenant, id) alone
    SELECT m.context_id, m.ordinal FROM messages m
    WHERE m.tenant = t.tenant
      AND m.id = p.oldest_id - least(%s, p.oldest_ordinal - f.ordinal)) g ON true
WHERE t.tenant = %s AND t.context_id = %s
"""
)

# Its results come in binary (the page's arrays are bytea: half the bytes of their hex
# text, and no decoding). Sent without its comments and runs of blanks: psycopg keeps its
# conversion of a query of at most 4,096 characters (this one is longer as written), and
# the server parses less.
WINDOW_BOUNDS = " ".join(re.sub(r"--[^\n]*", "", WINDOW_BOUNDS).split())

# `window_page`: the narrow columns and running counts of the newest rows of a range,
# newest first (see `page_table`).
WINDOW_PAGE = (
    "SELECT "
    + ", ".join(
        f"coalesce(string_agg({send}({column}), ''::bytea ORDER BY sequence DESC), ''::bytea)"
        for send, column in (
            *NARROW_COLUMNS,
            ("int8send", "coalesce(ordinal, -1)"),
            ("int8send", "coalesce(tools_total, -1)"),
        )
    )
    + " FROM (SELECT id, role, token_count, chars, group_id, sequence, ordinal, tools_total "
    "FROM messages WHERE tenant = %s AND context_id = %s AND sequence >= %s AND sequence < %s "
    "AND NOT is_summary ORDER BY sequence DESC LIMIT %s) m"
)

PAGE_IDS = (
    "SELECT coalesce(string_agg(int8send(id), ''::bytea ORDER BY sequence DESC), ''::bytea), "
    "coalesce(string_agg(int8send(sequence), ''::bytea ORDER BY sequence DESC), ''::bytea), "
    "coalesce(string_agg(int8send(coalesce(ordinal, -1)), ''::bytea ORDER BY sequence DESC), "
    "''::bytea) "
    "FROM (SELECT id, sequence, ordinal FROM messages WHERE tenant = %s AND context_id = %s "
    "AND sequence >= %s AND sequence < %s AND NOT is_summary ORDER BY sequence DESC LIMIT %s) m"
)

# `appended_messages`: the thread's rows after a sequence, whole, oldest first (one more
# than it takes, to tell that there are more).
APPENDED_MESSAGES = (
    f"SELECT m.chars, {_KEYLESS_MESSAGES} FROM messages m WHERE m.tenant = %s "
    "AND m.context_id = %s "
    "AND m.sequence > %s ORDER BY m.sequence LIMIT %s"
)
# The most appended rows a build takes to extend a window it keeps (past it, it reads the
# window afresh).
APPENDED_ROWS = 64
# `APPENDED_MESSAGES`'s read joined to the thread's read of a build (`context_ref`): a row per
# appended row (the thread's columns repeated), or one with these NULL.
APPENDED_JOIN = (
    "LEFT JOIN LATERAL (SELECT * FROM messages x WHERE x.tenant = t.tenant "
    "AND x.context_id = t.context_id AND x.sequence > %s "
    # Outer alone: a filter once per thread row, so an unchanged thread probes nothing.
    "AND t.last_sequence > %s ORDER BY x.sequence LIMIT %s) x ON true "
)
APPENDED_COLUMNS = "x.chars, " + ", ".join("x." + c[2:] for c in _KEYLESS_MESSAGES.split(", "))
APPENDED_WIDTH = len(APPENDED_COLUMNS.split(", "))

# `window_unread_orphans`: the open tool rows of the range (schema version 13), and the
# results in it whose call is before its start, which lie within the thread's tool_span
# rows of that start (none is looked for past MAX_TOOL_SPAN: the build reads it all).
UNREAD_ORPHANS = """
SELECT t.tool_span,
       (SELECT coalesce(string_agg(int8send(u.id), ''::bytea ORDER BY u.sequence), ''::bytea)
        FROM (SELECT o.id, o.sequence FROM tool_open o
              WHERE o.tenant = t.tenant AND o.context_id = t.context_id
                AND o.sequence >= %(from)s AND o.sequence < %(before)s
              UNION
              SELECT m.id, m.sequence FROM messages m
              WHERE m.tenant = t.tenant AND m.context_id = t.context_id
                AND m.sequence >= %(from)s AND m.sequence < %(before)s
                AND m.sequence <= %(from)s + t.tool_span AND t.tool_span <= %(max_span)s
                AND m.role = 4 AND NOT m.is_summary AND m.group_id >= 0
                AND m.group_id <> m.id AND m.group_start < %(from)s) u)
FROM threads t WHERE t.tenant = %(tenant)s AND t.context_id = %(context)s
"""


def context_tenant(context: ContextRef) -> str:
    assert context.key is not None, "a PostgreSQL ContextRef carries its key"
    return context.key.tenant


def page_table(row: Sequence[Any]) -> pa.Table:
    """A page's binary arrays (see `WINDOW_PAGE`) as the Arrow table `window_page` returns.
    They come newest first, the order the rows are read in along the primary key, so
    PostgreSQL aggregates them without a sort; each column is reversed here."""
    ids, roles, tokens, chars, groups, sequences, ordinals, tools = (bytes(v) for v in row)
    return pa.table(
        {
            "id": pa.array(np.frombuffer(ids, ">i8")[::-1].astype(np.int64)),
            "role": pa.array(np.frombuffer(roles, ">i2")[::-1].astype(np.uint8)),
            "token_count": pa.array(np.frombuffer(tokens, ">i4")[::-1].astype(np.uint64)),
            "chars": pa.array(np.frombuffer(chars, ">i4")[::-1].astype(np.uint64)),
            "group_id": pa.array(np.frombuffer(groups, ">i8")[::-1].astype(np.int64)),
            "sequence": pa.array(np.frombuffer(sequences, ">i8")[::-1].astype(np.int64)),
            "ordinal": pa.array(np.frombuffer(ordinals, ">i8")[::-1].astype(np.int64)),
            "tools_total": pa.array(np.frombuffer(tools, ">i8")[::-1].astype(np.int64)),
        }
    )
