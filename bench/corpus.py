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

import base64
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


# --- Text classes for the counting benchmark -------------------------------------------
#
# Each class is generated afresh from a seed, so a benchmark can give every repetition
# text that no cache has seen: new made-up words, identifiers, numbers and bytes each time,
# mixed with the frequent words every real text repeats.

TEXT_CLASSES = ("prose", "code", "json", "cjk", "emoji", "base64", "logs")

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_VOWELS = "aeiou"
_CONSONANTS = "bcdfghjklmnprstvwz"

# Frequent Chinese characters (roughly in order of use), kana and Hangul: CJK text is
# drawn from these with Zipf-like weights, plus rarer characters from the whole block.
_HAN = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学"
    "对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面"
    "公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部"
    "正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关"
    "并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安"
    "表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共"
    "风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管"
    "夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品"
    "士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研"
    "像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济"
)
_KANA = (
    "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをん"
    "がぎぐげござじずぜぞだぢづでどばびぶべぼぱぴぷぺぽっゃゅょー"
    "アイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワヲン"
)
_CJK_PUNCT = "，。、！？「」：；（）"  # noqa: RUF001 (CJK punctuation on purpose)

_EMOJI = (
    "😀😃😄😁😆😅🤣😂🙂🙃😉😊😇🥰😍🤩😘😋😛🤔🤨😐😑😶🙄😏😣😥😮🤐😯😪😫🥱😴😌😜🤤😒😓😔"
    "👍👎👌✌🤞🤟🤘👏🙌👐🤲🙏💪🦾🔥✨🎉🎊🚀⭐🌟💯✅❌⚠💡📌📎🔗🧪🧠🐛🐍🦀☕🍕🌍🌈"
)
_EMOJI_SEQUENCES = (
    "👩\u200d💻",
    "🧑\u200d🔬",
    "👨\u200d👩\u200d👧\u200d👦",
    "🏳\ufe0f\u200d🌈",
    "👍🏽",
    "👋🏿",
    "🇫🇷",
    "🇯🇵",
    "❤\ufe0f",
    "✔\ufe0f",
)


def _zipf(rng: random.Random, items: str | tuple[str, ...], k: int) -> list[str]:
    weights = list(itertools.accumulate(1.0 / (i + 2) for i in range(len(items))))
    return rng.choices(items, cum_weights=weights, k=k)


def _new_word(rng: random.Random) -> str:
    """A pronounceable made-up word: new to any cache, yet word-like to the BPE."""
    return "".join(
        rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 4))
    ) + (rng.choice(_CONSONANTS) if rng.random() < 0.5 else "")


def _prose(rng: random.Random, length: int) -> str:
    words = (*_COMMON, *_TECH)
    out: list[str] = []
    size = 0
    while size < length:
        n = rng.randint(6, 20)
        ws = [_new_word(rng) if rng.random() < 0.2 else w for w in _zipf(rng, words, n)]
        if rng.random() < 0.2:
            ws[rng.randrange(n)] = f"{rng.randint(0, 99_999):,}"
        if rng.random() < 0.15:
            ws[rng.randrange(n)] = _new_word(rng).capitalize()
        if rng.random() < 0.1:
            ws.insert(rng.randrange(n), rng.choice(("it's", "don't", "we'll", "they're", "I'm")))
        sentence = " ".join(ws)
        sentence = sentence[:1].upper() + sentence[1:] + rng.choice((". ", ". ", ", ", "? ", "! "))
        if rng.random() < 0.1:
            sentence += "\n\n"
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:length]


def _ident(rng: random.Random) -> str:
    parts = [
        _new_word(rng) if rng.random() < 0.5 else rng.choice(_TECH)
        for _ in range(rng.randint(1, 3))
    ]
    style = rng.random()
    if style < 0.5:
        return "_".join(parts)
    if style < 0.8:
        return parts[0] + "".join(p.capitalize() for p in parts[1:])
    return "".join(p.capitalize() for p in parts)


def _code(rng: random.Random, length: int) -> str:
    out: list[str] = []
    size = 0
    while size < length:
        f, a, b, c = (_ident(rng) for _ in range(4))
        n = rng.randint(0, 10_000)
        kind = rng.random()
        if kind < 0.4:
            block = (
                f'def {f}({a}: int, {b}: str = "{_new_word(rng)}") -> dict[str, int]:\n'
                f'    """{_prose(rng, rng.randint(20, 80)).strip()}"""\n'
                f"    {c} = {{{b!r}: {a} * {n}}}\n"
                f"    if {a} > {n} and not {c}.get({b}):\n"
                f'        raise ValueError(f"bad {{{a}}}: {_new_word(rng)}")\n'
                f"    return {c}  # {_new_word(rng)} {rng.choice(_TECH)}\n\n"
            )
        elif kind < 0.7:
            block = (
                f"export function {f}({a}, {b}) {{\n"
                f"  const {c} = {a}.map((x) => x.{_ident(rng)} + {n});\n"
                f"  for (let i = 0; i < {c}.length; i++) {{\n"
                f"    if ({c}[i] === null) {{ {b}.push('{_new_word(rng)}'); continue; }}\n"
                f"  }}\n  return {{ {c}, total: {c}.length >>> {rng.randint(1, 9)} }};\n}}\n\n"
            )
        else:
            block = (
                f"pub fn {f}({a}: &[u{rng.choice((8, 32, 64))}], {b}: usize) "
                f"-> Option<{_ident(rng).capitalize()}> {{\n"
                f"    let mut {c} = Vec::with_capacity({b} + {n});\n"
                f"    for (i, v) in {a}.iter().enumerate() {{\n"
                f"        if *v != 0x{rng.randrange(1 << 32):08X} "
                f"{{ {c}.push(i << {rng.randint(1, 7)}); }}\n"
                f"    }}\n    {c}.first().copied().map(Into::into)\n}}\n\n"
            )
        out.append(block)
        size += len(block)
    return "".join(out)[:length]


