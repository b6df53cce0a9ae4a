"""PostgreSQL: search vectors made by the append equal the database's own, whoever made them.

The append hands over the vectors of plain ASCII messages (adapters/postgres/
search_vector.py) and leaves every other message to the database's trigger; either way
the stored vector must be exactly the version-7 expression's, or SearchMessages would
find and rank differently than before.
"""

from __future__ import annotations

import random
from typing import Any

import psycopg
import pytest

from contextd import core
from contextd.adapters.postgres.search_vector import DATABASE_EXPRESSION, matches_database
from contextd.adapters.postgres.store import PostgresStore
from contextd.app.build.summarizer import ExtractiveSummarizer
from contextd.app.service import ContextService
from contextd.domain.model import NewMessage, Role

STORED = DATABASE_EXPRESSION.format(content="content", tool_calls="tool_calls")

TEXTS = [
    "The quick brown fox; jumps over THE lazy dog. 42 times",
    "src/contextd/api.py:42 foo_bar-baz user@example.com https://a.b/c?d=e#f v1.2.3",
    "8e2x 1e5 1E+5 1.5e10 5e5e5 0x1F 123abc abc123",  # read by PostgreSQL as numbers
    "Ünïcode café 東京タワー Straße İstanbul",  # not ASCII: the database decides
    "a" * 3_000 + " short words too",  # a word too long to index
    "again " * 300,  # more positions than a tsvector keeps for one word
    " ".join(f"w{i}" for i in range(17_000)),  # positions past the highest
    "",
]


def _mismatches(conn: psycopg.Connection[tuple[Any, ...]]) -> int:
    row = conn.execute(
        f"SELECT count(*) FROM messages WHERE search_tsv IS DISTINCT FROM {STORED}"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_appended_vectors_equal_the_database_expression(postgres_dsn: str) -> None:
    store = PostgresStore.open(postgres_dsn)
    try:
        assert store._search_vectors  # the fast path is on for this database
        service = ContextService(store, ExtractiveSummarizer())
        batch = [NewMessage(role=Role.USER, content=t) for t in TEXTS]
        batch.append(
            NewMessage(
                role=Role.ASSISTANT,
                content="calling grep",
                tool_calls='[{"id": "c1", "name": "grep", "arguments": "{\\"q\\": \\"9e9z\\"}"}]',
            )
        )
        service.append_messages("default", "a", "", "t", batch, create_agent=True)
        with psycopg.connect(postgres_dsn) as conn:
            row = conn.execute("SELECT count(*) FROM messages").fetchone()
            assert row == (len(batch),)
            assert _mismatches(conn) == 0
            # A change of content recomputes the vector (the trigger's UPDATE branch).
            conn.execute("UPDATE messages SET content = 'Replaced CONTENT 7' WHERE sequence = 1")
            assert _mismatches(conn) == 0
            found = conn.execute(
                "SELECT count(*) FROM messages WHERE search_tsv @@ to_tsquery('simple', 'replaced')"
            ).fetchone()
            assert found == (1,)
    finally:
        store.close()


def test_made_vectors_equal_the_database_on_random_ascii(postgres_dsn: str) -> None:
    """Every vector the Rust core makes (for random ASCII full of punctuation, digits
    and "e"s, in content and tool_calls) is the one the database computes; what it
    declines is left to it."""
    rng = random.Random(7)
    alphabet = "abcXYZe0123456789 .-_/@:+#&<>'\"\\eEx\n\t"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(3_000)]
    calls = texts[1:] + texts[:1]
    vectors = core.search_vectors(texts, calls)
    made = [(t, c, v) for t, c, v in zip(texts, calls, vectors, strict=True) if v is not None]
    assert len(made) > 500  # many are made here
    expression = DATABASE_EXPRESSION.format(content="t", tool_calls="c")
    with psycopg.connect(postgres_dsn) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM unnest(%s::text[], %s::text[], %s::text[]) AS x(t, c, v) "
            f"WHERE {expression} IS DISTINCT FROM v::tsvector",
            [[t for t, _, _ in made], [c for _, c, _ in made], [v for _, _, v in made]],
        ).fetchone()
    assert row == (0,)


