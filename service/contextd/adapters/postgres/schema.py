"""The PostgreSQL schema, by version; `migrate` brings a database to the newest.

Each migration moves the schema from version N-1 to N in one transaction. Replicas that
start together take a transaction-scoped advisory lock first, so one migrates and the
others find the work done. Never edit a released migration; append a new one.

Every table leads with `tenant` in its primary key and its indexes (distributable by
tenant); times are integers of microseconds since the epoch, as in the domain.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

log = logging.getLogger(__name__)

# pg_advisory_xact_lock key of migrations: "ctxd" in ASCII.
MIGRATION_LOCK = 0x63747864

# What tool_open's insert trigger does with a statement's new rows (the end of its
# function): record the tool groups and results they open, drop the groups they
# answer, widen their threads' tool span. Version 13 made the function; 16 made it
# return first when no row can do any of that.
_TOOL_OPEN_INSERT_BODY = """\
                INSERT INTO tool_open
                SELECT n.tenant, n.context_id, n.sequence, n.id,
                       CASE WHEN n.role = 4 THEN 's' ELSE 'c' END
                FROM new_rows n
                WHERE NOT n.is_summary AND (
                    (n.role <> 4 AND n.group_id = n.id)
                    OR (n.role = 4 AND (n.group_id < 0 OR n.group_id = n.id
                        OR n.group_start IS NULL
                        OR EXISTS (SELECT 1 FROM messages h WHERE h.tenant = n.tenant
                            AND h.id = n.group_id AND h.role = 4))))
                ON CONFLICT DO NOTHING;
                DELETE FROM tool_open o USING new_rows n
                WHERE n.role = 4 AND NOT n.is_summary AND n.group_id >= 0
                  AND n.group_id <> n.id AND o.kind = 'c' AND o.tenant = n.tenant
                  AND o.context_id = n.context_id AND o.sequence = n.group_start
                  AND o.id = n.group_id;
                UPDATE threads t SET tool_span = s.span
                FROM (SELECT tenant, context_id, max(sequence - group_start) AS span
                      FROM new_rows
                      WHERE role = 4 AND NOT is_summary AND group_id >= 0 AND group_id <> id
                        AND group_start IS NOT NULL
                      GROUP BY tenant, context_id) s
                WHERE t.tenant = s.tenant AND t.context_id = s.context_id
                  AND s.span > t.tool_span;
                RETURN NULL;
            END
            $$
            """

MIGRATIONS: list[tuple[int, list[str]]] = [
    (
        1,
        [
            """
            CREATE TABLE agents (
                tenant text NOT NULL,
                name text NOT NULL,
                system_prompt text NOT NULL,
                docs_json text NOT NULL,
                rolling_window_us bigint NOT NULL,
                create_time_us bigint NOT NULL,
                update_time_us bigint NOT NULL,
                last_clear_us bigint NOT NULL,
                model text NOT NULL,
                settings_json text NOT NULL,
                PRIMARY KEY (tenant, name)
            )
            """,
            # One row per (tenant, agent, scope, thread). An append locks it: it numbers
            # the thread's messages (last_sequence) and carries the counters, so every
            # replica reads them current.
            """
            CREATE TABLE threads (
                tenant text NOT NULL,
                context_id bigint NOT NULL,
                agent text NOT NULL,
                scope text NOT NULL,
                thread text NOT NULL,
                create_time_us bigint NOT NULL,
                last_message_time_us bigint NOT NULL,
                message_count bigint NOT NULL,
                token_estimate bigint NOT NULL,
                last_clear_us bigint,
                last_sequence bigint NOT NULL,
                min_source_time_us bigint,
                latest_summary_id bigint NOT NULL DEFAULT 0,
                PRIMARY KEY (tenant, context_id),
                UNIQUE (tenant, agent, scope, thread)
            )
            """,
            # Keyed by (tenant, context_id, sequence): a thread's window is one index
            # range, read newest first when a build stops at its budget.
            """
            CREATE TABLE messages (
                tenant text NOT NULL,
                context_id bigint NOT NULL,
                sequence bigint NOT NULL,
                id bigint NOT NULL,
                role smallint NOT NULL,
                content text NOT NULL,
                tool_calls text NOT NULL,
                tool_call_id text NOT NULL,
                external_id text NOT NULL,
                metadata text NOT NULL,
                token_estimate integer NOT NULL,
                create_time_us bigint NOT NULL,
                source_time_us bigint,
                token_count integer NOT NULL,
                tokenizer text NOT NULL,
                chars integer NOT NULL,
                group_id bigint NOT NULL,
                tool_call_ids text NOT NULL,
                is_summary boolean NOT NULL,
                first_summarized_id bigint NOT NULL,
                last_summarized_id bigint NOT NULL,
                PRIMARY KEY (tenant, context_id, sequence)
            )
            """,
            "CREATE UNIQUE INDEX messages_by_id ON messages (tenant, id)",
            # The tool_use message that declared each call id in a thread: a tool result
            # finds its group by one index lookup.
            """
            CREATE TABLE tool_calls (
                tenant text NOT NULL,
                context_id bigint NOT NULL,
                call_id text NOT NULL,
                message_id bigint NOT NULL,
                PRIMARY KEY (tenant, context_id, call_id)
            )
            """,
            """
            CREATE TABLE status_entries (
                tenant text NOT NULL,
                agent text NOT NULL,
                scope text NOT NULL,
                key text NOT NULL,
                kind smallint NOT NULL,
                state text NOT NULL,
                summary text NOT NULL,
                update_time_us bigint NOT NULL,
                expire_time_us bigint,
                PRIMARY KEY (tenant, agent, scope, key)
            )
            """,
            """
            CREATE TABLE events (
                tenant text NOT NULL,
                id bigint NOT NULL,
                agent text NOT NULL,
                scope text NOT NULL,
                thread text NOT NULL,
                type text NOT NULL,
                create_time_us bigint NOT NULL,
                data text NOT NULL,
                PRIMARY KEY (tenant, id)
            )
            """,
            "CREATE INDEX events_by_scope ON events (tenant, agent, scope, id)",
            """
            CREATE TABLE request_records (
                tenant text NOT NULL,
                request_id text NOT NULL,
                method text NOT NULL,
                fingerprint text NOT NULL,
                payload bytea NOT NULL,
                create_time_us bigint NOT NULL,
                PRIMARY KEY (tenant, request_id)
            )
            """,
            "CREATE INDEX request_records_by_time ON request_records (tenant, create_time_us)",
            # Ids are unique in the store and never reused (sequences never go back).
            # Keys the replicas share (e.g. the one that signs page tokens), under the
            # tenant "" (service-wide).
            """
            CREATE TABLE service_keys (
                tenant text NOT NULL,
                name text NOT NULL,
                value bytea NOT NULL,
                PRIMARY KEY (tenant, name)
            )
            """,
            "CREATE SEQUENCE message_ids",
            "CREATE SEQUENCE context_ids",
            "CREATE SEQUENCE event_ids",
        ],
    ),
    (
        2,
        [
            # The snapshot a restored message came from ("" for every other message).
            "ALTER TABLE messages ADD COLUMN restored_from text NOT NULL DEFAULT ''",
            # Snapshots, metadata and document together: replicas share nothing else.
            """
            CREATE TABLE snapshots (
                tenant text NOT NULL,
                id text NOT NULL,
                agent text NOT NULL,
                scope text NOT NULL,
                thread text NOT NULL,
                create_time_us bigint NOT NULL,
                description text NOT NULL,
                summary text NOT NULL,
                message_count bigint NOT NULL,
                window_start_us bigint,
                window_end_us bigint,
                threads_json text NOT NULL,
                size_bytes bigint NOT NULL,
                document bytea NOT NULL,
                PRIMARY KEY (tenant, id)
            )
            """,
            "CREATE INDEX snapshots_by_scope ON snapshots "
            "(tenant, agent, scope, create_time_us DESC, id DESC)",
        ],
    ),
    (
        3,
        [
            # API keys (see domain/access.py): looked up by key id on every call, so keyed
            # by it alone: a small table a Citus deployment keeps as a reference table.
            # (Version 2 is the snapshots'.)
            """
            CREATE TABLE api_keys (
                key_id text NOT NULL PRIMARY KEY,
                tenant text NOT NULL,
                role smallint NOT NULL,
                name text NOT NULL,
                secret_hash text NOT NULL,
                create_time_us bigint NOT NULL,
                revoke_time_us bigint
            )
            """,
            "CREATE INDEX api_keys_by_tenant ON api_keys (tenant, key_id)",
        ],
    ),
    (
        4,
        [
            # Retention (see domain/retention.py); the same as the embedded engine's
            # version 12: the sequence of the tool_use a message's tool group starts at,
            # and the sequence through which a thread's messages expired.
            "ALTER TABLE messages ADD COLUMN group_start bigint",
            """
            UPDATE messages m SET group_start = u.sequence
            FROM messages u
            WHERE m.group_id >= 0 AND u.tenant = m.tenant AND u.id = m.group_id
            """,
            "ALTER TABLE threads ADD COLUMN expired_through bigint NOT NULL DEFAULT 0",
        ],
    ),
    (
        5,
        [
            # Bytes of content, tool_calls and metadata (UTF-8) of each thread's messages,
            # kept current by every append in the thread row it already locks: a tenant's
            # stored bytes are the sum of its threads' and snapshots' sizes, and no append
            # waits on a row of the whole tenant (see domain/quota.py).
            "ALTER TABLE threads ADD COLUMN stored_bytes bigint NOT NULL DEFAULT 0",
            """
            UPDATE threads t SET stored_bytes = s.b
            FROM (SELECT tenant, context_id,
                         sum(octet_length(content) + octet_length(tool_calls)
                             + octet_length(metadata)) AS b
                  FROM messages GROUP BY tenant, context_id) s
            WHERE t.tenant = s.tenant AND t.context_id = s.context_id
            """,
        ],
    ),
    (
        6,
        [
            # Tool outputs kept aside (see tool_outputs.py): pointers, with results up to
            # the inline threshold in the row, larger ones as chunk rows of up to 1 MiB.
            # (Versions 4 and 5 are other features'.)
            """
            CREATE TABLE tool_outputs (
                tenant text NOT NULL,
                id text NOT NULL,
                output_key text NOT NULL,
                agent text NOT NULL,
                scope text NOT NULL,
                thread text NOT NULL,
                tool_name text NOT NULL,
                tool_description text NOT NULL,
                args_json text NOT NULL,
                task_id text,
                query_id text,
                size_bytes bigint NOT NULL,
                token_count bigint NOT NULL,
                create_time_us bigint NOT NULL,
                kind smallint NOT NULL,
                stored_inline boolean NOT NULL,
                stored_bytes bigint NOT NULL,
                sha256 text NOT NULL,
                inline_data bytea,
                compressed boolean NOT NULL,
                chunk_lengths text NOT NULL,
                index_text text NOT NULL,
                PRIMARY KEY (tenant, id)
            )
            """,
            "CREATE INDEX tool_outputs_by_scope ON tool_outputs "
            "(tenant, agent, scope, create_time_us, id)",
            """
            CREATE TABLE tool_output_chunks (
                tenant text NOT NULL,
                output_id text NOT NULL,
                seq integer NOT NULL,
                data bytea NOT NULL,
                PRIMARY KEY (tenant, output_id, seq)
            )
            """,
            # Chunks are compressed (or are not worth it) already.
            "ALTER TABLE tool_output_chunks ALTER COLUMN data SET STORAGE EXTERNAL",
        ],
    ),
    (
        7,
        [
            # Search over history (see search.py): each message's words, kept by
            # PostgreSQL itself on every insert, so every replica searches the same.
            # Runs of characters other than letters and digits become one space first;
            # 'simple' neither stems nor drops stop words (any language). The text is
            # cut so the tsvector stays under its 1 MB limit. The GIN index cannot lead
            # with tenant (that needs btree_gin); queries still name the tenant.
            "ALTER TABLE messages ADD COLUMN search_tsv tsvector GENERATED ALWAYS AS "
            "(to_tsvector('simple'::regconfig, regexp_replace(left(content, 196608) || ' ' "
            "|| left(tool_calls, 65536), '[^[:alnum:]]+', ' ', 'g'))) STORED",
            "CREATE INDEX messages_search ON messages USING gin (search_tsv)",
        ],
    ),
    (
        8,
        [
            # The same vector, no longer always computed by the database: an append
            # hands over the vectors it can make exactly (search_vector.py; PostgreSQL's
            # text parser was most of a batched append's cost) and this trigger computes
            # the version-7 expression for every other row, so every insert (of any
            # replica version) and every change of content stores the same vector.
            "ALTER TABLE messages ALTER COLUMN search_tsv DROP EXPRESSION",
            """
            CREATE FUNCTION contextd_search_tsv() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF TG_OP = 'UPDATE' OR NEW.search_tsv IS NULL THEN
                    NEW.search_tsv := to_tsvector('simple'::regconfig, regexp_replace(
                        left(NEW.content, 196608) || ' ' || left(NEW.tool_calls, 65536),
                        '[^[:alnum:]]+', ' ', 'g'));
                END IF;
                RETURN NEW;
            END
            $$
            """,
            "CREATE TRIGGER messages_search_tsv BEFORE INSERT OR UPDATE OF content, tool_calls "
            "ON messages FOR EACH ROW EXECUTE FUNCTION contextd_search_tsv()",
        ],
    ),
    (
        9,
        [
            # Running counts per thread, written at insert, so a build learns its
            # window's size, edges and tool rows from a few index lookups instead of
            # reading the window (see window_reads.py `window_bounds`): each message's count
            # of non-summary messages through it (ordinal) and of tool rows through it (a
            # tool group or a tool_result role; tools_total). The thread row carries the
            # totals and the sequence through which they are exact (totals_through): an
            # append of a replica that does not write them leaves it behind, and builds of
            # that thread then read the whole window as before. Commit times never go
            # back within a thread, so the index on them finds a window's first message.
            "ALTER TABLE messages ADD COLUMN ordinal bigint, ADD COLUMN tools_total bigint",
            """
            UPDATE messages m SET ordinal = s.o, tools_total = s.t
            FROM (SELECT tenant, context_id, sequence,
                         count(*) FILTER (WHERE NOT is_summary) OVER w AS o,
                         count(*) FILTER (WHERE NOT is_summary AND (group_id >= 0 OR role = 4))
                             OVER w AS t
                  FROM messages
                  WINDOW w AS (PARTITION BY tenant, context_id ORDER BY sequence)) s
            WHERE m.tenant = s.tenant AND m.context_id = s.context_id
              AND m.sequence = s.sequence
            """,
            "ALTER TABLE threads ADD COLUMN ordinal_total bigint NOT NULL DEFAULT 0, "
            "ADD COLUMN tools_total bigint NOT NULL DEFAULT 0, "
            "ADD COLUMN totals_through bigint NOT NULL DEFAULT 0",
            """
            UPDATE threads t SET ordinal_total = coalesce(s.o, 0), tools_total = coalesce(s.t, 0),
                totals_through = t.last_sequence
            FROM (SELECT x.tenant, x.context_id,
                         (SELECT max(ordinal) FROM messages m WHERE m.tenant = x.tenant
                            AND m.context_id = x.context_id) AS o,
                         (SELECT max(tools_total) FROM messages m WHERE m.tenant = x.tenant
                            AND m.context_id = x.context_id) AS t
                  FROM threads x) s
            WHERE t.tenant = s.tenant AND t.context_id = s.context_id
            """,
            "CREATE INDEX messages_by_time ON messages (tenant, context_id, create_time_us, "
            "sequence)",
        ],
    ),
    (
        12,
        [
            # Tool outputs of the thread stored at or before this time belong to a time
            # the thread had expired (an append after expiry sets it to the append's time
            # - ttl): reads leave them out and the sweep deletes them, as for messages up
            # to expired_through. (Versions 10 and 11 are other features'.)
            "ALTER TABLE threads ADD COLUMN outputs_expired_through_us bigint NOT NULL DEFAULT 0",
        ],
    ),
    (
        13,
        [
            # The tool rows a newest-first build cannot count from `tools_total`: which of
            # a window's unread rows are orphans (see window_reads.py `window_unread_orphans`).
            # tool_open holds each tool-using message none of whose results is stored yet
            # (kind 'c'; an answer removes it) and each tool_result that answers no
            # tool-using message of its thread (kind 's'); threads.tool_span is the
            # farthest any result of the thread lies after the message whose call it
            # answers, so a result whose call is before a given sequence lies within that
            # many rows after it. Triggers keep both, whichever replica writes.
            """
            CREATE TABLE tool_open (
                tenant text NOT NULL,
                context_id bigint NOT NULL,
                sequence bigint NOT NULL,
                id bigint NOT NULL,
                kind "char" NOT NULL,
                PRIMARY KEY (tenant, context_id, sequence)
            )
            """,
            "ALTER TABLE threads ADD COLUMN tool_span bigint NOT NULL DEFAULT 0",
            """
            INSERT INTO tool_open
            SELECT m.tenant, m.context_id, m.sequence, m.id, 'c' FROM messages m
            WHERE NOT m.is_summary AND m.role <> 4 AND m.group_id = m.id
              AND NOT EXISTS (SELECT 1 FROM messages r WHERE r.tenant = m.tenant
                  AND r.context_id = m.context_id AND r.group_id = m.id AND r.role = 4
                  AND r.id <> m.id AND NOT r.is_summary)
            UNION ALL
            SELECT m.tenant, m.context_id, m.sequence, m.id, 's' FROM messages m
            WHERE NOT m.is_summary AND m.role = 4
              AND (m.group_id < 0 OR m.group_id = m.id OR m.group_start IS NULL
                   OR EXISTS (SELECT 1 FROM messages h WHERE h.tenant = m.tenant
                       AND h.id = m.group_id AND h.role = 4))
            """,
            """
            UPDATE threads t SET tool_span = s.span
            FROM (SELECT tenant, context_id, max(sequence - group_start) AS span FROM messages
                  WHERE role = 4 AND NOT is_summary AND group_id >= 0 AND group_id <> id
                    AND group_start IS NOT NULL
                  GROUP BY tenant, context_id) s
            WHERE t.tenant = s.tenant AND t.context_id = s.context_id
            """,
            """
            CREATE FUNCTION contextd_tool_open_insert() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
