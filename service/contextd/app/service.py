"""The use cases behind the gRPC API: plain Python over the store's ports.

This layer owns the rules (validation, defaults, windows, paging); the store owns the SQL;
the servicer only translates. Every method takes the tenant explicitly, as the API edge
decides it (`contextd.api.tenant`). One mixin per group of calls, each in its own module.
"""

from __future__ import annotations

from contextd.app.agents import AgentCalls
from contextd.app.base import MessagePage
from contextd.app.building import BuildCalls
from contextd.app.events import EventCalls
from contextd.app.keys import KeyCalls
from contextd.app.messages import MessageCalls
from contextd.app.retention import RetentionCalls
from contextd.app.search import SearchCalls
from contextd.app.snapshots import SnapshotCalls
from contextd.app.status import StatusCalls
from contextd.app.threads import ThreadCalls
from contextd.app.tool_outputs import ToolOutputCalls
from contextd.domain.limits import Limits, check_overrides

__all__ = ["ContextService", "Limits", "MessagePage", "check_overrides"]


class ContextService(
    AgentCalls,
    MessageCalls,
    ThreadCalls,
    StatusCalls,
    EventCalls,
    BuildCalls,
    SnapshotCalls,
    KeyCalls,
    RetentionCalls,
    ToolOutputCalls,
    SearchCalls,
):
    """Every call of the API (see the mixins for each group)."""
