"""The embedded engine's schema, by version (see `Store._migrate`).

Each migration moves the schema from version N-1 to N and runs in one transaction.
Never edit a released migration; append a new one.
"""

from __future__ import annotations

from collections.abc import Callable

import duckdb

MIGRATIONS: list[tuple[int, list[str]]] = [
    (
        1,
        [
            """
            CREATE TABLE agents (
                tenant VARCHAR NOT NULL,
                name VARCHAR NOT NULL,
                system_prompt VARCHAR NOT NULL,
                docs_json VARCHAR NOT NULL,
                rolling_window_us BIGINT NOT NULL,
                create_time_us BIGINT NOT NULL,
                update_time_us BIGINT NOT NULL,
                last_clear_us BIGINT NOT NULL,
                model VARCHAR NOT NULL DEFAULT '',
                settings_json VARCHAR NOT NULL DEFAULT '{}',
                PRIMARY KEY (tenant, name)
            )
            """,
            """
            CREATE TABLE threads (
                context_id BIGINT NOT NULL PRIMARY KEY,
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                scope VARCHAR NOT NULL,
                thread VARCHAR NOT NULL,
                create_time_us BIGINT NOT NULL,
                last_message_time_us BIGINT NOT NULL,
                message_count BIGINT NOT NULL,
                token_estimate BIGINT NOT NULL,
                last_clear_us BIGINT,
                UNIQUE (tenant, agent, scope, thread)
            )
            """,
            """
            CREATE TABLE messages (
                id BIGINT NOT NULL,
                context_id BIGINT NOT NULL,
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                scope VARCHAR NOT NULL,
                thread VARCHAR NOT NULL,
                role UTINYINT NOT NULL,
                content VARCHAR NOT NULL,
                tool_calls VARCHAR NOT NULL,
                tool_call_id VARCHAR NOT NULL,
                external_id VARCHAR NOT NULL,
                metadata VARCHAR NOT NULL,
                token_estimate INTEGER NOT NULL,
                create_time_us BIGINT NOT NULL,
                -- Tokens under the agent's model tokenizer at insert (`tokenizer` names it,
                -- margin included); equal to token_estimate when the agent has no model.
                token_count INTEGER NOT NULL,
                tokenizer VARCHAR NOT NULL,
                -- Length of content in Unicode scalar values, so trimming needs no content.
                chars INTEGER NOT NULL,
                -- The id of the tool_use message a tool_use or tool_result belongs to
                -- (its own id for the tool_use), -1 otherwise: trimming keeps groups whole.
                group_id BIGINT NOT NULL,
                -- For messages that call tools: their call ids, comma-separated.
                tool_call_ids VARCHAR NOT NULL
            )
            """,
            "CREATE INDEX messages_by_context ON messages (context_id)",
        ],
    ),
    (
        2,
        [
            # Compaction summaries are messages that stand for a range of their thread.
            "ALTER TABLE messages ADD COLUMN is_summary BOOLEAN DEFAULT false",
            "ALTER TABLE messages ADD COLUMN first_summarized_id BIGINT DEFAULT 0",
            "ALTER TABLE messages ADD COLUMN last_summarized_id BIGINT DEFAULT 0",
            """
            CREATE TABLE status_entries (
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                scope VARCHAR NOT NULL,
                key VARCHAR NOT NULL,
                kind UTINYINT NOT NULL,
                state VARCHAR NOT NULL,
                summary VARCHAR NOT NULL,
                update_time_us BIGINT NOT NULL,
                expire_time_us BIGINT,
                PRIMARY KEY (tenant, agent, scope, key)
            )
            """,
            """
            CREATE TABLE events (
                id BIGINT NOT NULL,
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                scope VARCHAR NOT NULL,
                thread VARCHAR NOT NULL,
                type VARCHAR NOT NULL,
                create_time_us BIGINT NOT NULL,
                data VARCHAR NOT NULL
            )
            """,
        ],
    ),
    (
        3,
        [
            # The newest compaction summary of each thread, so a build finds it by id
            # instead of scanning the thread's messages; 0 when it has none.
            "ALTER TABLE threads ADD COLUMN latest_summary_id BIGINT NOT NULL DEFAULT 0",
            """
            UPDATE threads SET latest_summary_id = s.id
            FROM (SELECT context_id, max(id) AS id FROM messages WHERE is_summary
                  GROUP BY context_id) s
            WHERE threads.context_id = s.context_id
            """,
            # Thread counters are written lazily (see thread_counters.py); this records
            # the last message id the threads table has counted.
            "CREATE TABLE store_state (key VARCHAR PRIMARY KEY, value BIGINT NOT NULL)",
            "INSERT INTO store_state SELECT 'thread_counters_through_id', coalesce(max(id), 0) "
            "FROM messages",
        ],
    ),
    (
        4,
        [
            # The client's own time of a message, apart from the server's commit time
            # (create_time_us); NULL when the client gave none.
            "ALTER TABLE messages ADD COLUMN source_time_us BIGINT",
            # Append order within a thread: 1, 2, 3, ... Existing messages are numbered in
            # the order they were read in before, (create time, id).
            "ALTER TABLE messages ADD COLUMN sequence BIGINT DEFAULT 0",
            """
            UPDATE messages SET sequence = s.sequence
            FROM (SELECT id, row_number() OVER (PARTITION BY context_id
                                                ORDER BY create_time_us, id) AS sequence
                  FROM messages) s
            WHERE messages.id = s.id
            """,
            # The thread's newest sequence and its oldest source time are thread counters
            # (see thread_counters.py): like message_count they include only the messages
            # up to thread_counters_through_id; opening the store counts the rest.
            "ALTER TABLE threads ADD COLUMN last_sequence BIGINT DEFAULT 0",
            "ALTER TABLE threads ADD COLUMN min_source_time_us BIGINT",
            """
            UPDATE threads SET last_sequence = s.n
            FROM (SELECT context_id, count(*) AS n FROM messages
                  WHERE id <= (SELECT value FROM store_state
                               WHERE key = 'thread_counters_through_id')
                  GROUP BY context_id) s
            WHERE threads.context_id = s.context_id
            """,
            # Every message id ever issued is at or below this mark, so ids are never
            # reused, also after their messages were deleted (see _reserve_ids).
            "INSERT INTO store_state SELECT 'message_id_high_water', coalesce(max(id), 0) "
            "FROM messages",
        ],
    ),
    (
        5,
        [
            # Two appends can never take the same number in a thread, whoever numbered
            # them. (Its own version: DuckDB cannot index a table in the transaction
            # that updated it.)
            "CREATE UNIQUE INDEX messages_by_sequence ON messages (context_id, sequence)",
        ],
    ),
    (
        6,
        [
            # Writes made with a request id: a retry finds its first response here. Rows
            # are written in the transaction of the write they record.
            """
            CREATE TABLE request_log (
                tenant VARCHAR NOT NULL,
                request_id VARCHAR NOT NULL,
                method VARCHAR NOT NULL,
                fingerprint VARCHAR NOT NULL,
                payload BLOB NOT NULL,
                create_time_us BIGINT NOT NULL,
                PRIMARY KEY (tenant, request_id)
            )
            """,
        ],
    ),
    (
        7,
        [
            # The request records again, keyed by one column (see idempotency.record_key):
            # DuckDB finds a row through an index only by a single-column key, so a lookup
            # by (tenant, request_id) scanned the whole table, on the writer, per write.
            """
            CREATE TABLE request_records (
                id_key VARCHAR NOT NULL PRIMARY KEY,
                tenant VARCHAR NOT NULL,
                request_id VARCHAR NOT NULL,
                method VARCHAR NOT NULL,
                fingerprint VARCHAR NOT NULL,
                payload BLOB NOT NULL,
                create_time_us BIGINT NOT NULL
            )
            """,
            "INSERT INTO request_records SELECT request_id || chr(9) || tenant, tenant, "
            "request_id, method, fingerprint, payload, create_time_us FROM request_log",
            "DROP TABLE request_log",
        ],
    ),
    (
        8,
        [
            # ListEvents reads the events of one scope of one agent: a one-column key of
            # them, since DuckDB uses an index only for a single-column predicate.
            "ALTER TABLE events ADD COLUMN scope_key VARCHAR",
            "UPDATE events SET scope_key = tenant || chr(9) || agent || chr(9) || scope",
            "CREATE INDEX events_by_scope ON events (scope_key)",
        ],
    ),
    (
        9,
        [
            # The contexts of deleted agents whose messages are still being removed, a
            # chunk at a time (see Store.delete_agent); a start resumes what a stop left.
            """
            CREATE TABLE deleted_contexts (
                context_id BIGINT NOT NULL PRIMARY KEY,
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                delete_time_us BIGINT NOT NULL
            )
            """,
        ],
    ),
    (
        10,
        [
            # The snapshot a restored message came from ("" for every other message).
            "ALTER TABLE messages ADD COLUMN restored_from VARCHAR DEFAULT ''",
            # Snapshots' metadata; each one's document is a JSON file under the data
            # directory (see snapshots.py), checked against `sha256` when read.
            # `scope_key` is one column naming (tenant, agent, scope), for the index.
            """
            CREATE TABLE snapshots (
                id VARCHAR NOT NULL PRIMARY KEY,
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                scope VARCHAR NOT NULL,
                scope_key VARCHAR NOT NULL,
                thread VARCHAR NOT NULL,
                create_time_us BIGINT NOT NULL,
                description VARCHAR NOT NULL,
                summary VARCHAR NOT NULL,
                message_count BIGINT NOT NULL,
                window_start_us BIGINT,
                window_end_us BIGINT,
                threads_json VARCHAR NOT NULL,
                size_bytes BIGINT NOT NULL,
                path VARCHAR NOT NULL,
                sha256 VARCHAR NOT NULL
            )
            """,
            "CREATE INDEX snapshots_by_scope ON snapshots (scope_key)",
        ],
    ),
    (
        11,
        [
            # API keys: the hash of each secret, never the secret (see domain/access.py).
            # (Version 10 is the snapshots'.)
            """
            CREATE TABLE api_keys (
                key_id VARCHAR NOT NULL PRIMARY KEY,
                tenant VARCHAR NOT NULL,
                role UTINYINT NOT NULL,
                name VARCHAR NOT NULL,
                secret_hash VARCHAR NOT NULL,
                create_time_us BIGINT NOT NULL,
                revoke_time_us BIGINT
            )
            """,
        ],
    ),
    (
        12,
        [
            # Retention (see domain/retention.py). The sequence of the tool_use a message's
            # tool group starts at (NULL outside a group), so that a cap on a thread's
            # newest messages leaves a group out whole by comparing one integer.
            "ALTER TABLE messages ADD COLUMN group_start BIGINT",
            """
            UPDATE messages SET group_start = u.sequence
            FROM messages u
            WHERE messages.group_id >= 0 AND u.id = messages.group_id
              AND u.context_id = messages.context_id
            """,
            # Messages of the thread up to this sequence belong to a time the thread had
            # expired (a sweep or an append after expiry set it); the sweep deletes them.
            "ALTER TABLE threads ADD COLUMN expired_through BIGINT NOT NULL DEFAULT 0",
        ],
    ),
    (
        13,
        [
            # Bytes of content, tool_calls and metadata (UTF-8) of each thread's messages,
            # a lazy counter like message_count (see thread_counters.py): a tenant's
            # stored bytes are the sum of its threads' and its snapshots' sizes, read
            # without scanning messages (see domain/quota.py). Like the other counters it
            # includes the messages up to thread_counters_through_id.
            "ALTER TABLE threads ADD COLUMN stored_bytes BIGINT DEFAULT 0",
            """
            UPDATE threads SET stored_bytes = s.b
            FROM (SELECT context_id,
                         sum(strlen(content) + strlen(tool_calls) + strlen(metadata)) AS b
                  FROM messages
                  WHERE id <= (SELECT value FROM store_state
                               WHERE key = 'thread_counters_through_id')
                  GROUP BY context_id) s
            WHERE threads.context_id = s.context_id
            """,
        ],
    ),
    (
        14,
        [
            # Tool outputs kept aside (see tool_outputs.py): one row per output, its result
            # inline (inline_data) or in a file under the data directory (path), with
            # each chunk's stored length. `scope_key` names (tenant, agent, scope) in one
            # column, for the index. (Versions 12 and 13 are other features'.)
            """
            CREATE TABLE tool_outputs (
                id VARCHAR NOT NULL PRIMARY KEY,
                output_key VARCHAR NOT NULL,
                tenant VARCHAR NOT NULL,
                agent VARCHAR NOT NULL,
                scope VARCHAR NOT NULL,
                thread VARCHAR NOT NULL,
                tool_name VARCHAR NOT NULL,
                tool_description VARCHAR NOT NULL,
                args_json VARCHAR NOT NULL,
                task_id VARCHAR,
                query_id VARCHAR,
                size_bytes BIGINT NOT NULL,
                token_count BIGINT NOT NULL,
                create_time_us BIGINT NOT NULL,
                kind UTINYINT NOT NULL,
                stored_inline BOOLEAN NOT NULL,
                stored_bytes BIGINT NOT NULL,
                sha256 VARCHAR NOT NULL,
                inline_data BLOB,
                compressed BOOLEAN NOT NULL,
                chunk_lengths VARCHAR NOT NULL,
                index_text VARCHAR NOT NULL,
                scope_key VARCHAR NOT NULL,
                path VARCHAR
            )
            """,
            "CREATE INDEX tool_outputs_by_scope ON tool_outputs (scope_key)",
        ],
    ),
    (
        20,
        [
            # Tool outputs of the thread stored at or before this time belong to a time
            # the thread had expired (an append after expiry sets it to the append's time
            # - ttl): reads leave them out and the sweep deletes them, as for messages up
            # to expired_through. (Versions 15 to 19 are other features'.)
            "ALTER TABLE threads ADD COLUMN outputs_expired_through_us BIGINT NOT NULL DEFAULT 0",
        ],
    ),
    (
        22,
        [
            # Messages' content in two columns, `content` read from both: see
            # split_message_content, run after these statements. (Version 21 is another
            # feature's.)
        ],
    ),
    (
        23,
        [
            # The number of the last group of the append journal applied to the tables,
            # written in the transaction that applies it: at open, journal records at or
            # below it are skipped (see journal.py).
            "INSERT OR IGNORE INTO store_state VALUES ('journal_applied_group', 0)",
        ],
    ),
]

