"""What the parts around the history cost (system prompt, docs, status block, new
message), remembered across builds by cost key, formats and the texts themselves
(`assembly._FRAMES`): every assembly with a cost key equals one without (which counts
everything afresh), whatever changed since the previous one."""

from __future__ import annotations

import itertools

from contextd.app.build.assembly import assemble
from contextd.domain.context import HistoryItem, counter_for_model
from contextd.domain.model import AgentDoc, Role

MODEL = "gpt-4o"


def _history() -> list[HistoryItem]:
    return [
        HistoryItem(i, Role.USER if i % 2 else Role.ASSISTANT, f"words of turn {i} " * 20)
        for i in range(1, 40)
    ]


def test_remembered_parts_equal_parts_counted_afresh() -> None:
    count = counter_for_model(MODEL)
    history = _history()
    systems = ["be brief", "be brief and kind, and say so " * 8]
    docs = [(), (AgentDoc("guide", "read the guide first " * 10),)]
    statuses = ["", "- thread main: running, 3 s ago", "- thread main: running, 4 s ago"]
    news = [None, "what next?", "what next? " * 40]
    formats = [("openai",), ("anthropic",), ("text",), ()]
    cases = list(itertools.product(systems, docs, statuses, news, formats))
    # Each case twice, in an order where neighbours differ in one part or in several.
    for system, doc, status, new, fmt in cases + cases[::-1]:
        for budget in (900, 3_000):
            args = {
                "system_prompt": system,
                "budget": budget,
                "count_tokens": count,
                "docs": doc,
                "status": status,
                "history": history,
                "new_message": new,
                "formats": fmt,
            }
            remembered = assemble(**args, cost_key=MODEL)  # type: ignore[arg-type]
            afresh = assemble(**args)  # type: ignore[arg-type]
            assert remembered == afresh, (system[:10], len(doc), status, new, fmt, budget)
