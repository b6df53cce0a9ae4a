"""Benchmark 7: context quality: what a compacted context still holds.

Transcripts generated here, deterministically (seeded), in four classes: coding sessions
(parallel tool calls in the Anthropic and the OpenAI style, test runs, tracebacks, Go
panics, commits), multi-user chat (several people, tickets, incidents, links), support
conversations (order and account ids, amounts in several currencies, tracking links)
and Chinese and Japanese text with base64 attachments. Each message plants "specifics"
of seven categories (path, command, url, id, number, version, error) whose place is
known, so retention is measured against the generator's ground truth, not against the
extractor under test. The first user message states the thread's goal with a phrase
found nowhere else.

Two sets of the same transcripts (same seeds, same messages) differ only in where the
specifics come from. **With reuse** (the targets' measure): real sessions come back to
the same files, test commands, order ids, dashboards and failing tests again and again
(an agent edits a handful of files for a long while, re-runs the same test command after
each change, a support case names its order and amount in most turns), while new ones
keep appearing, ever more rarely. So each transcript has a pool of entities per
category: a reference is to a new entity at the rate of Heaps' law (distinct entities
after n references grow as K n^beta; beta = 0.6, the middle of the 0.4 to 0.7 that
vocabulary growth measures in text and code, K = 2; numbers beta = 0.75, because measured
values such as timings, sizes and counts are mostly fresh), else to one already seen,
picked by its rank r in the category's recency stack with weight 1/r (the LRU stack
model of locality of reference: a working set that drifts as the work moves on), and
names are made of words programmers use (``src/lease/worker_12.py``). The parameters come
from those observations, not from the target: a 3,000-message transcript still names
about 900 distinct specifics (about 8 tokens each), more than an 8,000-token budget
holds. **All-unique** (the stress case, rows marked so): every reference is to a
specific never seen before or after, named with random letters (about twice the
tokens): about two new ones per message, so a long window's evidence is many times the
budget; no transcript of a real session looks like that.

Each strategy builds the thread's context through the service's own pure assembly
(``assemble``, the same code a BuildContext runs after loading) with the exact
``gpt-4o`` counter, rolling: a build every ``step`` messages, the summary a build makes
stored and reused by the next ones, as the service does; and once over the whole window
(one compaction of up to 3,000 messages). The summarizer's model is a local fake of the
Anthropic API that answers like a lossy model (the six sections in prose, no paths, ids
or numbers), so whatever survives is carried by the ledger. langchain's
``trim_messages`` (strategy "last", the same per-message token counts, starting on a
human message) runs on the same transcripts.

Measured at the last build: **retention**, of the specifics planted in the messages the
context does not hold whole (summarized, dropped, cut or elided), the share found
verbatim anywhere in the context's text; **goal kept**, whether the goal phrase is in the
context (after the rolling run's compactions, and after one compaction of the whole
window); **budget truth**, the OpenAI rendering counted with o200k_base plus the chat
format's 3 tokens per message and 3 for the reply, over the budget; **valid**, whether
the Anthropic and OpenAI renderings obey the APIs' pairing and alternation rules;
**recent kept**, how many of the newest messages are in the context unchanged.

Two ceilings bound summarize's measured retention (they are not targets): each fills a
room with the distinct specifics the build folded or dropped, each at what it costs as a
ledger entry (its text after a space and a separator; its provenance free), the most
lost mentions per token first, the last one in part (no choice of whole entries keeps
more). **ceiling**: the room is the whole history budget (less the system prompt, the
reply's priming and the ledger's heading), as if the context held nothing else.
**ceiling beside its recent part**: the room is what the build gave its ledger (the
ledger's tokens and any budget left unused), and what the messages it kept whole hold
is free: how close the ledger comes to the best any ledger of its size could do.
"""

import base64
import bisect
import json
import random
import string
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.child import REPO
from bench.model import Section, Target
from bench.sizes import Sizes
from bench.stats import progress

CATEGORIES = ("path", "command", "url", "id", "number", "version", "error")
STRATEGIES = ("truncate", "summarize", "summarize+elide")
STRESS_STRATEGIES = ("truncate", "summarize")
STRESS = " (all-unique stress)"
MODEL = "gpt-4o"


@dataclass
class Transcript:
    kind: str
    items: list[Any]  # HistoryItem
    planted: dict[int, list[tuple[str, str]]]  # message id -> [(category, text)]
    goal: str
    realistic: bool = True
    length: int = 0  # the length asked for (the transcript ends on a whole turn)


@dataclass
class Outcome:
    """One strategy on one transcript at one budget."""

    lost: dict[str, int] = field(default_factory=dict)  # category -> planted, not whole
    kept: dict[str, int] = field(default_factory=dict)  # ... of which found verbatim
    goal_kept: bool = False
    compactions: int = 0
    ratio: float = 0.0  # rendered tokens / budget, worst build
    valid: bool = True
    recent: int = 0
    ceiling: dict[str, float] = field(default_factory=dict)  # category -> at most kept
    beside: dict[str, float] = field(default_factory=dict)  # ... by a ledger of its room
    distinct: int = 0  # distinct specifics among the lost
    bare_tokens: int = 0  # what those cost, one per line as the ledger frames them


# ------------------------------------------------------------------ the transcripts