# Content of at most this many bytes (UTF-8) is kept in `content_short`, longer content in
# `content_long` (version 22).
SHORT_CONTENT_BYTES = 4096


def is_long_content(content: str) -> bool:
    """Whether content goes to `content_long`: over SHORT_CONTENT_BYTES bytes in UTF-8
    (text of at most a quarter as many characters is never encoded to tell)."""
    if len(content) <= SHORT_CONTENT_BYTES // 4:
        return False
    return len(content) > SHORT_CONTENT_BYTES or len(content.encode()) > SHORT_CONTENT_BYTES


def split_message_content(con: duckdb.DuckDBPyConnection) -> None:
    """Keep messages' content in two stored columns (version 22): `content_short` (content
    of at most SHORT_CONTENT_BYTES bytes, else empty) and `content_long` (longer content,
    else NULL), and `content` as the virtual column `coalesce(content_long,
    content_short)`, so every read of `content` reads as before.

    Why: DuckDB writes each string over 4 KiB to overflow blocks, and a segment holding
    one refuses dictionary and FSST compression. With long tool outputs among chat
    turns the column took about 850 bytes a message of 483 (and most overflow blocks
    were mostly empty); split, the short column is compressed with FSST (read string by
    string: a point read costs about 1.5x the CPU, where zstd's whole vectors cost
    4.6x) and the long one keeps a few full blocks: about 270 bytes a message.

    DuckDB adds neither a generated column nor renames a column of an indexed table, so
    the table is made again from the catalog's definition (columns other versions added
    are kept, in their order), its rows copied in their order, and its indexes made again
    (also from the catalog), in the migration's one transaction. A table already split
    (a file taken back to an older version) is left as it is.
    """
    row = con.execute(
        "SELECT sql FROM duckdb_tables() WHERE schema_name = 'main' AND table_name = 'messages'"
    ).fetchone()
    if row is None:
        raise RuntimeError("no messages table to split")
    ddl = str(row[0])
    if "content_short" in ddl:
        return
    plain = '"content" VARCHAR NOT NULL'
    if ddl.count(plain) != 1 or not ddl.startswith("CREATE TABLE messages("):
        raise RuntimeError(f"unexpected definition of the messages table: {ddl[:200]}")
    indexes = [
        str(r[0])
        for r in con.execute(
            "SELECT sql FROM duckdb_indexes() WHERE schema_name = 'main' "
            "AND table_name = 'messages' ORDER BY index_name"
        ).fetchall()
    ]
    columns = [
        str(r[0])
        for r in con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE schema_name = 'main' "
            "AND table_name = 'messages' ORDER BY column_index"
        ).fetchall()
    ]
    con.execute(
        ddl.replace("CREATE TABLE messages(", "CREATE TABLE messages_split(", 1).replace(
            plain,
            "content_short VARCHAR NOT NULL, content_long VARCHAR, "
            '"content" VARCHAR GENERATED ALWAYS AS (coalesce(content_long, content_short))',
            1,
        )
    )
    kept = [f'"{c}"' for c in columns if c != "content"]
    long = f"strlen(content) > {SHORT_CONTENT_BYTES}"
    # Insertion order is kept (DuckDB preserves it by default): no sort of the table.
    con.execute(
        f"INSERT INTO messages_split ({', '.join(kept)}, content_short, content_long) "
        f"SELECT {', '.join(kept)}, CASE WHEN {long} THEN '' ELSE content END, "
        f"CASE WHEN {long} THEN content END FROM messages"
    )
    con.execute("DROP TABLE messages")
    con.execute("ALTER TABLE messages_split RENAME TO messages")
    for sql in indexes:
        con.execute(sql)


# Steps in Python a migration runs after its statements, by version.
MIGRATION_STEPS: dict[int, Callable[[duckdb.DuckDBPyConnection], None]] = {
    22: split_message_content,
}
