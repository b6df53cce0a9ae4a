"""The handles a built context gives for text it shortened: each names something an agent
can read back through the API (a handle that cannot be read is a bug).

- A tool result kept aside (its metadata names a tool output, see
  domain/tool_outputs.py) is read whole from that output: the handle names the output's
  id, which ReadToolOutput and GrepToolOutput take, with the message's agent and scope.
- Any other stored message is `message:<id>`: ListMessages of its agent, scope and
  thread with `range: MESSAGE_RANGE_ALL` lists it (with this id) until it is deleted.
"""

from __future__ import annotations

from contextd.domain.context import HistoryItem
from contextd.domain.tool_outputs import tool_output_handle


def full_text_handle(item: HistoryItem) -> str:
    """Where the whole text of `item` (a stored message) is read back."""
    found = tool_output_handle(item.metadata) if item.metadata else None
    if found is not None:
        return f"tool output {found[0]} (ReadToolOutput, GrepToolOutput)"
    return f"message:{item.id}"
