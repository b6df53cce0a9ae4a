"""A deterministic, seeded corpus of agent conversations.

Why synthetic: the benchmarks must run offline, in CI, and give the same bytes on every
machine, yet look like what an agent store really holds -- mostly short chat turns
(log-normal lengths around 300 characters), some large tool outputs (up to 50 KB), and a
mix of prose, code and JSON, because tokenizers and BM25 behave differently on each.

Texts are cut from three pre-built pools at seeded offsets rather than generated word by
word: that keeps a million messages to a few seconds of Python, while every message still
differs. The prose pool draws words from a Zipf-like distribution over a fixed vocabulary so
that BM25 statistics (document frequencies, long tails) resemble natural language.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from functools import cache

ROLE_USER = 1
ROLE_ASSISTANT = 2
ROLE_TOOL_USE = 3
ROLE_TOOL_RESULT = 4

SEED = 20_240_601
MEDIAN_CHARS = 300
TOOL_MEDIAN_CHARS = 1_000
MAX_TOOL_CHARS = 50_000
MAX_CHAT_CHARS = 20_000
POOL_CHARS = 2_000_000


def _words(text: str) -> tuple[str, ...]:
    """A word list written as one string, which keeps long lists readable."""
    return tuple(text.split())


_COMMON = _words(
    "the of and to in is that for it with as was on be by this are from or have an they "
    "which you were her all she there would their we him been has when who will more no "
    "if out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made "
    "after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right "
    "used take three"
)

_TECH = _words(
    "error request response server client thread message context token budget window "
    "agent model tool output query index cache latency timeout retry database table "
    "column commit transaction schema migration deploy build test failure config value "
    "function module package version release branch merge review pipeline container "
    "cluster node memory disk network socket connection stream buffer parser encoder "
    "decoder summary"
)

_SYLLABLES = _words(
    "ka ri to mo ne sa lu vi de po ran tel mar sin gor bel fin dus ven hal cor pex tam "
    "ulo ira esk ont ber gla shi zen qua dro lim nor pra sto wex yul"
)

_CODE_SNIPPETS = (
    'def handle(request: Request) -> Response:\n    """Serve one request."""\n'
    "    user = db.get_user(request.user_id)\n    if user is None:\n"
    '        raise NotFound(f"no user {request.user_id}")\n'
    "    return Response(status=200, body=user.to_json())\n\n",
    "for (let i = 0; i < items.length; i++) {\n  const item = items[i];\n"
    "  if (item.expired) { cache.delete(item.key); continue; }\n  total += item.size;\n}\n",
    "fn merge(a: &[u32], b: &[u32]) -> Vec<u32> {\n    let mut out = Vec::with_capacity"
    "(a.len() + b.len());\n    let (mut i, mut j) = (0, 0);\n    while i < a.len() && j < "
    "b.len() {\n        if a[i] <= b[j] { out.push(a[i]); i += 1 } else { out.push(b[j]); "
    "j += 1 }\n    }\n    out\n}\n",
    "SELECT t.name, count(*) AS n\nFROM messages m JOIN threads t ON t.id = m.thread_id\n"
    "WHERE m.created_at > now() - INTERVAL '1 day'\nGROUP BY t.name ORDER BY n DESC LIMIT 20;\n",
    'Traceback (most recent call last):\n  File "/srv/app/worker.py", line 88, in run\n'
    "    result = job.execute(timeout=30)\nTimeoutError: job 4411 exceeded 30 s\n",
    "$ git log --oneline -5\na1b2c3d fix: retry on UNAVAILABLE\n9f8e7d6 feat: add window "
    "reads\n$ cargo test --release\ntest result: ok. 142 passed; 0 failed\n",
)


@dataclass(frozen=True, slots=True)
class Message:
    """One generated message."""

    role: int
    content: str


@cache
def _vocabulary() -> tuple[str, ...]:
    rng = random.Random(SEED)
    made = {
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(30_000)
    }
    return (*_COMMON, *_TECH, *sorted(made))


def _prose_pool(rng: random.Random) -> str:
    vocab = _vocabulary()
    # Zipf-ish weights: the k-th word is drawn with probability proportional to 1/(k+2).
    weights = list(itertools.accumulate(1.0 / (k + 2) for k in range(len(vocab))))
    words = rng.choices(vocab, cum_weights=weights, k=POOL_CHARS // 6)
    out: list[str] = []
    for i in range(0, len(words), 12):
        sentence = " ".join(words[i : i + 12])
        out.append(sentence[:1].upper() + sentence[1:] + ". ")
    return "".join(out)[:POOL_CHARS]


def _code_pool(rng: random.Random) -> str:
    vocab = _vocabulary()
    parts: list[str] = []
    size = 0
    while size < POOL_CHARS:
        snippet = rng.choice(_CODE_SNIPPETS)
        ident = rng.choice(vocab[len(_COMMON) :])
        snippet = snippet.replace("item", ident).replace("user", rng.choice(_TECH))
        parts.append(snippet)
        size += len(snippet)
    return "".join(parts)[:POOL_CHARS]


def _json_pool(rng: random.Random) -> str:
    vocab = _vocabulary()
    parts: list[str] = []
    size = 0
    while size < POOL_CHARS:
        record = {
            "id": rng.randrange(10**9),
            "name": rng.choice(vocab),
            "status": rng.choice(("ok", "error", "pending", "timeout")),
            "latency_ms": round(rng.lognormvariate(3, 1), 2),
            "tags": rng.sample(_TECH, 3),
            "detail": " ".join(rng.choices(vocab[:400], k=rng.randint(3, 12))),
        }
        text = json.dumps(record, indent=2 if rng.random() < 0.5 else None) + ",\n"
        parts.append(text)
        size += len(text)
    return "".join(parts)[:POOL_CHARS]


@cache
def _pools() -> tuple[str, str, str]:
    rng = random.Random(SEED + 1)
    return _prose_pool(rng), _code_pool(rng), _json_pool(rng)


def _cut(rng: random.Random, pool: str, length: int) -> str:
    start = rng.randrange(len(pool) - length)
    return pool[start : start + length]


def _chat_text(rng: random.Random, prose: str, code: str, data: str) -> str:
    length = min(MAX_CHAT_CHARS, max(1, int(rng.lognormvariate(math.log(MEDIAN_CHARS), 0.9))))
    kind = rng.random()
    if kind < 0.75:
        return _cut(rng, prose, length)
    if kind < 0.9:
        return _cut(rng, prose, length // 3 + 1) + "\n```\n" + _cut(rng, code, length) + "```\n"
    return _cut(rng, prose, length // 4 + 1) + "\n" + _cut(rng, data, length)


def _tool_output(rng: random.Random, prose: str, code: str, data: str) -> str:
    length = min(MAX_TOOL_CHARS, max(1, int(rng.lognormvariate(math.log(TOOL_MEDIAN_CHARS), 1.2))))
    pool = rng.choice((code, data, data, prose))
    return _cut(rng, pool, length)


def conversation(n: int, *, seed: int = SEED, tools: bool = True) -> list[Message]:
    """``n`` messages of one agent conversation, oldest first.

    With ``tools`` about 20% of the messages are tool calls and their results (one to three
    results per call, never split); without, it alternates user and assistant turns, which
    is the history on which every trimmer must agree (langchain knows no tool groups).
    """
    prose, code, data = _pools()
    rng = random.Random(seed)
    out: list[Message] = []
    group = 0
    while len(out) < n:
        role = ROLE_USER if len(out) % 2 == 0 or not out else ROLE_ASSISTANT
        if tools and role == ROLE_ASSISTANT and rng.random() < 0.15 and n - len(out) >= 4:
            results = rng.randint(1, 3)
            calls = [
                {"id": f"call_{group}_{k}", "name": rng.choice(_TECH), "input": {"q": k}}
                for k in range(results)
            ]
            out.append(Message(ROLE_TOOL_USE, json.dumps(calls)))
            for _call in calls:
                out.append(Message(ROLE_TOOL_RESULT, _tool_output(rng, prose, code, data)))
            group += 1
            continue
        out.append(Message(role, _chat_text(rng, prose, code, data)))
    return out[:n]


def texts(n: int, *, seed: int = SEED) -> list[str]:
    """The contents of :func:`conversation` (with tools): the corpus for counting and BM25."""
    return [m.content for m in conversation(n, seed=seed)]


def unique_texts(n: int, *, seed: int = SEED + 13) -> list[str]:
    """Texts that share almost no piece with each other: made-up words of random letters,
    random numbers, identifiers and base64, in lengths like :func:`texts`. The worst case
    for a tokenizer that caches the counts of repeated pieces (real chat repeats its words
    far more; the generated conversation, cut from shared pools, repeats them most)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    b64 = letters + letters.upper() + "0123456789+/"

    def word() -> str:
        w = "".join(rng.choices(letters, k=rng.randint(3, 11)))
        return w.capitalize() if rng.random() < 0.1 else w

    def piece() -> str:
        r = rng.random()
        if r < 0.75:
            return word()
        if r < 0.85:
            return str(rng.randint(0, 10**9))
        if r < 0.95:
            return f"{word()}_{word()}({rng.randint(0, 99)})."
        return "".join(rng.choices(b64, k=rng.randint(16, 120)))

    out = []
    for _ in range(n):
        length = min(50_000, max(5, int(rng.lognormvariate(5.5, 1.0))))
        parts: list[str] = []
        size = 0
        while size < length:
            parts.append(piece())
            size += len(parts[-1]) + 1
        out.append(" ".join(parts)[:length])
    return out


def queries(count: int, *, seed: int = SEED + 7) -> list[str]:
    """Search queries of two to four words from the mid-frequency vocabulary."""
    rng = random.Random(seed)
    vocab = _vocabulary()
    middle = vocab[50:3_000]
    return [" ".join(rng.sample(middle, rng.randint(2, 4))) for _ in range(count)]
