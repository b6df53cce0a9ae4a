"""An append stores the same row however it is written: a message appended alone (to a
new thread or to an existing one) reads back exactly as the same message inside a
batch. (PostgreSQL writes a one-message append with INSERT and a batch with COPY, and
takes an existing thread's ids with its lock; see adapters/postgres/messages.py.)"""

from __future__ import annotations

from contextd.domain.batches import prepare_batch
from contextd.domain.model import AgentSettings, NewMessage, Role, StoredMessage
from contextd.ports.store import Store

from .support import BIG, START_US, key, where

_MESSAGES = [
    NewMessage(role=Role.USER, content="plain é 🌍", external_id="ext-1"),
    NewMessage(
        role=Role.TOOL_USE,
        content="",
        tool_calls='[{"id": "c1", "name": "ls", "arguments": "{}"}]',
        metadata='{"k": [1, 2]}',
        source_time_us=START_US - 5_000_000,
    ),
    NewMessage(role=Role.TOOL_RESULT, content="a\tb\nc \\ d", tool_call_id="c1"),
]
_CALLS: list[tuple[str, ...]] = [(), ("c1",), ()]


def _comparable(messages: list[StoredMessage]) -> list[tuple[object, ...]]:
    """Every stored field except those of position (id, thread, commit time); a group
    is given as the index of its tool_use in the thread."""
    index_of = {m.id: i for i, m in enumerate(messages)}
    return [
        (
            m.role,
            m.content,
            m.tool_calls,
            m.tool_call_id,
            m.external_id,
            m.metadata,
            m.token_estimate,
            m.token_count,
            m.tokenizer,
            m.source_time_us,
            m.sequence,
            m.is_summary,
            m.restored_from,
            index_of.get(m.group_id, m.group_id),
        )
        for m in messages
    ]


def test_a_message_appended_alone_is_stored_as_in_a_batch(store: Store) -> None:
    for message, calls in zip(_MESSAGES, _CALLS, strict=True):
        [receipt] = store.append(
            key("alone"), prepare_batch([message], "", [calls]), AgentSettings()
        )
        assert receipt.id > 0
    receipts = store.append(key("batch"), prepare_batch(_MESSAGES, "", _CALLS), AgentSettings())
    assert len({r.id for r in receipts}) == 3
    alone = store.list_messages(where(key("alone")), None, None, BIG)
    together = store.list_messages(where(key("batch")), None, None, BIG)
    assert _comparable(alone) == _comparable(together)
    assert [m.sequence for m in alone] == [1, 2, 3]
    assert alone[2].group_id == alone[1].id  # the result joined its tool_use's group
    assert len({m.id for m in alone + together}) == 6  # no id issued twice
