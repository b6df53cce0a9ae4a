"""Excerpts of stored tool outputs added to a build (BuildOptions.tool_output_excerpts).

After the context is assembled, the scope's stored outputs are ranked against the
build's user message (as SelectRelevantToolOutputs ranks them: BM25, only outputs that
match), and the best k get excerpts (head, best-matching passages, tail: as
SelectRelevantToolOutputs' excerpt_tokens). Each output becomes one labelled block:

    <tool_output id="to_..." tool="read_log" args='{"path":"/var/log/app.log"}'>
    [bytes 0-1200 of 180000, head] ...
    </tool_output>

The blocks go after the history, with the status preamble (which renders after the
history and before the new user message, so the prompt-cache prefix is untouched), and
are counted in the budget: a block is added only while the whole context, recounted
with the build's counter, stays within the budget and the excerpts within
`tool_output_excerpts_max_tokens`; what does not fit is listed as left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from contextd.app.tool_output_reads import Excerpt, ResultReader, ranked_outputs
from contextd.domain.context import AssembledContext, TokenCounter
from contextd.domain.model import BuildOverrides, ContextKey
from contextd.domain.tool_outputs import ToolOutputFilter, ToolOutputPointer
from contextd.ports.tool_outputs import ToolOutputStore

DEFAULT_EXCERPT_TOKENS = 500
DEFAULT_EXCERPTS_MAX_TOKENS = 4_000
HEADING = "Stored tool outputs relevant to this message (read more with ReadToolOutput):"


@dataclass(frozen=True, slots=True)
class AddedExcerpts:
    """One output's excerpts as the build added them."""

    pointer: ToolOutputPointer
    score: float
    parts: tuple[Excerpt, ...]
    tokens: int


@dataclass(frozen=True, slots=True)
class ExcerptReport:
    added: tuple[AddedExcerpts, ...] = ()
    tokens: int = 0
    left_out_ids: tuple[str, ...] = ()
    candidates: int = 0


def block(pointer: ToolOutputPointer, parts: tuple[Excerpt, ...]) -> str:
    """One output's labelled excerpts: its tool, args and handle, each part with the
    byte range ReadToolOutput reads it (and on) from."""
    args = pointer.args_json.replace("'", "\\'")
    lines = [f'<tool_output id="{pointer.id}" tool="{pointer.tool_name}" args=\'{args}\'>']
    for e in parts:
        lines.append(f"[bytes {e.offset}-{e.offset + e.length} of {pointer.size_bytes}, {e.part}]")
        lines.append(e.text.rstrip("\n"))
    lines.append("</tool_output>")
    return "\n".join(lines)


def add_excerpts(
    store: ToolOutputStore,
    key: ContextKey,
    query: str,
    options: BuildOverrides,
    context: AssembledContext,
    count: TokenCounter,
    expired_through_us: int = 0,
) -> tuple[AssembledContext, ExcerptReport]:
    """`context` with the excerpts of the scope's outputs most relevant to `query`
    appended to its status part, within its budget (see the module docstring); none of
    an expired context (`expired_through_us`, see ToolOutputFilter)."""
    k = options.tool_output_excerpts or 0
    if k <= 0 or not query.strip():
        return context, ExcerptReport()
    per_output = options.tool_output_excerpt_tokens or DEFAULT_EXCERPT_TOKENS
    cap = options.tool_output_excerpts_max_tokens or DEFAULT_EXCERPTS_MAX_TOKENS
    where = ToolOutputFilter(
        key.tenant, key.agent, key.scope, expired_through_us=expired_through_us
    )
    ranked, candidates = ranked_outputs(store, where, query, k)
    stats = context.stats
    room = min(cap, stats.budget - stats.total_tokens)
    reader = ResultReader(store)
    blocks: list[str] = []
    added: list[AddedExcerpts] = []
    left_out: list[str] = []
    status, status_tokens = context.status, stats.status_tokens
    for pointer, score in ranked:
        parts = tuple(reader.excerpts(pointer, query, per_output))
        if not parts or room <= 0:
            left_out.append(pointer.id)
            continue
        text = block(pointer, parts)
        candidate = _joined(context.status, [*blocks, text])
        tokens = count([candidate])[0]
        if tokens - stats.status_tokens > room:
            left_out.append(pointer.id)
            continue
        blocks.append(text)
        added.append(AddedExcerpts(pointer, score, parts, tokens - status_tokens))
        status, status_tokens = candidate, tokens
    if not added:
        return context, ExcerptReport((), 0, tuple(left_out), candidates)
    spent = status_tokens - stats.status_tokens
    context = replace(context, status=status, stats=replace(stats, status_tokens=status_tokens))
    return context, ExcerptReport(tuple(added), spent, tuple(left_out), candidates)


def _joined(status: str, blocks: list[str]) -> str:
    excerpts = "\n\n".join([HEADING, *blocks])
    return f"{status}\n\n{excerpts}" if status else excerpts