def test_made_vectors_list_their_words_in_the_databases_order(postgres_dsn: str) -> None:
    """The literal lists each word once, in the order a tsvector keeps them (byte order):
    the database's text of the vector it reads is the literal itself, so it found the
    words sorted and did not sort them (a sort was a third of reading the literal)."""
    texts = [*TEXTS, "zeta alpha Beta alpha 10 9 a1 a10 a2 aa a", "b a ab ba a"]
    vectors = [v for v in core.search_vectors(texts, [""] * len(texts)) if v]
    assert len(vectors) >= 4
    with psycopg.connect(postgres_dsn) as conn:
        rows = conn.execute("SELECT v::tsvector::text FROM unnest(%s::text[]) v", [vectors])
        assert [r[0] for r in rows.fetchall()] == vectors


def test_a_database_that_reads_otherwise_turns_the_fast_path_off(postgres_dsn: str) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        assert matches_database(conn)
        try:
            # 'simple' with stop words drops "the" and "over": no longer the vectors made here.
            conn.execute("ALTER TEXT SEARCH DICTIONARY simple (StopWords = english)")
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("the test database's user may not change the built-in dictionary")
        try:
            assert not matches_database(conn)
        finally:
            conn.execute("ALTER TEXT SEARCH DICTIONARY simple (StopWords)")
        assert matches_database(conn)


def _vector_function_calls(conn: psycopg.Connection[tuple[Any, ...]]) -> int:
    """How often this database ran `contextd_search_tsv` (track_functions='pl')."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.commit()
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions "
        "WHERE funcname = 'contextd_search_tsv'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_schema_16_calls_the_vector_function_only_for_rows_without_one(
    postgres_dsn: str,
) -> None:
    """Schema 16 (upgrading a version-15 database): an insert that brings its vector
    does not call the trigger's function (its WHEN clause), one without a vector gets
    the database's, and an UPDATE of content recomputes it, as before."""
    from contextd.adapters.postgres.schema import MIGRATIONS

    store = PostgresStore.open(postgres_dsn)
    store.close()
    version_15 = (
        "CREATE TRIGGER messages_search_tsv BEFORE INSERT OR UPDATE OF content, tool_calls "
    )
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:  # back to version 15
        conn.execute("DROP TRIGGER messages_search_tsv ON messages")
        conn.execute("DROP TRIGGER messages_search_tsv_update ON messages")
        conn.execute(version_15 + "ON messages FOR EACH ROW EXECUTE FUNCTION contextd_search_tsv()")
        conn.execute("DELETE FROM schema_migrations WHERE version >= 16")
    store = PostgresStore.open(postgres_dsn)
    try:
        assert store.schema_version() == MIGRATIONS[-1][0] >= 16
        assert store._search_vectors
        service = ContextService(store, ExtractiveSummarizer())
        service.append_messages(
            "default", "a", "", "t", [NewMessage(role=Role.USER, content="x")], True
        )
        with psycopg.connect(postgres_dsn) as conn:
            conn.execute("SET track_functions = 'pl'")
            before = _vector_function_calls(conn)
            copy = (
                "INSERT INTO messages SELECT tenant, context_id, sequence + {k}, "
                "nextval('message_ids'), role, {content}, tool_calls, tool_call_id, "
                "external_id, metadata, token_estimate, create_time_us, source_time_us, "
                "token_count, tokenizer, chars, group_id, tool_call_ids, is_summary, "
                "first_summarized_id, last_summarized_id, restored_from, group_start, "
                "{vector}, NULL, NULL FROM messages WHERE sequence = 1"
            )
            given = "to_tsvector('simple', 'given words')"
            conn.execute(copy.format(k=1, content="'given words'", vector=given))
            assert _vector_function_calls(conn) == before
            conn.execute(copy.format(k=2, content="'Computed HERE 9'", vector="NULL"))
            assert _vector_function_calls(conn) == before + 1
            conn.execute("UPDATE messages SET content = 'Changed 7' WHERE sequence = 1")
            assert _vector_function_calls(conn) == before + 2
            assert _mismatches(conn) == 0
    finally:
        store.close()
