"""The search vector of a message, made by the server when it can be made exactly.

`messages.search_tsv` (see search.py) is PostgreSQL's own

    to_tsvector('simple', regexp_replace(left(content, 196608) || ' ' ||
                left(tool_calls, 65536), '[^[:alnum:]]+', ' ', 'g'))

Computed by the database at insert, it was nine tenths of a batched append's cost there
(PostgreSQL's text parser is slow; the GIN index is not the cost). For most messages the
result is simple to state: every run of ASCII letters and digits is a word, lower-cased,
at its position (1, 2, ...). So the append computes that in Python and hands it over as a
tsvector literal, and leaves to the database (a trigger computing the very expression
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

import re
from collections import Counter
from typing import Any

# The parts of the stored column's expression (and of the trigger's).
CONTENT_CHARS = 196_608
TOOL_CALLS_CHARS = 65_536
DATABASE_EXPRESSION = (
    "to_tsvector('simple'::regconfig, regexp_replace(left({content}, 196608) || ' ' || "
    "left({tool_calls}, 65536), '[^[:alnum:]]+', ' ', 'g'))"
)

_WORD = re.compile(r"[a-z0-9]+")  # of the lower-cased text
# A word PostgreSQL's parser may split as a number in scientific notation.
_NUMBER_E = re.compile(r"(?<![a-z0-9])[0-9]+e")
_ENTRY = "'{}':{}"
# PostgreSQL's limits: longest word it indexes (bytes), highest position, positions kept
# per word.
_MAX_WORD = 2046
_MAX_POSITION = 16_383
_MAX_POSITIONS = 256

_SAMPLES = (
    "The quick brown fox jumps over the lazy dog THE QUICK BROWN FOX 0123456789",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ x1 1x a1b2c3 007",
    'src/contextd/api.py:42 foo_bar-baz "quoted" {"name": "grep", "args": [1, 2]}',
    "numbers 12 12.5 1,000 -3 +4 0x1F v1.2.3 user@example.com https://a.b/c?d=e#f",
)


def search_vector(content: str, tool_calls: str) -> str | None:
    """The tsvector literal the database's expression gives for this message, or None
    when only the database can tell (see the module's docstring).

    Each word is written with its one position ("'a':1 'b':2 'a':3"): reading the literal,
    PostgreSQL merges a word's positions itself, which costs less there than a Python
    dictionary costs here."""
    text = (content[:CONTENT_CHARS] + " " + tool_calls[:TOOL_CALLS_CHARS]).lower()
    if not text.isascii() or _NUMBER_E.search(text):
        return None
    words = _WORD.findall(text)
    n = len(words)
    if n > _MAX_POSITION or (n and len(max(words, key=len)) > _MAX_WORD):
        return None
    if n > _MAX_POSITIONS and Counter(words).most_common(1)[0][1] > _MAX_POSITIONS:
        return None
    # Letters and digits only: nothing in a word needs escaping inside the quotes.
    return " ".join(map(_ENTRY.format, words, range(1, n + 1)))


def matches_database(conn: Any) -> bool:
    """Whether the database's expression gives the vectors `search_vector` gives, for
    sample texts (compared as tsvectors, so order does not matter)."""
    expression = DATABASE_EXPRESSION.format(content="%s::text", tool_calls="%s::text")
    for sample in _SAMPLES:
        mine = search_vector(sample, "")
        if mine is None:
            # Samples with ASCII only and no digit-led "e" words; one that is refused
            # means this module changed, so do not trust it.
            return False
        row = conn.execute(f"SELECT {expression} = %s::tsvector", [sample, "", mine]).fetchone()
        if not row or row[0] is not True:
            return False
    return True
