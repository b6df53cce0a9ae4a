"""Strict scopes over gRPC: the isolation table of docs/operations.md, row by row, and a
property test over random look-alike scopes.

Each scope of a row gets its own messages (two threads), a status entry, a compaction
event and a snapshot, every one marked with the scope's label. Then every read of one
scope (BuildContext, ListMessages, GetContextStats, ListThreads, ListEvents, ListStatus,
ListSnapshots, GetSnapshot, RestoreSnapshot) must hold that scope's marks only, and the
other scope's snapshot must be NOT_FOUND from it. One server per engine serves every row.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Client
from contextd.v1 import context_service_pb2 as pb


def channel(guild: str, chan: str, user: str) -> pb.Scope:
    return pb.Scope(channel=pb.ChannelScope(guild_id=guild, channel_id=chan, user_id=user))


def dm(user: str) -> pb.Scope:
    return pb.Scope(direct_message=pb.DirectMessageScope(user_id=user))


def key(name: str) -> pb.Scope:
    return pb.Scope(key=name)


# The design note's table, plus the rows it implies: (what is compared, scope, scope).
TABLE: list[tuple[str, pb.Scope, pb.Scope]] = [
    ("user A vs user B, same channel", channel("g1", "c1", "A"), channel("g1", "c1", "B")),
    ("user A in channel 1 vs channel 2", channel("g1", "c1", "A"), channel("g1", "c2", "A")),
    ("DM with user A vs channel with user A", dm("A"), channel("g1", "c1", "A")),
    ("user A in guild 1 vs guild 2", channel("g1", "c1", "A"), channel("g2", "c1", "A")),
    ("DM with user A vs DM with user B", dm("A"), dm("B")),
    ("DM with user A vs the key 'A'", dm("A"), key("A")),
    ("channel vs a key spelled like it", channel("g1", "c1", "A"), key("g1/c1/A")),
    ("DM vs a key spelled like it in another case", dm("A"), key("DM:A")),
    ("the default scope vs a DM", pb.Scope(), dm("A")),
    ("the default scope vs a key", pb.Scope(), key("default")),
    ("user ids differing by case", channel("g1", "c1", "a"), channel("g1", "c1", "A")),
    ("ids moved across a separator", channel("g1", "c1.A", "B"), channel("g1", "c1", "A.B")),
]

AGENT = "bot"
THREADS = ("main", "side")


def label(scope: pb.Scope) -> str:
    """A mark unique to the scope, found by regex in anything a read returns."""
    kind = scope.WhichOneof("kind") or "default"
    return f"<<{kind}|{scope.SerializeToString(deterministic=True).hex()}>>"


MARK = re.compile(r"<<[a-z_]+\|[0-9a-f]*>>")


def marks(text: str) -> set[str]:
    return set(MARK.findall(text))


@dataclass
class Filled:
    """What one scope was given: its mark, message ids and snapshot id."""

    scope: pb.Scope
    mark: str
    ids: set[int] = field(default_factory=set)
    snapshot: str = ""


def fill(client: Client, scope: pb.Scope) -> Filled:
    stub, filled = client.stub, Filled(scope, label(scope))
    for thread in THREADS:
        response = stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent=AGENT,
                scope=scope,
                thread=thread,
                messages=[
                    pb.Message(
                        role=pb.ROLE_USER, content=f"{filled.mark} {thread} {i} " + "x" * 300
                    )
                    for i in range(14)
                ],
                create_agent_if_missing=True,
            )
        )
        filled.ids |= {r.id for r in response.receipts}
    stub.SetStatus(
        pb.SetStatusRequest(
            agent=AGENT,
            scope=scope,
            entry=pb.StatusEntry(
                key="job", kind=pb.STATUS_KIND_PROCESS, state="running", summary=filled.mark
            ),
        )
    )
    compacted = stub.CompactContext(
        pb.CompactContextRequest(
            agent=AGENT, scope=scope, thread="side", options=pb.BuildOptions(keep_recent_tokens=1)
        )
    )
    filled.ids.add(compacted.summary.id)
    filled.snapshot = stub.SaveSnapshot(
        pb.SaveSnapshotRequest(agent=AGENT, scope=scope, description=filled.mark)
    ).snapshot.id
    return filled


def not_found(call: object) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()


def check_reads(client: Client, mine: Filled, other: Filled, row: str) -> None:
    """Every read of `mine`'s scope holds its marks and ids only, never `other`'s."""
    stub, scope, why = client.stub, mine.scope, f"{row}: reading {mine.mark}"
    seen: list[str] = []
    for thread in THREADS:
        built = stub.BuildContext(
            pb.BuildContextRequest(
                agent=AGENT, scope=scope, thread=thread, formats=[pb.CONTEXT_FORMAT_TEXT]
            )
        )
        assert {m.id for m in built.messages} <= mine.ids, why
        assert built.messages, why
        seen.append(str(built))
    for thread, rng in itertools.product(
        ("", *THREADS), (pb.MESSAGE_RANGE_WINDOW, pb.MESSAGE_RANGE_ALL)
    ):
        listed = client.list_messages(AGENT, scope=scope, thread=thread, range=rng)
        assert {m.id for m in listed} <= mine.ids and listed, why
        assert all(m.scope == scope for m in listed), why
        seen.append("".join(str(m) for m in listed))
    every = client.list_messages(AGENT, scope=scope, range=pb.MESSAGE_RANGE_ALL)
    assert {m.id for m in every} == mine.ids, why
    stats = stub.GetContextStats(pb.GetContextStatsRequest(agent=AGENT, scope=scope)).stats
    assert (stats.total_message_count, stats.thread_count) == (len(mine.ids), 2), why
    threads = stub.ListThreads(pb.ListThreadsRequest(agent=AGENT, scope=scope)).threads
    assert [t.thread for t in threads] == sorted(THREADS), why
    assert all(t.scope == scope for t in threads), why
    events = stub.ListEvents(pb.ListEventsRequest(agent=AGENT, scope=scope)).events
    assert len(events) == 1 and events[0].scope == scope, why
    seen.append(str(events))
    status = stub.ListStatus(pb.ListStatusRequest(agent=AGENT, scope=scope, include_expired=True))
    assert [e.summary for e in status.entries] == [mine.mark], why
    snapshots = stub.ListSnapshots(pb.ListSnapshotsRequest(agent=AGENT, scope=scope)).snapshots
    assert [s.id for s in snapshots] == [mine.snapshot], why
    full = stub.GetSnapshot(
        pb.GetSnapshotRequest(
            agent=AGENT, scope=scope, id=mine.snapshot, view=pb.SNAPSHOT_VIEW_FULL
        )
    )
    seen.append(str(full))
    assert marks("".join(seen)) == {mine.mark}, why
    # The other scope's snapshot does not exist from here.
    for view in (pb.SNAPSHOT_VIEW_BASIC, pb.SNAPSHOT_VIEW_FULL):
        not_found(
            lambda view=view: stub.GetSnapshot(
                pb.GetSnapshotRequest(agent=AGENT, scope=scope, id=other.snapshot, view=view)
            )
        )
    not_found(
        lambda: stub.RestoreSnapshot(
            pb.RestoreSnapshotRequest(agent=AGENT, scope=scope, id=other.snapshot)
        )
    )
    not_found(
        lambda: stub.DeleteSnapshot(
            pb.DeleteSnapshotRequest(agent=AGENT, scope=scope, id=other.snapshot)
        )
    )


def test_the_isolation_table_row_by_row(client: Client) -> None:
    filled: dict[bytes, Filled] = {}
    for _, *scopes in TABLE:
        for scope in scopes:
            wire = scope.SerializeToString(deterministic=True)
            if wire not in filled:
                filled[wire] = fill(client, scope)
    every_id = [i for f in filled.values() for i in f.ids]
    assert len(every_id) == len(set(every_id))
    for row, first, second in TABLE:
        a = filled[first.SerializeToString(deterministic=True)]
        b = filled[second.SerializeToString(deterministic=True)]
        assert a.mark != b.mark, row
        check_reads(client, a, b, row)
        check_reads(client, b, a, row)


def test_a_clear_or_restore_in_one_scope_leaves_the_other_untouched(client: Client) -> None:
    for row, first, second in TABLE[:4]:
        agent = f"clear-{TABLE.index((row, first, second))}"
        for scope in (first, second):
            client.stub.AppendMessages(
                pb.AppendMessagesRequest(
                    agent=agent,
                    scope=scope,
                    messages=[pb.Message(role=pb.ROLE_USER, content=label(scope))],
                    create_agent_if_missing=True,
                )
            )
        saved = client.stub.SaveSnapshot(pb.SaveSnapshotRequest(agent=agent, scope=first))
        client.stub.ClearContext(pb.ClearContextRequest(agent=agent, scope=first))
        assert client.list_messages(agent, scope=first) == [], row
        window = client.list_messages(agent, scope=second)
        assert [m.content for m in window] == [label(second)], row
        client.stub.RestoreSnapshot(
            pb.RestoreSnapshotRequest(agent=agent, scope=first, id=saved.snapshot.id)
        )
        assert [m.content for m in client.list_messages(agent, scope=first)] == [label(first)]
        assert [m.content for m in client.list_messages(agent, scope=second)] == [label(second)]


# ----------------------------------------------------------------- property test

# Ids that look alike: a case, a separator, a prefix, a suffix apart.
LOOK_ALIKE_IDS = ["u1", "U1", "u-1", "u.1", "u_1", "u1.", "1", "u", "u12", "@u1", "u1@g"]
# Keys that look like the typed scopes' canonical forms without being them.
LOOK_ALIKE_KEYS = [
    "u1",
    "U1",
    "Dm:u1",
    "DM:u1",
    "dm_u1",
    "dm.u1",
    "Guild:g/channel:c/user:u1",
    "guild",
    "guild.g/channel.c/user.u1",
    "g/c/u1",
    "u1/",
]
ids = st.sampled_from(LOOK_ALIKE_IDS)
scopes = st.one_of(
    st.builds(channel, ids, ids, ids),
    st.builds(dm, ids),
    st.builds(key, st.sampled_from(LOOK_ALIKE_KEYS)),
    st.just(pb.Scope()),
)
_examples = itertools.count()


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(chosen=st.lists(scopes, min_size=2, max_size=5))
def test_no_read_crosses_look_alike_scopes(client: Client, chosen: list[pb.Scope]) -> None:
    agent = f"prop-{next(_examples)}"  # one server for every example; an agent each
    for i, scope in enumerate(chosen):
        client.stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent=agent,
                scope=scope,
                thread=f"t{i % 2}",
                messages=[pb.Message(role=pb.ROLE_USER, content=f"{label(scope)}#{i}")],
                create_agent_if_missing=True,
            )
        )
        client.stub.SetStatus(
            pb.SetStatusRequest(
                agent=agent,
                scope=scope,
                entry=pb.StatusEntry(
                    key=f"k{i}", kind=pb.STATUS_KIND_THREAD, state="on", summary=label(scope)
                ),
            )
        )
    for scope in chosen:
        expected = {f"{label(scope)}#{i}" for i, s in enumerate(chosen) if s == scope}
        listed = client.list_messages(agent, scope=scope, range=pb.MESSAGE_RANGE_ALL)
        assert {m.content for m in listed} == expected
        stats = client.stub.GetContextStats(pb.GetContextStatsRequest(agent=agent, scope=scope))
        assert stats.stats.total_message_count == len(expected)
        threads = client.stub.ListThreads(pb.ListThreadsRequest(agent=agent, scope=scope)).threads
        assert {t.thread for t in threads} == {
            f"t{i % 2}" for i, s in enumerate(chosen) if s == scope
        }
        status = client.stub.ListStatus(pb.ListStatusRequest(agent=agent, scope=scope)).entries
        assert {e.summary for e in status} == {label(scope)}
        for thread in {t.thread for t in threads}:
            built = client.stub.BuildContext(
                pb.BuildContextRequest(
                    agent=agent, scope=scope, thread=thread, formats=[pb.CONTEXT_FORMAT_TEXT]
                )
            )
            assert marks(str(built)) == {label(scope)}


# Look-alikes outside the allowed alphabet never become a scope of their own.
UNICODE_LOOK_ALIKES = ["u\u0131", "\u0430", "\uff55\uff11", "u1\u200b", "u\u00a01", "U\u0301"]


def test_unicode_look_alike_ids_are_invalid_argument(client: Client) -> None:
    makers: list[Callable[[str], pb.Scope]] = [lambda t: channel("g", "c", t), dm, key]
    for text, make in itertools.product(UNICODE_LOOK_ALIKES, makers):
        scope = make(text)
        append = pb.AppendMessagesRequest(
            agent="a",
            scope=scope,
            messages=[pb.Message(role=pb.ROLE_USER, content="x")],
            create_agent_if_missing=True,
        )
        for call, request in (
            (client.stub.AppendMessages, append),
            (client.stub.ListMessages, pb.ListMessagesRequest(agent="a", scope=scope)),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (text, scope)
            assert "scope" in (info.value.details() or "")