class Gen:
    """Random specifics of each category, unique within a transcript. With ``vocabulary``
    their names are made of words programmers use (``src/lease/worker_12.py``), as real
    names are; without, of random letters (``src/qzkfjw/xbnqa_12.py``, the stress case,
    about twice the tokens)."""

    def __init__(self, seed: int, vocabulary: bool = False) -> None:
        self.r = random.Random(seed)
        self.n = 0
        self.vocabulary = vocabulary

    def word(self, k: int = 6) -> str:
        if self.vocabulary:
            return self.r.choice(WORDS)[:k]
        return "".join(self.r.choice(string.ascii_lowercase) for _ in range(k))

    def hex(self, k: int) -> str:
        return "".join(self.r.choice("0123456789abcdef") for _ in range(k))

    def path(self) -> str:
        self.n += 1
        forms = [
            f"src/{self.word()}/{self.word(5)}_{self.n}.py",
            f"/var/log/{self.word()}/{self.word(4)}-{self.n}.log",
            f"internal/{self.word()}/{self.word()}{self.n}.go",
            f"~/projects/{self.word()}/config_{self.n}.yaml",
            f"tests/test_{self.word()}_{self.n}.py",
        ]
        return self.r.choice(forms)

    def command(self) -> str:
        self.n += 1
        forms = [
            f"pytest -x -q tests/test_{self.word()}_{self.n}.py",
            f"go test ./internal/{self.word()}/... -run Test{self.word().title()}{self.n}",
            f"git log --oneline -n {self.n % 40 + 2}",
            f"kubectl rollout restart deploy/{self.word()}-{self.n}",
            f"cargo build --release -p {self.word()}{self.n}",
        ]
        return self.r.choice(forms)

    def url(self) -> str:
        self.n += 1
        forms = [
            f"https://github.com/{self.word()}/{self.word()}/pull/{self.n + 100}",
            f"https://grafana.example.com/d/{self.hex(8)}?from=now-{self.n % 24 + 1}h",
            f"https://docs.example.org/{self.word()}/{self.word()}.html#{self.word(4)}",
            f"https://track.example.net/parcel/{self.hex(10)}",
        ]
        return self.r.choice(forms)

    def ident(self) -> str:
        self.n += 1
        forms = [
            self.hex(7) if self.r.random() < 0.5 else str(self.r.randint(1, 9)) + self.hex(6),
            self.hex(40),
            f"{self.hex(8)}-{self.hex(4)}-4{self.hex(3)}-a{self.hex(3)}-{self.hex(12)}",
            f"ORD-{self.r.randint(1000, 99999)}-{self.word(2).upper()}",
            f"ACCT-{self.r.randint(10000, 999999)}",
            f"PAY-{self.r.randint(100, 9999)}",
            f"#{self.r.randint(100, 9999)}",
        ]
        return self.r.choice(forms)

    def number(self) -> str:
        r = self.r
        forms = [
            f"€{r.randint(1, 2000)}.{r.randint(10, 99)}",
            f"${r.randint(1, 9)},{r.randint(100, 999)}.{r.randint(10, 99)}",
            f"{r.randint(2, 900)} ms",
            f"{r.randint(1, 64)}.{r.randint(1, 9)} GB",
            f"{r.randint(10, 999)} passed",
            f"{r.randint(2, 99)} retries",
            f"{r.randint(2, 99)}.{r.randint(1, 9)}%",
        ]
        return r.choice(forms)

    def version(self) -> str:
        r = self.r
        forms = [
            f"v{r.randint(0, 3)}.{r.randint(0, 40)}.{r.randint(0, 20)}",
            f"{r.randint(1, 9)}.{r.randint(0, 30)}.{r.randint(0, 15)}",
            f"v{r.randint(1, 5)}.{r.randint(0, 9)}.0-rc{r.randint(1, 4)}",
        ]
        return r.choice(forms)

    def error(self) -> str:
        self.n += 1
        forms = [
            f"panic: runtime error: index out of range [{self.n % 9 + 1}] with length {self.n % 9}",
            f"KeyError: '{self.word()}_{self.n}'",
            f"error[E0{self.r.randint(100, 799)}]: mismatched types in {self.word()}",
            f"Error: ENOENT: no such file or directory, open '{self.word()}{self.n}.json'",
            f"java.lang.IllegalStateException: {self.word()} not ready ({self.n})",
            f"FAILED tests/test_{self.word()}.py::test_{self.word()}_{self.n} - assert "
            f"{self.n} == {self.n + 1}",
        ]
        return self.r.choice(forms)

    def of(self, category: str) -> str:
        return {
            "path": self.path,
            "command": self.command,
            "url": self.url,
            "id": self.ident,
            "number": self.number,
            "version": self.version,
            "error": self.error,
        }[category]()


WORDS = tuple(
    [
        "api",
        "auth",
        "batch",
        "cache",
        "check",
        "client",
        "config",
        "core",
        "cron",
        "data",
        "db",
        "deploy",
        "diff",
        "event",
        "fetch",
        "file",
        "gate",
        "grpc",
        "handler",
        "index",
        "job",
        "lease",
        "limit",
        "lock",
        "log",
        "merge",
        "meta",
        "model",
        "node",
        "order",
        "parse",
        "plan",
        "pool",
        "proto",
        "queue",
        "rate",
        "read",
        "repo",
        "retry",
        "route",
        "rpc",
        "sched",
        "schema",
        "server",
        "shard",
        "slot",
        "sort",
        "spec",
        "state",
        "store",
        "stream",
        "sync",
        "task",
        "tenant",
        "test",
        "token",
        "trace",
        "user",
        "util",
        "view",
        "window",
        "worker",
        "write",
    ]
)
"""Words of real code and file names (truncated to the length a form asks for)."""

