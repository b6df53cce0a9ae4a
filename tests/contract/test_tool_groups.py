"""Tool groups: a tool result carries the id of the tool_use that declared its call
(in the same append or an earlier one); anything else carries -1."""

from __future__ import annotations

from contextd.domain.batches import prepare_batch
from contextd.domain.model import AgentSettings, ContextKey, MessageBatch, NewMessage, Role
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store

from .support import BIG, key, where


def _messages(*items: tuple[Role, str, str, tuple[str, ...]]) -> MessageBatch:
    """(role, content, tool_call_id, declared call ids) per message."""
    return prepare_batch(
        [NewMessage(role=role, content=text, tool_call_id=call) for role, text, call, _ in items],
        "",
        [calls for *_, calls in items],
    )


def _use(*calls: str) -> tuple[Role, str, str, tuple[str, ...]]:
    return (Role.TOOL_USE, "", "", calls)


def _result(call: str, text: str = "output") -> tuple[Role, str, str, tuple[str, ...]]:
    return (Role.TOOL_RESULT, text, call, ())


def _groups(store: Store, k: ContextKey) -> list[int]:
    stored = [m.group_id for m in store.list_messages(where(k), None, None, BIG)]
    ref = store.context_ref(k)
    assert ref is not None
    columns = store.window_columns(ref, WindowSpec(0, 0)).column("group_id").to_pylist()
    assert columns == stored
    return stored


def test_results_tie_to_their_tool_use_in_the_same_or_a_later_append(store: Store) -> None:
    [ask, use, same] = store.append(
        key(),
        _messages((Role.USER, "find it", "", ()), _use("c1", "c2", "c3"), _result("c1")),
        AgentSettings(),
    )
    store.append(key(), _messages(_result("c3")), AgentSettings())
    store.append(key(), _messages(_result("c2"), (Role.ASSISTANT, "done", "", ())), AgentSettings())
    store.append(key(), _messages(_result("nope")), AgentSettings())
    assert _groups(store, key()) == [-1, use.id, use.id, use.id, use.id, -1, -1]
    assert ask.id != use.id != same.id


def test_call_ids_are_known_within_their_thread_only(store: Store) -> None:
    [use] = store.append(key(), _messages(_use("c1")), AgentSettings())
    neighbours = [key("t2"), key(scope="dm:1"), key(agent="a2"), key(tenant="other")]
    for k in neighbours:
        store.append(k, _messages(_result("c1")), AgentSettings())
        assert _groups(store, k) == [-1]
    store.append(key(), _messages(_result("c1")), AgentSettings())
    assert _groups(store, key()) == [use.id, use.id]


def test_an_agent_made_again_knows_none_of_the_old_calls(store: Store) -> None:
    store.append(key(), _messages(_use("c1")), AgentSettings())
    store.delete_agent("default", "a1")
    store.append(key(), _messages(_result("c1")), AgentSettings())
    assert _groups(store, key()) == [-1]
