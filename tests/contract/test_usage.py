"""A tenant's stored bytes (domain/quota.py): the UTF-8 bytes of content, tool_calls and
metadata of its threads' messages, kept by per-thread counters; other tenants' never
count, a deleted agent's stop counting at once, and a restart reads the same sum."""

from __future__ import annotations

from contextd.domain.batches import prepare_batch
from contextd.domain.clock import ManualClock
from contextd.domain.model import AgentSettings, NewMessage, Role
from contextd.ports.store import Store

from .conftest import StoreOpener
from .support import batch, key


def test_stored_bytes_count_utf8_per_tenant_and_survive_a_restart(
    store_opener: StoreOpener, clock: ManualClock
) -> None:
    store = store_opener(clock)
    assert store.tenant_stored_bytes("acme") == 0
    store.append(key(tenant="acme"), batch("abc", "héllo"), AgentSettings())  # 3 + 6
    rich = NewMessage(
        role=Role.TOOL_USE,
        content="→",  # 3 bytes
        tool_calls='[{"id":"c1","name":"f","input":{}}]',  # 35
        metadata='{"k":"ü"}',  # 10
    )
    store.append(
        key("t2", scope="dm:u1", tenant="acme"),
        prepare_batch([rich], "", [("c1",)]),
        AgentSettings(),
    )
    store.append(key(agent="b", tenant="acme"), batch("x" * 100), AgentSettings())
    store.append(key(tenant="acm"), batch("y" * 1000), AgentSettings())
    expected = 3 + 6 + 3 + 35 + 10 + 100
    assert store.tenant_stored_bytes("acme") == expected
    assert store.tenant_stored_bytes("acm") == 1000
    assert store.tenant_stored_bytes("ACME") == 0
    store.close()
    again: Store = store_opener(clock)
    assert again.tenant_stored_bytes("acme") == expected
    assert again.delete_agent("acme", "a1") == 3
    assert again.tenant_stored_bytes("acme") == 100
    assert again.tenant_stored_bytes("acm") == 1000