HEAPS = {c: (2.0, 0.6) for c in CATEGORIES} | {"number": (2.0, 0.75)}
"""Per category (K, beta) of Heaps' law, distinct entities after n references ~ K n^beta:
beta 0.6, the middle of what vocabulary growth measures in text and code (0.4-0.7);
numbers 0.75, because measured values (timings, sizes, counts) are mostly fresh."""

STACK_ZIPF = 1.0
"""A reused entity is picked by its rank in the category's recency stack (1 = the one
referenced last) with weight 1/rank^s: the LRU stack model of locality of reference."""


class Pool:
    """The entities a transcript refers to, with reuse, deterministic (seeded).

    Each reference is to a new entity with Heaps' law's rate, K beta n^(beta-1) after n
    references of the category (the first always new), else to one already seen, chosen
    from the category's recency stack by :data:`STACK_ZIPF`; the chosen one moves to the
    top. So most references go to a small working set that drifts as the work moves on,
    and new files, commands, ids and errors keep appearing, ever more rarely."""

    def __init__(self, gen: Gen) -> None:
        self.gen = gen
        self.stacks: dict[str, list[str]] = {c: [] for c in CATEGORIES}
        self.refs = dict.fromkeys(CATEGORIES, 0)
        self._cum: list[float] = []

    def _rank(self, size: int) -> int:
        while len(self._cum) < size:
            k = len(self._cum) + 1
            self._cum.append((self._cum[-1] if self._cum else 0.0) + 1.0 / k**STACK_ZIPF)
        return bisect.bisect_left(self._cum, self.gen.r.random() * self._cum[size - 1])

    def of(self, category: str) -> str:
        stack, n = self.stacks[category], self.refs[category]
        self.refs[category] = n + 1
        k, beta = HEAPS[category]
        if not stack or self.gen.r.random() < k * beta * (n + 1) ** (beta - 1):
            text = self.gen.of(category)
        else:
            text = stack.pop(min(self._rank(len(stack)), len(stack) - 1))
        stack.insert(0, text)
        return text


FILLER = (
    "Let me look at how this fits together before changing anything. "
    "I think the simplest thing is to keep the behaviour and only move the check. "
    "That matches what we saw yesterday, so the fix should be small. "
)
CODE = (
    "def handle(self, req):\n    if not req.ok:\n        raise ValueError('Error: bad request')\n"
    "    return self.next(req)\n"
)
GOALS = {
    "coding": "stop the double-leasing of worker slots in the scheduler",
    "chat": "agree on the rollback plan for the quarantined payments cluster",
    "support": "refund the duplicated charge on the customer's spring order",
    "cjk": "把重复扣款的订单退款并通知客户 (refund the double-charged order)",
}


