"""Agents: create, read, list, update (field sets, etags) and delete (counted, final)."""

from __future__ import annotations

import pytest

from contextd.domain.clock import ManualClock
from contextd.domain.errors import Aborted, AlreadyExists, NotFound
from contextd.domain.model import AgentDoc, AgentSettings, BuildOverrides
from contextd.domain.window import WindowSpec
from contextd.ports.store import Store

from .support import BIG, HOUR, START_US, batch, history, key, summary, where

SETTINGS = AgentSettings(
    system_prompt="be brief",
    docs=(AgentDoc("style", "short"), AgentDoc("facts", "the sky is blue")),
    rolling_window_us=HOUR,
    model="",
    build_options=BuildOverrides(truncate=True, keep_recent_tokens=500),
)


def test_a_created_agent_reads_back_as_given(store: Store, clock: ManualClock) -> None:
    created = store.create_agent("default", "a1", SETTINGS)
    assert START_US <= created.create_time_us <= clock.now_us()
    assert created.update_time_us == created.create_time_us
    for agent in (store.get_agent("default", "a1"), store.find_agent("default", "a1")):
        assert agent == created
    assert (created.system_prompt, created.docs, created.rolling_window_us) == (
        "be brief",
        SETTINGS.docs,
        HOUR,
    )
    assert created.build_options == SETTINGS.build_options
    assert (created.tenant, created.name) == ("default", "a1")


def test_names_are_taken_once_per_tenant(store: Store) -> None:
    store.create_agent("default", "a1", AgentSettings())
    with pytest.raises(AlreadyExists) as taken:
        store.create_agent("default", "a1", SETTINGS)
    assert taken.value.reason == "AGENT_EXISTS"
    assert store.get_agent("default", "a1").system_prompt == ""  # the first one stands
    other = store.create_agent("other", "a1", SETTINGS)
    assert other.tenant == "other" and other.system_prompt == "be brief"


def test_a_missing_agent_is_not_found(store: Store) -> None:
    store.create_agent("other", "a1", AgentSettings())
    with pytest.raises(NotFound) as missing:
        store.get_agent("default", "a1")
    assert missing.value.reason == "AGENT_NOT_FOUND"
    assert store.find_agent("default", "a1") is None


def test_agents_are_listed_by_name_a_page_at_a_time(store: Store) -> None:
    for name in ("b", "a", "d", "c", "e"):
        store.create_agent("default", name, AgentSettings())
    store.create_agent("other", "aa", AgentSettings())
    pages: list[list[str]] = []
    after: str | None = None
    while True:
        page = [a.name for a in store.list_agents("default", after, 2)]
        if not page:
            break
        pages.append(page)
        after = page[-1]
    assert pages == [["a", "b"], ["c", "d"], ["e"]]
    assert [a.name for a in store.list_agents("other", None, BIG)] == ["aa"]
    assert store.list_agents("nobody", None, BIG) == []


def test_an_update_sets_only_the_named_fields(store: Store, clock: ManualClock) -> None:
    first = store.create_agent("default", "a1", SETTINGS)
    clock.advance(HOUR)
    given = AgentSettings(
        system_prompt="be thorough",
        docs=(),
        rolling_window_us=2 * HOUR,
        build_options=BuildOverrides(truncate=False, summarize=True, keep_recent_tokens=None),
    )
    updated = store.update_agent("default", "a1", given, frozenset({"system_prompt"}))
    assert updated.system_prompt == "be thorough"
    assert (updated.docs, updated.rolling_window_us) == (SETTINGS.docs, HOUR)
    assert updated.build_options == SETTINGS.build_options
    assert updated.create_time_us == first.create_time_us
    assert first.update_time_us + HOUR < updated.update_time_us <= clock.now_us()
    assert updated.etag != first.etag
    assert store.get_agent("default", "a1") == updated

    # One build option at a time: the others are kept; None unsets one.
    options = store.update_agent(
        "default",
        "a1",
        given,
        frozenset({"build_options.summarize", "build_options.keep_recent_tokens", "docs"}),
    )
    assert options.build_options == BuildOverrides(truncate=True, summarize=True)
    assert options.docs == () and options.rolling_window_us == HOUR
    whole = store.update_agent("default", "a1", given, frozenset({"build_options"}))
    assert whole.build_options == given.build_options
    window = store.update_agent("default", "a1", given, frozenset({"rolling_window"}))
    assert window.rolling_window_us == 2 * HOUR and window.system_prompt == "be thorough"


