"""The search vector of a message, made by the server when it can be made exactly.

`messages.search_tsv` (see search.py) is PostgreSQL's own

    to_tsvector('simple', regexp_replace(left(content, 196608) || ' ' ||
                left(tool_calls, 65536), '[^[:alnum:]]+', ' ', 'g'))

Computed by the database at insert, it was nine tenths of a batched append's cost there
(PostgreSQL's text parser is slow; the GIN index is not the cost). For most messages the
result is simple to state: every run of ASCII letters and digits is a word, lower-cased,
at its position (1, 2, ...). So the append computes that (in the Rust core) and hands it
over as a tsvector literal, and leaves to the database (a trigger computing the very expression
above, schema version 8) every message where PostgreSQL's parser may read otherwise:
- any character outside ASCII (what [:alnum:] and lower-casing mean depends on the
  database's locale);
- a word starting with digits followed by "e" (PostgreSQL reads "8e2x" as the number
  "8e2" and the word "x");
- a word longer than PostgreSQL indexes (it leaves such words out), more positions than
  a tsvector keeps, or a word repeated more often than a tsvector records.

`matches_database` checks, once per store, that the database's own expression gives the
same vectors for a sample of texts (a database with another dictionary behind 'simple',
or a locale that lower-cases ASCII differently, turns the fast path off), so the stored
vector is the same whoever made it, and SearchMessages finds and ranks as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contextd import core
from contextd.domain.model import NewMessage

# The stored column's expression (and the trigger's); rust_core/src/search_vector.rs
# reads the same parts of content and tool_calls.
DATABASE_EXPRESSION = (
    "to_tsvector('simple'::regconfig, regexp_replace(left({content}, 196608) || ' ' || "
    "left({tool_calls}, 65536), '[^[:alnum:]]+', ' ', 'g'))"
)

_SAMPLES = (
    "The quick brown fox jumps over the lazy dog THE QUICK BROWN FOX 0123456789",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ x1 1x a1b2c3 007",
    'src/contextd/api.py:42 foo_bar-baz "quoted" {"name": "grep", "args": [1, 2]}',
    "numbers 12 12.5 1,000 -3 +4 0x1F v1.2.3 user@example.com https://a.b/c?d=e#f",
)


def search_vectors(messages: Sequence[NewMessage]) -> list[str | None]:
    """The tsvector literal the database's expression gives for each message, or None
    where only the database can tell (made by the Rust core, a few microseconds a
    message)."""
    return core.search_vectors([m.content for m in messages], [m.tool_calls for m in messages])


def matches_database(conn: Any) -> bool:
    """Whether the database's expression gives the vectors the Rust core makes, for
    sample texts (compared as tsvectors, so order does not matter)."""
    expression = DATABASE_EXPRESSION.format(content="%s::text", tool_calls="%s::text")
    for sample in _SAMPLES:
        [mine] = core.search_vectors([sample], [""])
        if mine is None:
            # Samples with ASCII only and no digit-led "e" words; one that is refused
            # means this module changed, so do not trust it.
            return False
        row = conn.execute(f"SELECT {expression} = %s::tsvector", [sample, "", mine]).fetchone()
        if not row or row[0] is not True:
            return False
    return True