"""
            + _TOOL_OPEN_INSERT_BODY,
            "CREATE TRIGGER messages_tool_open_insert AFTER INSERT ON messages "
            "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT "
            "EXECUTE FUNCTION contextd_tool_open_insert()",
            """
            CREATE FUNCTION contextd_tool_open_delete() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                DELETE FROM tool_open o USING old_rows d
                WHERE o.tenant = d.tenant AND o.context_id = d.context_id
                  AND o.sequence = d.sequence;
                RETURN NULL;
            END
            $$
            """,
            "CREATE TRIGGER messages_tool_open_delete AFTER DELETE ON messages "
            "REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT "
            "EXECUTE FUNCTION contextd_tool_open_delete()",
        ],
    ),
    (
        14,
        [
            # Every change to a thread's messages writes the thread's row in the same
            # transaction, so the row's version (xmin and ctid, which `context_ref` reads)
            # names the state of the thread's messages: a replica keeps a build's window
            # while the version it read it under is the one its snapshot reads (see
            # `WindowReadsMixin.build_token`). The service's writers all update the row
            # already (appends, retention's deletes, clears); these triggers make it hold
            # for any writer (an operator's UPDATE or DELETE too) and touch the row only
            # when this transaction has not written it yet, so an append (whose last
            # statement updates it) pays nothing for them.
            """
            CREATE FUNCTION contextd_touch_threads() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF TG_OP = 'TRUNCATE' THEN
                    UPDATE threads SET last_sequence = last_sequence;
                ELSIF TG_OP = 'DELETE' THEN
                    UPDATE threads t SET last_sequence = t.last_sequence
                    WHERE (t.tenant, t.context_id) IN (SELECT tenant, context_id FROM old_rows)
                      AND t.xmin::text <> (pg_current_xact_id()::text::bigint % 4294967296)::text;
                ELSE
                    UPDATE threads t SET last_sequence = t.last_sequence
                    WHERE (t.tenant, t.context_id) IN (SELECT tenant, context_id FROM new_rows)
                      AND t.xmin::text <> (pg_current_xact_id()::text::bigint % 4294967296)::text;
                END IF;
                RETURN NULL;
            END
            $$
            """,
            "CREATE TRIGGER messages_touch_threads_insert AFTER INSERT ON messages "
            "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT "
            "EXECUTE FUNCTION contextd_touch_threads()",
            "CREATE TRIGGER messages_touch_threads_update AFTER UPDATE ON messages "
            "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT "
            "EXECUTE FUNCTION contextd_touch_threads()",
            "CREATE TRIGGER messages_touch_threads_delete AFTER DELETE ON messages "
            "REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT "
            "EXECUTE FUNCTION contextd_touch_threads()",
            "CREATE TRIGGER messages_touch_threads_truncate AFTER TRUNCATE ON messages "
            "FOR EACH STATEMENT EXECUTE FUNCTION contextd_touch_threads()",
        ],
    ),
    (
        15,
        [
            # What else than appends changed a thread's messages: a counter each change
            # of its stored messages moves (an UPDATE or DELETE, a TRUNCATE, whoever
            # makes it: retention's sweep, a thread's deletion, an operator), and each
            # INSERT not made by the service's append (which writes the thread's row,
            # numbering the rows under its lock, before it inserts them). A replica that
            # read a thread's window at one value and finds it unchanged, with the same
            # clear and summary, knows the rows it read are stored as they were and only
            # rows after its last sequence were added: it reads just those and extends
            # the window it keeps (see window_reads.py `appended_messages`). An append pays
            # nothing for it (the INSERT trigger's row is written by then).
            "ALTER TABLE threads ADD COLUMN rewrites bigint NOT NULL DEFAULT 0",
            """
            CREATE OR REPLACE FUNCTION contextd_touch_threads() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                IF TG_OP = 'TRUNCATE' THEN
                    UPDATE threads SET rewrites = rewrites + 1;
                ELSIF TG_OP = 'DELETE' THEN
                    UPDATE threads t SET rewrites = t.rewrites + 1
                    WHERE (t.tenant, t.context_id) IN (SELECT tenant, context_id FROM old_rows);
                ELSIF TG_OP = 'UPDATE' THEN
                    UPDATE threads t SET rewrites = t.rewrites + 1
                    WHERE (t.tenant, t.context_id) IN (SELECT tenant, context_id FROM old_rows
                                                       UNION SELECT tenant, context_id
                                                       FROM new_rows);
                ELSE
                    UPDATE threads t SET rewrites = t.rewrites + 1
                    WHERE (t.tenant, t.context_id) IN (SELECT tenant, context_id FROM new_rows)
                      AND t.xmin::text <> (pg_current_xact_id()::text::bigint % 4294967296)::text;
                END IF;
                RETURN NULL;
            END
            $$
            """,
            # The UPDATE trigger sees the rows' old thread too (an UPDATE may move a row).
            "DROP TRIGGER messages_touch_threads_update ON messages",
            "CREATE TRIGGER messages_touch_threads_update AFTER UPDATE ON messages "
            "REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT "
            "EXECUTE FUNCTION contextd_touch_threads()",
        ],
    ),
    (
        16,
        [
            # The search vector's trigger runs its function on an INSERT only when the
            # row comes without a vector (a WHEN clause PostgreSQL evaluates without
            # calling PL/pgSQL): the service's appends hand over most vectors, and the
            # call, for a function that then does nothing, was about 15% of a
            # one-message append's CPU in the database. An UPDATE of content or
            # tool_calls recomputes it as before; the function is unchanged.
            # (IF EXISTS: a test takes a database back to an older version by its
            # columns and triggers alone, this one's left in place.)
            "DROP TRIGGER messages_search_tsv ON messages",
            "DROP TRIGGER IF EXISTS messages_search_tsv_update ON messages",
            "CREATE TRIGGER messages_search_tsv BEFORE INSERT ON messages FOR EACH ROW "
            "WHEN (NEW.search_tsv IS NULL) EXECUTE FUNCTION contextd_search_tsv()",
            "CREATE TRIGGER messages_search_tsv_update BEFORE UPDATE OF content, tool_calls "
            "ON messages FOR EACH ROW EXECUTE FUNCTION contextd_search_tsv()",
            # tool_open's insert trigger (version 13) returns at once when no inserted
            # row can open, answer or widen anything (each of its three statements
            # takes only rows not summaries that are in a tool group or tool results):
            # one look at the inserted rows instead of three statements, about a sixth
            # of a one-message append's CPU in the database. The rest is 13's.
            """
            CREATE OR REPLACE FUNCTION contextd_tool_open_insert() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                IF NOT EXISTS (SELECT FROM new_rows
                               WHERE NOT is_summary AND (group_id >= 0 OR role = 4)) THEN
                    RETURN NULL;
                END IF;
"""
            + _TOOL_OPEN_INSERT_BODY,
        ],
    ),
]


def migrate(conn: psycopg.Connection[Any]) -> int:
    """Bring the database to the newest schema; returns its version. Safe when several
    replicas start at once (one advisory lock, one transaction per migration)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [MIGRATION_LOCK])
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(version integer PRIMARY KEY, applied_time_us bigint NOT NULL)"
        )
        row = conn.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()
        current = int(row[0]) if row else 0
        for version, statements in MIGRATIONS:
            if version <= current:
                continue
            with conn.transaction():
                for statement in statements:
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations VALUES "
                    "(%s, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)",
                    [version],
                )
            log.info("migrated schema", extra={"schema_version": version})
            current = version
    return current