def test_an_update_with_a_stale_etag_is_aborted(store: Store) -> None:
    first = store.create_agent("default", "a1", AgentSettings())
    second = store.update_agent(
        "default", "a1", AgentSettings(system_prompt="v2"), frozenset({"system_prompt"}), first.etag
    )
    with pytest.raises(Aborted) as stale:
        store.update_agent(
            "default",
            "a1",
            AgentSettings(system_prompt="v3"),
            frozenset({"system_prompt"}),
            first.etag,
        )
    assert stale.value.reason == "ETAG_MISMATCH"
    assert store.get_agent("default", "a1") == second  # nothing written
    with pytest.raises(Aborted):
        store.delete_agent("default", "a1", etag=first.etag)
    assert store.find_agent("default", "a1") is not None
    assert store.delete_agent("default", "a1", etag=second.etag) == 0
    assert store.find_agent("default", "a1") is None


def test_an_agent_of_the_same_name_again_has_another_etag(store: Store) -> None:
    first = store.create_agent("default", "a1", AgentSettings())
    store.delete_agent("default", "a1")
    again = store.create_agent("default", "a1", AgentSettings())
    assert again.etag != first.etag
    with pytest.raises(Aborted):
        store.update_agent("default", "a1", AgentSettings(), frozenset({"docs"}), first.etag)


def test_writes_to_a_missing_agent_are_not_found(store: Store) -> None:
    with pytest.raises(NotFound) as update:
        store.update_agent("default", "a1", AgentSettings(), frozenset({"system_prompt"}))
    with pytest.raises(NotFound) as delete:
        store.delete_agent("default", "a1")
    with pytest.raises(NotFound) as append:
        store.append(key(), batch("hello"), None)
    assert {update.value.reason, delete.value.reason, append.value.reason} == {"AGENT_NOT_FOUND"}
    assert store.list_agents("default", None, BIG) == []
    assert store.get_thread(key()) is None


def test_a_delete_counts_the_agents_messages_and_takes_all_it_holds(store: Store) -> None:
    store.append(key("t1"), batch("one", "two"), AgentSettings())
    store.append(key("t2"), batch("three"), AgentSettings())
    store.append(key("t1", scope="dm:1"), batch("four"), AgentSettings())
    store.append(key("t1", agent="a2"), batch("kept"), AgentSettings())
    store.record_event(key("t1"), "test", {"n": 1})
    assert store.delete_agent("default", "a1") == 4
    assert store.find_agent("default", "a1") is None
    for k in (key("t1"), key("t2"), key("t1", scope="dm:1")):
        assert store.get_thread(k) is None and store.context_ref(k) is None
        assert history(store, k) == []
        assert store.list_events(where(k), "", None, None, 0, BIG) == []
    assert store.list_threads("default", "a1", "", None, BIG) == []
    assert store.list_status("default", "a1", "", None, BIG, None) == []
    assert store.context_counts(where(key(), all_threads=True), WindowSpec(0, 0))[2] == 0
    assert history(store, key("t1", agent="a2")) == ["kept"]


def test_nothing_lands_under_a_deleted_agent(store: Store) -> None:
    """A delete is final: an append naming no settings finds no agent; one with default
    settings starts a new agent with an empty context; a summary or an event for a thread
    of the old agent finds no thread (they must not bring the context back)."""
    [old] = store.append(key(), batch("before"), AgentSettings())
    store.delete_agent("default", "a1")
    with pytest.raises(NotFound) as plain:
        store.append(key(), batch("after"), None)
    assert plain.value.reason == "AGENT_NOT_FOUND"
    with pytest.raises(NotFound) as event:
        store.record_event(key(), "compaction", {})
    assert event.value.reason == "THREAD_NOT_FOUND"
    with pytest.raises(NotFound) as summarized:
        store.append(key(), summary("so far", old.id, old.id), AgentSettings())
    assert summarized.value.reason == "THREAD_NOT_FOUND"
    assert store.find_agent("default", "a1") is None  # the failed append made nothing

    store.append(key("t2"), batch("elsewhere"), AgentSettings())  # a new agent a1
    with pytest.raises(NotFound) as late:
        store.append(key(), summary("so far", old.id, old.id), None)
    assert late.value.reason == "THREAD_NOT_FOUND"
    with pytest.raises(NotFound):
        store.record_event(key(), "compaction", {})
    assert store.get_thread(key()) is None and history(store, key()) == []

    [fresh] = store.append(key(), batch("anew"), AgentSettings())
    assert (fresh.sequence, history(store, key())) == (1, ["anew"])
    thread = store.get_thread(key())
    assert thread is not None and (thread.message_count, thread.last_sequence) == (1, 1)
    assert store.list_events(where(key()), "", None, None, 0, BIG) == []
