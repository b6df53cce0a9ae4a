"""SearchMessages: relevance order, currency, windows, threads, CJK, bad input, bounds and
isolation. Every test runs on both engines (the `server` fixture) unless marked
`duckdb_only` (those look at the embedded engine's index cache itself)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Client, InProcessServer, scope_pb, ts
from contextd.adapters.postgres.search import SEARCH_SETTINGS, search_step
from contextd.domain.clock import ManualClock
from contextd.domain.search import SearchQuery
from contextd.v1 import context_service_pb2 as pb
from contextd.v1 import context_service_pb2_grpc as pb_grpc
from contextd.v1 import key_service_pb2 as kpb
from contextd.v1 import key_service_pb2_grpc as kpb_grpc

DAY_US = 86_400 * 1_000_000


def pb_duration(seconds: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds)


def search(
    client: Client,
    agent: str,
    query: str,
    *,
    scope: str = "",
    metadata: Any = None,
    stub: Any = None,
    **fields: Any,
) -> pb.SearchMessagesResponse:
    response: pb.SearchMessagesResponse = (stub or client.stub).SearchMessages(
        pb.SearchMessagesRequest(agent=agent, scope=scope_pb(scope), query=query, **fields),
        metadata=metadata,
    )
    return response


def contents(response: pb.SearchMessagesResponse) -> list[str]:
    return [h.message.content for h in response.hits]


def marked(hit: pb.SearchHit) -> str:
    """The snippet with each highlight in brackets."""
    out, at = [], 0
    for span in hit.highlights:
        out += [hit.snippet[at : span.start], "[", hit.snippet[span.start : span.end], "]"]
        at = span.end
    return "".join([*out, hit.snippet[at:]])


CORPUS = [
    "the deploy pipeline failed with a timeout error in the deploy step",
    "deploy finished",
    "lunch menu for friday",
    "timeout while waiting for the database connection pool to open",
]


def test_a_known_corpus_comes_back_in_order(client: Client) -> None:
    """Messages holding more of the query's words, and more often, rank first; messages
    holding none are not returned; each hit carries its message, thread, score and a
    snippet with the words marked."""
    client.append("a1", *CORPUS)
    client.append(
        "a1",
        "a tool ran",
        thread="t2",
        role=pb.ROLE_TOOL_USE,
        tool_calls='[{"id":"c1","name":"shell","input":{"cmd":"kubectl rollout undo"}}]',
    )
    found = search(client, "a1", "deploy timeout")
    assert contents(found) == [CORPUS[0], CORPUS[1], CORPUS[3]]
    scores = [h.score for h in found.hits]
    assert scores == sorted(scores, reverse=True) and scores[-1] > 0
    top = found.hits[0]
    assert top.message.thread == "t1" and top.message.id > 0
    assert marked(top) == (
        "the [deploy] pipeline failed with a [timeout] error in the [deploy] step"
    )
    # Tool call arguments are searched too; the snippet then shows them.
    [tool] = search(client, "a1", "rollout").hits
    assert tool.message.thread == "t2" and "[rollout]" in marked(tool)
    assert contents(search(client, "a1", "deploy timeout", k=1)) == [CORPUS[0]]
    assert len(search(client, "a1", "deploy").hits) == 2
    assert search(client, "a1", "nowhere").hits == []


def test_every_append_is_searchable_at_once(client: Client) -> None:
    client.append("a1", "warm up")
    assert search(client, "a1", "zebra").hits == []
    for n in range(1, 4):
        client.append("a1", f"zebra sighting number{n}", "unrelated words")
        found = search(client, "a1", "zebra")
        assert len(found.hits) == n
        assert search(client, "a1", f"number{n}").hits[0].message.content.endswith(f"number{n}")


def test_the_window_honours_clears_and_age_and_the_history_keeps_all(
    client: Client, clock: ManualClock
) -> None:
    client.append("a1", "alpha before the clear")
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1"))
    client.append("a1", "alpha after the clear")
    old = clock.now_us() - 2 * DAY_US
    client.append("a1", "alpha imported long ago", source_time=ts(old))
    window = search(client, "a1", "alpha")
    assert contents(window) == ["alpha after the clear"]
    assert window.window_start_time.ToMicroseconds() > 0
    history = search(client, "a1", "alpha", range=pb.MESSAGE_RANGE_ALL)
    assert sorted(contents(history)) == sorted(
        ["alpha before the clear", "alpha after the clear", "alpha imported long ago"]
    )
    assert not history.HasField("window_start_time")
    # A thread's own clear applies to that thread only.
    client.append("a1", "alpha in another thread", thread="t2")
    client.stub.ClearContext(pb.ClearContextRequest(agent="a1", thread="t1"))
    assert contents(search(client, "a1", "alpha")) == ["alpha in another thread"]
    # Once older than the rolling window, nothing is in the window; the history stays.
    clock.advance(DAY_US + 1)
    assert search(client, "a1", "alpha").hits == []
    assert len(search(client, "a1", "alpha", range=pb.MESSAGE_RANGE_ALL).hits) == 4


def test_the_window_honours_retention_caps_and_expiry(client: Client, clock: ManualClock) -> None:
    """Searching the window sees what every window read sees: at most the newest
    max_messages, and nothing of an expired context (the history keeps it until swept)."""
    policy = pb.RetentionPolicy(max_messages=2, ttl=pb_duration(3_600))
    client.stub.CreateAgent(pb.CreateAgentRequest(agent=pb.Agent(name="a1", retention=policy)))
    client.append("a1", "delta one", "delta two", "delta three")
    assert sorted(contents(search(client, "a1", "delta"))) == ["delta three", "delta two"]
    clock.advance(3_600 * 1_000_000)
    assert search(client, "a1", "delta").hits == []
    assert len(search(client, "a1", "delta", range=pb.MESSAGE_RANGE_ALL).hits) == 3


def test_a_named_thread_limits_the_search(client: Client) -> None:
    client.append("a1", "gamma ray in one", thread="t1")
    client.append("a1", "gamma ray in two", "gamma gamma", thread="t2")
    assert sorted(contents(search(client, "a1", "gamma", thread="t1"))) == ["gamma ray in one"]
    two = search(client, "a1", "gamma", thread="t2", range=pb.MESSAGE_RANGE_ALL)
    assert {h.message.thread for h in two.hits} == {"t2"} and len(two.hits) == 2
    assert search(client, "a1", "gamma", thread="nope").hits == []
    assert len(search(client, "a1", "gamma").hits) == 3


def test_chinese_japanese_and_korean_text_is_found(client: Client) -> None:
    client.append(
        "a1",
        "来週東京都に行きます",
        "大阪に行った",
        "서울특별시 날씨",
        "plain english text",
    )
    assert contents(search(client, "a1", "東京")) == ["来週東京都に行きます"]
    assert contents(search(client, "a1", "서울 날씨")) == ["서울특별시 날씨"]
    both = search(client, "a1", "に行")
    assert sorted(contents(both)) == sorted(["来週東京都に行きます", "大阪に行った"])
    # More of the query's pairs rank first.
    assert contents(search(client, "a1", "東京都に行く"))[0] == "来週東京都に行きます"
    hit = search(client, "a1", "東京").hits[0]
    assert marked(hit) == "来週[東京]都に行きます"


def test_a_deleted_agents_messages_never_come_back(client: Client) -> None:
    client.append("a1", "the secret launch code")
    assert len(search(client, "a1", "secret").hits) == 1
    client.stub.DeleteAgent(pb.DeleteAgentRequest(name="a1"))
    client.append("a1", "a fresh start")
    assert search(client, "a1", "secret", range=pb.MESSAGE_RANGE_ALL).hits == []
    assert len(search(client, "a1", "fresh").hits) == 1


def test_postgresql_ranks_the_newest_matches_only(
    server: InProcessServer, postgres_dsn: str
) -> None:
    """PostgreSQL ranks at most `search_candidates` matching messages, the newest."""
    client = server.client
    store: Any = server.running.store
    client.append("a1", "apple apple apple apple")  # the best match, and the oldest
    client.append("a1", *[f"apple and a pear number{i}" for i in range(4)])
    client.append("a1", "nothing here")
    assert contents(search(client, "a1", "apple"))[0] == "apple apple apple apple"
    store.search_candidates = 3
    found = contents(search(client, "a1", "apple"))
    assert sorted(found) == [f"apple and a pear number{i}" for i in (1, 2, 3)]
    # An older message is found by a query it is among the newest matches of.
    assert contents(search(client, "a1", "number0 nothing")) == [
        "nothing here",
        "apple and a pear number0",
    ]


def test_postgresql_widens_its_range_until_it_holds_the_newest_matches(
    server: InProcessServer, postgres_dsn: str
) -> None:
    """The candidates are the newest matches of the scope (or thread) even when the
    tenant's newest messages belong to other scopes or do not match."""
    client = server.client
    store: Any = server.running.store
    store.search_candidates = 2  # the first range: the tenant's 16 newest ids
    client.append("a1", "kiwi one", "kiwi two kiwi", "kiwi three")
    client.append("a1", "kiwi elsewhere", thread="t2")
    client.append("a1", *[f"kiwi filler {i}" for i in range(300)], scope="k1")
    client.append("a1", *[f"plain filler {i}" for i in range(300)])
    assert sorted(contents(search(client, "a1", "kiwi"))) == ["kiwi elsewhere", "kiwi three"]
    assert contents(search(client, "a1", "kiwi", thread="t1")) == ["kiwi two kiwi", "kiwi three"]
    store.search_candidates = 10
    assert contents(search(client, "a1", "kiwi", thread="t1"))[0] == "kiwi two kiwi"
    assert len(search(client, "a1", "kiwi", thread="t1").hits) == 3