def _items(kind: str, n: int, seed: int, realistic: bool = True) -> Transcript:
    from contextd.domain.context import HistoryItem
    from contextd.domain.model import Role

    g = Gen(seed, vocabulary=realistic)
    r = g.r
    source = Pool(g).of if realistic else g.of
    items: list[Any] = []
    planted: dict[int, list[tuple[str, str]]] = {}
    goal = GOALS[kind]
    items.append(HistoryItem(1, Role.USER, f"Please help me {goal}. Here is what I know so far."))

    def plant(mid: int, cats: Sequence[str]) -> list[str]:
        out = [source(c) for c in cats]
        planted.setdefault(mid, []).extend(zip(cats, out, strict=True))
        return out

    def add(role: Any, content: str, **kw: Any) -> int:
        mid = len(items) + 1
        items.append(HistoryItem(mid, role, content, **kw))
        return mid

    turn = 0
    while len(items) < n:
        turn += 1
        mid = len(items) + 1
        if kind == "coding":
            (p,) = plant(mid, ["path"])
            add(Role.USER, f"Next, check {p} — it looks wrong since the last deploy.")
            calls = []
            results: list[tuple[str, str]] = []
            width = r.choice((1, 2, 3))
            call_mid = len(items) + 1
            cmds = plant(call_mid, ["command"] * width)
            openai = turn % 2 == 0
            for cmd in cmds:
                cid = f"call_{g.hex(12)}" if openai else f"toolu_01{g.hex(16)}"
                args = {"command": cmd, "timeout": 120}
                if openai:
                    calls.append(
                        {
                            "id": cid,
                            "type": "function",
                            "function": {"name": "bash", "arguments": json.dumps(args)},
                        }
                    )
                else:
                    calls.append({"id": cid, "name": "bash", "input": args})
                results.append((cid, cmd))
            add(Role.TOOL_USE, "Running the checks.", tool_calls=json.dumps(calls))
            for k, (cid, _cmd) in enumerate(results):
                rid = len(items) + 1
                cats = ["number", "error", "id"] if k == 0 else ["path", "version", "url"]
                e = plant(rid, cats)
                lines = r.randint(3, 12) if (turn + k) % 4 else r.randint(120, 200)
                body = (
                    f"collected tests\n{CODE}"
                    + "\n".join(f"line {i}: {g.word()} ok" for i in range(lines))
                    + f"\n{e[0]} | {e[1]}\ncommit {e[2]}\n"
                )
                add(Role.TOOL_RESULT, body, tool_call_id=cid)
            aid = len(items) + 1
            (u,) = plant(aid, ["url"])
            add(Role.ASSISTANT, f"{FILLER}See {u} for the details.")
        elif kind == "chat":
            who = r.choice(("alice", "bob", "chen", "dara"))
            cats = r.sample(CATEGORIES, 2)
            s = plant(mid, cats)
            add(Role.USER, f"{who}: {FILLER[:90]} {s[0]} and also {s[1]}.")
            aid = len(items) + 1
            (t,) = plant(aid, ["id"])
            add(Role.ASSISTANT, f"Noted for {who}; I filed {t}. {FILLER[:120]}")
        elif kind == "support":
            s = plant(mid, ["id", "number"])
            add(Role.USER, f"Hi, my order {s[0]} was charged {s[1]} twice, can you check?")
            aid = len(items) + 1
            s2 = plant(aid, ["url", "id"])
            add(
                Role.ASSISTANT,
                f"I'm sorry about that. The tracking link is {s2[0]} and the case is {s2[1]}.",
            )
        else:  # cjk
            s = plant(mid, ["id", "number", "path"])
            blob = base64.b64encode(r.randbytes(r.randint(300, 900))).decode()
            if turn % 2:
                text = (
                    f"订单{s[0]}的金额为{s[1]}\uff0c请查看附件 {s[2]} 。"
                    f"附件: data:image/png;base64,{blob}"
                )
            else:
                text = (
                    f"注文{s[0]}の請求は{s[1]}でした。ファイル {s[2]} を確認してください。"
                    f"{blob[:200]}"
                )
            add(Role.USER, text)
            aid = len(items) + 1
            (v,) = plant(aid, ["version"])
            add(Role.ASSISTANT, f"了解しました。バージョン {v} で修正済みです。" + FILLER[:60])
    items = items[:n]
    planted = {k: v for k, v in planted.items() if k <= n}
    # A tool group cut at the end would be repaired, not measured: end on a whole turn.
    while items and items[-1].role.name in ("TOOL_USE",):
        planted.pop(items.pop().id, None)
    return Transcript(kind, items, planted, goal, realistic, n)


def transcripts(sizes_: Sequence[int], realistic: bool = True) -> list[Transcript]:
    out = []
    for i, kind in enumerate(("coding", "chat", "support", "cjk")):
        for j, n in enumerate(sizes_):
            out.append(_items(kind, n, seed=1_000 * i + j, realistic=realistic))
    return out


# ------------------------------------------------------------------ measuring


def _context_text(ctx: Any) -> str:
    parts = [ctx.system_prompt, ctx.status]
    for it in ctx.history:
        parts.append(it.content)
        if it.tool_calls:
            from contextd.domain.context import parse_tool_calls

            for call in parse_tool_calls(it.tool_calls):
                parts.append(call.name)
                parts.append(call.arguments_json)
                if isinstance(call.input, dict):
                    parts.extend(str(v) for v in call.input.values())
    return "\n".join(parts)


def openai_tokens(messages: list[dict[str, Any]]) -> int:
    """OpenAI's chat accounting: per message 3 tokens plus its fields' tokens (content,
    role, name, tool_calls JSON), plus 3 for the reply's priming."""
    from contextd import core

    texts: list[str] = []
    for m in messages:
        for value in m.values():
            if isinstance(value, str):
                texts.append(value)
            elif value is not None:
                texts.append(json.dumps(value, ensure_ascii=False))
    return sum(core.count_tokens_batch(texts, "o200k_base")) + 3 * len(messages) + 3


def openai_valid(messages: list[dict[str, Any]]) -> bool:
    """Every tool message answers a call of the assistant message before its run of tool
    messages, every call is answered, and no message is empty."""
    pending: set[str] = set()
    for m in messages:
        role = m.get("role")
        if role == "tool":
            if m.get("tool_call_id") not in pending:
                return False
            pending.discard(m["tool_call_id"])
            continue
        if pending:
            return False
        if role == "assistant" and m.get("tool_calls"):
            pending = {c["id"] for c in m["tool_calls"]}
        elif not str(m.get("content") or "").strip():
            return False
    return not pending


def anthropic_valid(payload: dict[str, Any]) -> bool:
    """Roles alternate from a user turn, every tool_result answers a tool_use of the turn
    before, every tool_use is answered next turn, no text block is blank."""
    messages = payload.get("messages", [])
    if not messages or messages[0]["role"] != "user":
        return False
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        if i and m["role"] == messages[i - 1]["role"]:
            return False
        blocks = m["content"] if isinstance(m["content"], list) else [m["content"]]
        results = set()
        calls = set()
        for b in blocks:
            if isinstance(b, str):
                if not b.strip():
                    return False
            elif b.get("type") == "text" and not b.get("text", "").strip():
                return False
            elif b.get("type") == "tool_result":
                results.add(b["tool_use_id"])
            elif b.get("type") == "tool_use":
                calls.add(b["id"])
        if results != open_calls:  # each call answered in the very next turn, nothing else
            return False
        open_calls = calls
    return not open_calls