def _json(rng: random.Random, length: int) -> str:
    out: list[str] = []
    size = 0
    while size < length:
        record = {
            _ident(rng): rng.randrange(10**9),
            "id": f"{rng.getrandbits(128):032x}",
            "name": _new_word(rng).capitalize() + " " + _new_word(rng).capitalize(),
            "status": rng.choice(("ok", "error", "pending", "timeout")),
            "latency_ms": round(rng.lognormvariate(3, 1), 3),
            "tags": [rng.choice(_TECH) for _ in range(rng.randint(0, 4))],
            "detail": _prose(rng, rng.randint(10, 120)).strip(),
            "nested": {_ident(rng): [rng.random(), None, True, rng.randint(-99, 99)]},
        }
        text = json.dumps(record, indent=rng.choice((None, 2, 4)), ensure_ascii=rng.random() < 0.2)
        out.append(text + ",\n")
        size += len(text) + 2
    return "".join(out)[:length]


def _cjk(rng: random.Random, length: int) -> str:
    out: list[str] = []
    size = 0
    while size < length:
        kind = rng.random()
        n = rng.randint(4, 30)
        if kind < 0.5:  # Chinese, mostly frequent characters, some rare ones
            chars = [
                chr(rng.randint(0x4E00, 0x9FFF)) if rng.random() < 0.08 else c
                for c in _zipf(rng, _HAN, n)
            ]
        elif kind < 0.8:  # Japanese: kana and kanji
            chars = [rng.choice(_HAN) if rng.random() < 0.35 else c for c in _zipf(rng, _KANA, n)]
        else:  # Korean: Hangul syllables in words
            chars = []
            for _ in range(n // 3 + 1):
                chars += [
                    chr(0xAC00 + int(rng.triangular(0, 11_171, 0)))
                    for _ in range(rng.randint(1, 4))
                ]
                chars.append(" ")
        clause = "".join(chars).rstrip()
        if rng.random() < 0.1:
            clause += f" {rng.randint(0, 9999)} {_new_word(rng)}"
        clause += rng.choice(_CJK_PUNCT)
        if rng.random() < 0.05:
            clause += "\n"
        out.append(clause)
        size += len(clause)
    return "".join(out)[:length]


def _emoji(rng: random.Random, length: int) -> str:
    out: list[str] = []
    size = 0
    while size < length:
        words = [w for w in _zipf(rng, (*_COMMON, *_TECH), rng.randint(0, 8))]
        for _ in range(rng.randint(1, 5)):
            e = rng.choice(_EMOJI_SEQUENCES) if rng.random() < 0.25 else rng.choice(_EMOJI)
            words.insert(rng.randint(0, len(words)), e * rng.randint(1, 3))
        part = " ".join(words) + rng.choice((" ", "\n", "! ", "... "))
        out.append(part)
        size += len(part)
    return "".join(out)[:length]


def _base64(rng: random.Random, length: int) -> str:
    raw = rng.randbytes(length * 3 // 4 + 3)
    text = base64.b64encode(raw).decode()
    if rng.random() < 0.5:  # MIME style, 76 columns
        text = "\n".join(text[i : i + 76] for i in range(0, len(text), 76))
    prefix = rng.choice(
        ("", "data:image/png;base64,", '{"blob": "', "-----BEGIN CERTIFICATE-----\n")
    )
    return (prefix + text)[:length]


def _logs(rng: random.Random, length: int) -> str:
    out: list[str] = []
    size = 0
    t = rng.randrange(1_700_000_000, 1_800_000_000)
    while size < length:
        t += rng.randint(0, 5)
        ms = rng.randrange(1000)
        level = rng.choice(("INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR"))
        ip = ".".join(str(rng.randrange(256)) for _ in range(4))
        line = (
            f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{t % 86400 // 3600:02d}:"
            f"{t % 3600 // 60:02d}:{t % 60:02d}.{ms:03d}Z {level:5} [{_ident(rng)}] "
            f"req={rng.getrandbits(64):016x} ip={ip} "
            f"path=/api/v{rng.randint(1, 3)}/{_new_word(rng)}/{rng.randrange(10**6)} "
            f"status={rng.choice((200, 200, 201, 404, 500, 503))} "
            f"dur={rng.lognormvariate(2, 1):.2f}ms {_prose(rng, rng.randint(0, 60)).strip()}\n"
        )
        out.append(line)
        size += len(line)
    return "".join(out)[:length]


_GENERATORS = {
    "prose": _prose,
    "code": _code,
    "json": _json,
    "cjk": _cjk,
    "emoji": _emoji,
    "base64": _base64,
    "logs": _logs,
}


def class_texts(kind: str, total_chars: int, *, seed: int) -> list[str]:
    """Messages of one text class, about ``total_chars`` characters in all, with
    log-normal lengths around 600 characters. Every ``seed`` gives different text: new
    made-up words, identifiers, numbers and random bytes, so a benchmark that takes a new
    seed per repetition counts text no cache has seen (frequent words still recur, as in
    real traffic)."""
    gen = _GENERATORS[kind]
    rng = random.Random(f"{kind}/{seed}")
    out: list[str] = []
    size = 0
    while size < total_chars:
        length = min(MAX_TOOL_CHARS, max(1, int(rng.lognormvariate(math.log(600), 1.0))))
        out.append(gen(rng, length))
        size += length
    return out