def test_postgresql_finds_its_candidates_through_the_search_index_while_statistics_lag(
    server: InProcessServer, postgres_dsn: str
) -> None:
    """The newest ids, where a search starts, lie past the histogram of messages.id until
    the next ANALYZE. Shown their bound, the planner took the range for a row or two and
    read it newest first through messages_by_id, testing each row's vector (over
    1,000,000 messages: up to 270,000 vectors, 0.6-4.4 s). The candidates must come from the GIN
    index ANDed with the range, and the hits stay the newest matches, best first."""
    client = server.client
    store: Any = server.running.store
    store.search_candidates = 200  # the first range: the tenant's 5,000 newest ids
    with psycopg.connect(postgres_dsn, autocommit=True) as admin:
        admin.execute("ALTER TABLE messages SET (autovacuum_enabled = false)")
        client.append("a1", *[f"note {i} about item{i % 97}" for i in range(1_000)])
        admin.execute("ANALYZE messages")  # statistics of the first 1,000 messages only
        for at in range(1_000, 21_000, 2_000):
            client.append("a1", *[f"note {i} about item{i % 97}" for i in range(at, at + 2_000)])
    # The 200 newest matches (i = 1,654 ... 20,957) rank alike: the oldest of them first.
    found = contents(search(client, "a1", "item5", range=pb.MESSAGE_RANGE_ALL, k=10))
    assert found == [f"note {i} about item5" for i in range(1_654, 2_624, 97)]
    query = SearchQuery("default", "a1", 0, "", None, None, "item5", ("item5",), 10)
    with psycopg.connect(postgres_dsn) as conn, conn.transaction():
        newest = conn.execute("SELECT max(id) FROM messages").fetchone()
        assert newest is not None
        sql, params = search_step(query, 200, int(newest[0]) - 5_000 + 1)
        for setting in SEARCH_SETTINGS:
            conn.execute(setting)
        row = conn.execute(f"EXPLAIN (FORMAT JSON) {sql}", params).fetchone()
    assert row is not None
    scans = [
        (node["Node Type"], node.get("Index Name", ""), node.get("Filter", ""))
        for node in plan_nodes(row[0][0]["Plan"])
        if "Scan" in node["Node Type"]
    ]
    assert ("Bitmap Index Scan", "messages_search", "") in scans, scans
    assert not [s for s in scans if "search_tsv" in s[2]], scans


def plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    """A plan's node and every node under it."""
    return [node, *(n for child in node.get("Plans", []) for n in plan_nodes(child))]


def test_summaries_are_never_returned(client: Client) -> None:
    client.append("a1", *[f"turn {i} about the kettle" for i in range(12)])
    summary = client.stub.CompactContext(
        pb.CompactContextRequest(
            agent="a1", thread="t1", options=pb.BuildOptions(keep_recent_tokens=10)
        )
    ).summary
    assert summary.is_summary and "kettle" in summary.content
    hits = search(client, "a1", "kettle", range=pb.MESSAGE_RANGE_ALL, k=100).hits
    assert len(hits) == 12 and not any(h.message.is_summary for h in hits)


def _violation(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, list[str]]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error: Any = info.value
    status = rpc_status.from_call(error)
    assert status is not None
    fields: list[str] = []
    reason = ""
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        errinfo = error_details_pb2.ErrorInfo()
        if detail.Is(bad.DESCRIPTOR):
            detail.Unpack(bad)
            fields += [v.field for v in bad.field_violations]
        elif detail.Is(errinfo.DESCRIPTOR):
            detail.Unpack(errinfo)
            reason = errinfo.reason
    return error.code(), reason, fields


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"query": ""}, "query"),
        ({"query": "   "}, "query"),
        ({"query": "x" * 1025}, "query"),
        ({"query": "a b to"}, "query"),  # no searchable word
        ({"query": "fine", "k": -1}, "k"),
        ({"query": "fine", "k": 101}, "k"),
        ({"query": "fine", "range": 7}, "range"),
        ({"query": "fine", "thread": "bad thread"}, "thread"),
        ({"query": "fine", "agent": ""}, "agent"),
        ({"query": "fine", "scope": pb.Scope(key="guild:x")}, "scope.key"),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(
    client: Client, fields: dict[str, Any], field: str
) -> None:
    client.append("a1", "fine words")
    request = pb.SearchMessagesRequest(agent="a1")
    for name, value in fields.items():
        if isinstance(value, pb.Scope):
            request.scope.CopyFrom(value)
        else:
            setattr(request, name, value)
    code, reason, violations = _violation(lambda: client.stub.SearchMessages(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert reason == "INVALID_ARGUMENT"
    assert violations == [field]


def test_limits_at_their_edges_and_an_unknown_agent(client: Client) -> None:
    client.append("a1", *[f"common word{i}" for i in range(120)])
    assert len(search(client, "a1", "common", k=100).hits) == 100
    assert len(search(client, "a1", "common").hits) == 10  # the default k
    assert search(client, "a1", "common " + "y" * 1017).hits  # 1,024 characters
    code, reason, _ = _violation(lambda: search(client, "ghost", "common"))
    assert (code, reason) == (grpc.StatusCode.NOT_FOUND, "AGENT_NOT_FOUND")


@pytest.mark.duckdb_only
def test_a_scope_over_the_index_limit_is_refused(server: InProcessServer) -> None:
    client = server.client
    store: Any = server.running.store
    store.search_max_messages = 5
    client.append("a1", *[f"word number{i}" for i in range(5)])
    assert len(search(client, "a1", "word").hits) == 5
    client.append("a1", "word six")
    code, reason, _ = _violation(lambda: search(client, "a1", "word"))
    assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "SEARCH_INDEX_TOO_LARGE")
    # Another scope (smaller) is searched as before.
    client.append("a1", "word elsewhere", scope="k1")
    assert len(search(client, "a1", "word", scope="k1").hits) == 1


@pytest.mark.duckdb_only
def test_the_index_cache_stays_under_its_memory_bound(server: InProcessServer) -> None:
    client = server.client
    store: Any = server.running.store
    for s in ("k1", "k2", "k3"):
        client.append("a1", *[f"{s} text {i} shared" for i in range(200)], scope=s)
        search(client, "a1", "shared", scope=s)
    one = store.search_index_bytes() / 3
    store.search_max_bytes = int(one * 1.5)
    for s in ("k1", "k2", "k3"):  # each search evicts the others; results stay right
        found = search(client, "a1", f"{s} shared", scope=s, k=100)
        assert len(found.hits) == 100
        assert all(h.message.content.startswith(s) for h in found.hits)
        assert store.search_index_bytes() <= store.search_max_bytes


# ---------------------------------------------------------------------- isolation

# Look-alike names: case, a suffix, a prefix, a key that reads like a typed scope.
AGENTS = ["a1", "A1", "a1x", "a1.b"]
SCOPES = [
    "",
    "dm:u1",
    "dm:u10",
    "guild:g1/channel:c1/user:u1",
    "guild:g1/channel:c1/user:u10",
    "u1",
    "k:dm.u1",
]
TENANTS = ["default", "acme", "acme2"]
_examples = itertools.count()


@pytest.fixture
def callers(server: InProcessServer) -> dict[str, tuple[pb_grpc.ContextServiceStub, Any]]:
    """A stub and the metadata of a write key, for each tenant."""
    channel = server.client.channel
    keys = kpb_grpc.KeyServiceStub(channel)  # type: ignore[no-untyped-call]
    root = keys.CreateKey(kpb.CreateKeyRequest(role=kpb.KEY_ROLE_ADMIN)).secret
    root_md = [("authorization", f"Bearer {root}")]
    out: dict[str, tuple[pb_grpc.ContextServiceStub, Any]] = {}
    stub = pb_grpc.ContextServiceStub(channel)  # type: ignore[no-untyped-call]
    for tenant in TENANTS:
        secret = keys.CreateKey(
            kpb.CreateKeyRequest(
                tenant="" if tenant == "default" else tenant, role=kpb.KEY_ROLE_WRITE
            ),
            metadata=root_md,
        ).secret
        out[tenant] = (stub, [("authorization", f"Bearer {secret}")])
    return out


contexts = st.tuples(st.sampled_from(TENANTS), st.sampled_from(AGENTS), st.sampled_from(SCOPES))


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(writes=st.lists(contexts, min_size=1, max_size=8))
def test_search_never_returns_another_tenants_agents_or_scopes_messages(
    client: Client,
    callers: dict[str, tuple[pb_grpc.ContextServiceStub, Any]],
    writes: list[tuple[str, str, str]],
) -> None:
    """Whatever is written where, a search of one (tenant, agent, scope) returns exactly
    the messages written there: never one of a look-alike agent, scope or tenant."""
    word = f"needle{next(_examples)}"
    written: dict[tuple[str, str, str], list[str]] = {}
    for n, (tenant, agent, scope) in enumerate(writes):
        stub, md = callers[tenant]
        text = f"{word} {tenant} {agent} {scope} #{n}"
        stub.AppendMessages(
            pb.AppendMessagesRequest(
                agent=agent,
                scope=scope_pb(scope),
                thread=f"t{n % 2}",
                messages=[pb.Message(role=pb.ROLE_USER, content=text)],
                create_agent_if_missing=True,
            ),
            metadata=md,
        )
        written.setdefault((tenant, agent, scope), []).append(text)
    for tenant, agent, scope in itertools.product(TENANTS, AGENTS, SCOPES):
        stub, md = callers[tenant]
        try:
            found = search(client, agent, word, scope=scope, metadata=md, stub=stub, k=100)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND  # the agent was never made
            assert not written.get((tenant, agent, scope))
            continue
        assert sorted(contents(found)) == sorted(written.get((tenant, agent, scope), []))


# ---------------------------------------------------------------------- client and CLI


def test_the_client_package_searches(server: InProcessServer, client: Client) -> None:
    from contextd_client import Client as TypedClient
    from contextd_client import InvalidArgument, MessageRange

    client.append("a1", *CORPUS)
    with TypedClient(client.address) as typed:
        found = typed.search_messages(agent="a1", query="deploy timeout", range=MessageRange.ALL)
        assert [h.message.content for h in found.hits] == [CORPUS[0], CORPUS[1], CORPUS[3]]
        assert found.window_start_time is None
        assert found.hits[1].marked() == "[deploy] finished"
        assert found.hits[0].message.thread == "t1" and found.hits[0].score > 0
        with pytest.raises(InvalidArgument) as bad:
            typed.search_messages(agent="a1", query="deploy", k=101)
        assert [v.field for v in bad.value.field_violations] == ["k"]


def test_the_command_line_searches(server: InProcessServer, client: Client) -> None:
    client.append("demo", *CORPUS)
    common = ["--agent", "demo", "--server", client.address]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "contextd",
            "messages",
            "search",
            "deploy timeout",
            *common,
            "--json",
            "-k",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    hits = [json.loads(line) for line in done.stdout.splitlines()]
    assert [h["message"]["content"] for h in hits] == [CORPUS[0], CORPUS[1]]
    table = subprocess.run(
        [sys.executable, "-m", "contextd", "messages", "search", "lunch", *common],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "«lunch» menu for friday" in table