def measure(t: Transcript, ctx: Any, budget: int, outcome: Outcome) -> None:
    from contextd.app.build.render import to_anthropic, to_openai

    text = _context_text(ctx)
    whole = {it.id: it.content for it in ctx.history if not it.is_summary}
    for mid, specs in t.planted.items():
        original = next((it for it in t.items if it.id == mid), None)
        if original is not None and whole.get(mid) == original.content:
            continue  # held whole: not summarized or dropped
        for cat, s in specs:
            outcome.lost[cat] = outcome.lost.get(cat, 0) + 1
            outcome.kept[cat] = outcome.kept.get(cat, 0) + (s in text)
    outcome.goal_kept = t.goal in text
    _ceiling(t, ctx, budget, whole, outcome)
    openai = to_openai(ctx)
    outcome.ratio = max(outcome.ratio, openai_tokens(openai) / budget)
    outcome.valid = outcome.valid and openai_valid(openai) and anthropic_valid(to_anthropic(ctx))
    recent = 0
    for it in reversed(t.items):
        if whole.get(it.id) != it.content:
            break
        recent += 1
    outcome.recent = recent


def _knapsack(
    texts: list[str], mentions: dict[str, int], costs: list[int], room: int
) -> dict[str, float]:
    """Per text, how much of it (0 to 1) a fractional knapsack of ``room`` tokens holds,
    the most mentions per token first: no choice of whole texts holds more mentions."""
    held: dict[str, float] = {}
    for k in sorted(range(len(texts)), key=lambda k: -mentions[texts[k]] / max(1, costs[k])):
        if room <= 0:
            break
        held[texts[k]] = min(1.0, room / max(1, costs[k]))
        room -= costs[k]
    return held


def _ceiling(t: Transcript, ctx: Any, budget: int, whole: dict[int, str], outcome: Outcome) -> None:
    """Two bounds on the measured retention (not targets), each a fractional knapsack
    over the distinct lost specifics, each at what it costs as a ledger entry (its text
    after a space and a separator; provenance free), the most lost mentions per token
    first. ``ceiling``: the most of ``outcome.lost`` any context of ``budget`` could hold,
    the history budget (less the system prompt, the reply's priming and the ledger's
    heading) filled with nothing but those specifics. ``beside``: the most a ledger of
    this build's room could hold beside the messages the build kept whole (what those
    hold is free): the room is the ledger's tokens and the budget left unused."""
    from contextd import core
    from contextd.app.build import ledger

    mentions: dict[str, int] = {}
    category: dict[str, str] = {}
    for mid, specs in t.planted.items():
        original = t.items[mid - 1] if 0 < mid <= len(t.items) else None
        if original is not None and original.id == mid and whole.get(mid) == original.content:
            continue
        for cat, s in specs:
            mentions[s] = mentions.get(s, 0) + 1
            category.setdefault(s, cat)
    texts = list(mentions)
    fixed = [ctx.system_prompt, f"{ledger.SPECIFICS_HEADING}\n{ledger.LEGEND}", ledger.SEPARATOR]
    *head, separator = core.count_tokens_batch(fixed, "o200k_base")
    costs = [c + separator for c in core.count_tokens_batch([" " + x for x in texts], "o200k_base")]
    room = budget - sum(head) - 3 * 2 - 3  # two messages' framing and the reply's priming
    outcome.distinct, outcome.bare_tokens = len(texts), sum(costs)
    outcome.ceiling = dict.fromkeys(CATEGORIES, 0.0)
    for text, part in _knapsack(texts, mentions, costs, room).items():
        outcome.ceiling[category[text]] += part * mentions[text]
    kept_whole = "\n".join(
        part for it in ctx.history if not it.is_summary for part in (it.content, it.tool_calls)
    )
    free = [x for x in texts if x in kept_whole]
    rest = [k for k, x in enumerate(texts) if x not in kept_whole]
    room = ctx.stats.ledger_tokens + max(0, budget - ctx.stats.total_tokens)
    held = _knapsack([texts[k] for k in rest], mentions, [costs[k] for k in rest], room)
    outcome.beside = dict.fromkeys(CATEGORIES, 0.0)
    for text, part in [*((x, 1.0) for x in free), *held.items()]:
        outcome.beside[category[text]] += part * mentions[text]


def _options(strategy: str) -> Any:
    from contextd.domain.context import StrategyOptions

    return StrategyOptions(
        summarize=strategy.startswith("summarize"),
        elide_tool_results=strategy.endswith("elide"),
    )


def run_strategy(
    t: Transcript, strategy: str, budget: int, summarizer: Any, step: int, rolling: bool
) -> Outcome:
    from contextd.app.build.assembly import assemble
    from contextd.app.build.build_options import governing_formats
    from contextd.domain.context import HistoryItem, counter_for_model

    count = counter_for_model(MODEL)
    opts = _options(strategy)
    outcome = Outcome()
    summary: Any = None
    ends = [*range(step, len(t.items), step), len(t.items)] if rolling else [len(t.items)]
    ctx: Any = None
    for end in ends:
        window = [*t.items[:end], *([summary] if summary is not None else [])]
        ctx = assemble(
            system_prompt="You are a helpful agent.",
            budget=budget,
            count_tokens=count,
            history=window,
            options=opts,
            summarizer=summarizer,
            # What a BuildContext for gpt-4o bounds: its own provider's rendering.
            formats=governing_formats("gpt-4o", ()),
        )
        if ctx.stats.summarizer_path in ("llm", "fallback") and ctx.summary is not None:
            outcome.compactions += 1
            s = ctx.summary
            summary = HistoryItem(
                100_000 + end,
                s.role,
                s.content,
                is_summary=True,
                metadata=s.metadata,
                summary_of=s.summary_of,
            )
        if end != ends[-1]:
            from contextd.app.build.render import to_openai

            outcome.ratio = max(outcome.ratio, openai_tokens(to_openai(ctx)) / budget)
    measure(t, ctx, budget, outcome)
    return outcome


def run_langchain(t: Transcript, budget: int) -> Outcome:
    from langchain_core.messages import (
        AIMessage,
        BaseMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
        convert_to_openai_messages,
        trim_messages,
    )

    from contextd import core
    from contextd.domain.context import parse_tool_calls
    from contextd.domain.model import Role

    msgs: list[Any] = [SystemMessage(content="You are a helpful agent.")]
    ids: list[int] = [0]
    for it in t.items:
        if it.role is Role.USER:
            msgs.append(HumanMessage(content=it.content))
        elif it.role is Role.TOOL_RESULT:
            msgs.append(ToolMessage(content=it.content, tool_call_id=it.tool_call_id))
        else:
            calls = [
                {"id": c.id, "name": c.name, "args": c.input if isinstance(c.input, dict) else {}}
                for c in (parse_tool_calls(it.tool_calls) if it.tool_calls else [])
            ]
            msgs.append(AIMessage(content=it.content, tool_calls=calls))
        ids.append(it.id)
    by_id = {id(m): i for i, m in enumerate(msgs)}
    texts = [
        (m.content if isinstance(m.content, str) else "")
        + json.dumps(getattr(m, "tool_calls", None) or "")
        for m in msgs
    ]
    counts = [n + 3 for n in core.count_tokens_batch(texts, "o200k_base")]

    def counter(message: BaseMessage) -> int:
        return counts[by_id[id(message)]]

    kept = trim_messages(
        msgs,
        max_tokens=budget - 3,
        token_counter=counter,
        strategy="last",
        include_system=True,
        start_on="human",
    )
    openai: list[dict[str, Any]] = convert_to_openai_messages(kept)
    outcome = Outcome(compactions=0)
    text = "\n".join(texts[by_id[id(m)]] for m in kept)
    text += "\n" + "\n".join(json.dumps(m, ensure_ascii=False) for m in openai)
    held = {ids[by_id[id(m)]] for m in kept}
    for mid, specs in t.planted.items():
        if mid in held:
            continue
        for cat, s in specs:
            outcome.lost[cat] = outcome.lost.get(cat, 0) + 1
            outcome.kept[cat] = outcome.kept.get(cat, 0) + (s in text)
    outcome.goal_kept = t.goal in text
    outcome.ratio = openai_tokens(openai) / budget
    outcome.valid = openai_valid(openai)
    recent = 0
    for it in reversed(t.items):
        if it.id not in held:
            break
        recent += 1
    outcome.recent = recent
    return outcome


# ------------------------------------------------------------------ the section


def _label(strategy: str, t: Transcript) -> str:
    return strategy if t.realistic else strategy + STRESS


def _pct(kept: int, lost: int) -> str:
    return f"{100 * kept / lost:.1f}%" if lost else "n/a"


def run(sz: Sizes) -> Section:
    sys.path.insert(0, str(REPO / "tests"))
    from fake_anthropic import FakeAnthropic  # type: ignore[import-not-found]

    from contextd.app.build.summarizer import AnthropicConfig, AnthropicSummarizer

    quick = sz.mode == "quick"
    lengths = (200,) if quick else (300, 1_000, 3_000)
    budgets = (8_000,) if quick else (8_000, 32_000)
    step = 50 if quick else 100
    started = time.perf_counter()
    corpus = transcripts(lengths)
    stress = transcripts(lengths, realistic=False)
    progress(
        f"quality: {len(corpus)} transcripts with reuse and {len(stress)} all-unique ones of "
        f"{', '.join(map(str, lengths))} messages, budgets {budgets}"
    )
    results: dict[tuple[str, int], list[Outcome]] = {}
    one_shot: dict[int, list[bool]] = {}
    with FakeAnthropic() as fake:
        fake.reply_lossy()
        summarizer = AnthropicSummarizer(
            AnthropicConfig(api_key="bench", base_url=fake.base_url, timeout_s=30.0)
        )
        try:
            for t in [*corpus, *stress]:
                for budget in budgets:
                    for strategy in STRATEGIES if t.realistic else STRESS_STRATEGIES:
                        o = run_strategy(t, strategy, budget, summarizer, step, rolling=True)
                        results.setdefault((_label(strategy, t), budget), []).append(o)
                    if t.realistic:
                        results.setdefault(("langchain trim_messages", budget), []).append(
                            run_langchain(t, budget)
                        )
                    if t.length == max(lengths):
                        o = run_strategy(t, "summarize", budget, summarizer, step, rolling=False)
                        one_shot.setdefault(budget, []).append(o.goal_kept)
                kind = t.kind if t.realistic else f"{t.kind}, all-unique"
                progress(f"  {kind} ({len(t.items)} messages) done")
        finally:
            summarizer.close()
        model_calls = len(fake.requests)
    headers = [
        "strategy",
        "budget",
        *CATEGORIES,
        "overall",
        "goal kept",
        "compactions",
        "max tokens / budget",
        "valid",
        "recent kept (median)",
    ]
    rows: list[list[str]] = []
    summary: dict[str, Any] = {}
    for (strategy, budget), outs in results.items():
        lost = {c: sum(o.lost.get(c, 0) for o in outs) for c in CATEGORIES}
        kept = {c: sum(o.kept.get(c, 0) for o in outs) for c in CATEGORIES}
        totals = (sum(kept.values()), sum(lost.values()))
        recent = sorted(o.recent for o in outs)[len(outs) // 2]
        rows.append(
            [
                strategy,
                f"{budget:,}",
                *(_pct(kept[c], lost[c]) for c in CATEGORIES),
                _pct(*totals),
                f"{sum(o.goal_kept for o in outs)}/{len(outs)}",
                f"{min(o.compactions for o in outs)}-{max(o.compactions for o in outs)}",
                f"{max(o.ratio for o in outs):.3f}",
                f"{sum(o.valid for o in outs)}/{len(outs)}",
                str(recent),
            ]
        )
        bounded = strategy.startswith("summarize") and "elide" not in strategy
        bound = {c: sum(o.ceiling.get(c, 0.0) for o in outs) for c in CATEGORIES}
        if bounded:
            rows.append(
                [
                    f"{strategy}: ceiling",
                    f"{budget:,}",
                    *(_pct(round(bound[c]), lost[c]) for c in CATEGORIES),
                    _pct(round(sum(bound.values())), totals[1]),
                    *(["—"] * 5),
                ]
            )
            near = {c: sum(o.beside.get(c, 0.0) for o in outs) for c in CATEGORIES}
            rows.append(
                [
                    f"{strategy}: ceiling beside its recent part",
                    f"{budget:,}",
                    *(_pct(round(near[c]), lost[c]) for c in CATEGORIES),
                    _pct(round(sum(near.values())), totals[1]),
                    *(["—"] * 5),
                ]
            )
        summary[f"{strategy}@{budget}"] = {
            "lost": lost,
            "kept": kept,
            "goal": [o.goal_kept for o in outs],
            "compactions": [o.compactions for o in outs],
            "ratio": [o.ratio for o in outs],
            "valid": [o.valid for o in outs],
            "recent": [o.recent for o in outs],
            "ceiling": bound if bounded else {},
            "beside": {c: sum(o.beside.get(c, 0.0) for o in outs) for c in CATEGORIES},
            "distinct": [o.distinct for o in outs],
            "bare_tokens": [o.bare_tokens for o in outs],
        }

    def rate(strategy: str, budget: int, cat: str | None = None) -> float:
        data = summary[f"{strategy}@{budget}"]
        cats = [cat] if cat else list(CATEGORIES)
        lost = sum(data["lost"][c] for c in cats)
        return sum(data["kept"][c] for c in cats) / lost if lost else 1.0

    def by_length(strategy: str, budget: int) -> str:
        outs = results[(strategy, budget)]
        parts = []
        source = stress if strategy.endswith(STRESS) else corpus
        for n in lengths:
            cell = [o for t, o in zip(source, outs, strict=True) if t.length == n]
            lost = sum(sum(o.lost.values()) for o in cell)
            kept = sum(sum(o.kept.values()) for o in cell)
            bound = round(sum(sum(o.ceiling.values()) for o in cell))
            near = round(sum(sum(o.beside.values()) for o in cell))
            parts.append(
                f"{_pct(kept, lost)} of {lost:,} (ceiling beside its recent part "
                f"{_pct(near, lost)}, ceiling {_pct(bound, lost)}) at {n:,} messages"
            )
        return "; ".join(parts)

    best = max(budgets)
    low = min(budgets)
    low_cell = summary[f"summarize@{low}"]
    low_lost = max(1, sum(low_cell["lost"].values()))
    ceiling_low = sum(low_cell["ceiling"].values()) / low_lost
    beside_low = sum(low_cell["beside"].values()) / low_lost

    def room(strategy: str) -> str:
        """The distinct specifics the longest transcripts' last builds at the lowest budget
        folded or dropped, and what they cost as ledger entries (lowest to highest)."""
        source = stress if strategy.endswith(STRESS) else corpus
        cell = [
            o
            for t, o in zip(source, results[(strategy, low)], strict=True)
            if t.length == max(lengths)
        ]
        distinct = sorted(o.distinct for o in cell)
        tokens = sorted(o.bare_tokens for o in cell)
        return (
            f"{distinct[0]:,} to {distinct[-1]:,} distinct specifics, "
            f"{tokens[0]:,} to {tokens[-1]:,} tokens"
        )

    overall = min(rate("summarize", b) for b in budgets)
    worst_cat = min((rate("summarize", b, c), c, b) for b in budgets for c in CATEGORIES)
    rolling = ("summarize", "summarize" + STRESS)
    long_runs = [
        (g, n)
        for label in rolling
        for b in budgets
        for g, n in zip(
            summary[f"{label}@{b}"]["goal"], summary[f"{label}@{b}"]["compactions"], strict=True
        )
        if n >= 10
    ]
    rolling_goal = bool(long_runs) and all(g for g, _ in long_runs)
    ten = max((n for _, n in long_runs), default=0)
    shot = [g for b in budgets for g in one_shot.get(b, [])]
    ours = [*STRATEGIES, *(x + STRESS for x in STRESS_STRATEGIES)]
    over = max(max(summary[f"{s}@{b}"]["ratio"]) for s in ours for b in budgets)
    valid = all(all(summary[f"{s}@{b}"]["valid"]) for s in ours for b in budgets)
    lc_valid = [v for b in budgets for v in summary[f"langchain trim_messages@{b}"]["valid"]]
    stress_rate = {b: rate("summarize" + STRESS, b) for b in budgets}
    targets = [
        Target(
            "Specifics retention (summarize)",
            "≥ 95% overall",
            f"{100 * overall:.1f}% (lowest budget's overall; transcripts with reuse)",
            overall >= 0.95,
            "the split, not the room: the history budget holding nothing but what "
            f"summarize folded would keep {100 * ceiling_low:.1f}% of it at {low:,} tokens "
            "(the ceiling row), but the recent messages take their part (the ledger a "
            "quarter of the history budget, 0.6 more for each tenfold of the window past "
            "4 times the budget, 85% at 40 times), and beside what they left "
            f"no ledger could keep more than {100 * beside_low:.1f}% (the ceiling beside its "
            "recent part; the gap to it is mostly the entries' provenance, a source id a "
            "line); the fewest mentions per token go first, held for later builds, and a "
            "build says how many (see the retention by transcript length below the table)",
        ),
        Target(
            "Specifics retention per category (summarize)",
            "≥ 90% in every category",
            f"lowest: {worst_cat[1]} {100 * worst_cat[0]:.1f}% at {worst_cat[2]:,} tokens",
            worst_cat[0] >= 0.90,
            "see the table: the categories whose specifics are mostly mentioned once "
            "(measured numbers, errors) go first when the ledger is full",
        ),
        Target(
            "Goal kept after 10 rolling compactions",
            "present in every transcript",
            f"{sum(g for g, _ in long_runs)}/{len(long_runs)} runs with 10 or more "
            f"compactions (up to {ten}; both transcript sets)",
            rolling_goal if long_runs else None,
        ),
        Target(
            f"Goal kept after one compaction of a {max(lengths):,}-message window",
            "present in every transcript",
            f"{sum(shot)}/{len(shot)} (both transcript sets)",
            all(shot) if not quick else None,
        ),
        Target(
            "Renderings within budget (OpenAI accounting)",
            "≤ 1.0 x budget",
            f"worst {over:.3f} x budget",
            over <= 1.0,
            "a build bounds the rendering its model's provider counts (framing, tool_call "
            "JSON, placeholders); a rendering over it is a bug",
        ),
        Target(
            "Provider-valid renderings",
            "100%",
            f"{'100%' if valid else 'not all'} (langchain trim_messages: "
            f"{100 * sum(lc_valid) / max(1, len(lc_valid)):.0f}%)",
            valid,
        ),
    ]
    findings = [
        f"{len(corpus)} transcripts with reuse and {len(stress)} all-unique ones, "
        f"{len(results)} strategy x budget cells, {model_calls:,} calls to the lossy fake "
        f"model, in {time.perf_counter() - started:.0f} s.",
        *(
            f"summarize at {b:,} tokens, by transcript length: {by_length('summarize', b)}."
            for b in budgets
        ),
        "The targets are measured on the transcripts with reuse: real sessions come back "
        "to the same files, commands, ids and links again and again. The all-unique rows "
        "are the stress case of the same transcripts where every reference is to a "
        "specific never seen before or after (about two a message, random-letter names, "
        "about twice the tokens): "
        + "; ".join(
            f"summarize keeps {100 * stress_rate[b]:.1f}% at {b:,} tokens "
            f"({by_length('summarize' + STRESS, b)})"
            for b in budgets
        )
        + f". There what a {max(lengths):,}-message window's build at {low:,} tokens folded "
        f"names {room('summarize' + STRESS)} of bare text (each as a ledger entry), more "
        "than the whole budget: no verbatim ledger within the budget can hold it, so what "
        "is kept is what fits, the most mentioned per token (with reuse: "
        f"{room('summarize')}). The ceiling rows say how much any context of the budget "
        "could keep of what summarize folded or dropped: the history budget filled with "
        "nothing but those specifics, one per line as the ledger frames them (provenance "
        "free), the most mentions per token first; the targets are judged on the measured "
        "rows.",
        f"summarize kept {100 * rate('summarize', best):.1f}% of the specifics of what it "
        f"folded or dropped at {best:,} tokens; truncate kept "
        f"{100 * rate('truncate', best):.1f}%, langchain's trim_messages "
        f"{100 * rate('langchain trim_messages', best):.1f}% (what survives there is only "
        "what the recent messages repeat).",
    ]
    return Section(
        key="quality",
        title="7. Context quality: specifics, goal, budget, validity",
        method=__doc__ or "",
        headers=headers,
        rows=rows,
        targets=targets,
        findings=findings,
        raw={"cells": summary, "one_shot_goal": {str(k): v for k, v in one_shot.items()}},
    )
