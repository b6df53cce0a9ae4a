"""contextd-client: a typed Python client of contextd (the contextd.v1 gRPC API).

    from contextd_client import Client, NewMessage

    with Client("127.0.0.1:50051") as client:
        client.append_messages(agent="demo", messages=[NewMessage("user", "hi")],
                               create_agent_if_missing=True)
        for message in client.list_messages(agent="demo"):
            print(message.sequence, message.role.value, message.content)

Results are frozen dataclasses (`contextd_client.types`), failures `ContextdError`
subclasses (`contextd_client.errors`); the raw generated modules are `contextd_client.v1`.
"""

from contextd_client._client import Client, RetryPolicy
from contextd_client.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    ContextdError,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from contextd_client.types import (
    Agent,
    AgentDoc,
    BuildOptions,
    BuildStats,
    BuiltContext,
    ChannelScope,
    Compaction,
    ContextFormat,
    ContextMessage,
    ContextStats,
    ContextView,
    DirectMessageScope,
    Event,
    KeyScope,
    Message,
    MessageRange,
    MessageReceipt,
    NewMessage,
    Page,
    Paged,
    Rendering,
    Role,
    Scope,
    StatusEntry,
    StatusKind,
    Thread,
)

__all__ = [
    "Aborted",
    "Agent",
    "AgentDoc",
    "AlreadyExists",
    "BuildOptions",
    "BuildStats",
    "BuiltContext",
    "Cancelled",
    "ChannelScope",
    "Client",
    "Compaction",
    "ContextFormat",
    "ContextMessage",
    "ContextStats",
    "ContextView",
    "ContextdError",
    "DataLoss",
    "DeadlineExceeded",
    "DirectMessageScope",
    "Event",
    "FailedPrecondition",
    "FieldViolation",
    "Internal",
    "InvalidArgument",
    "KeyScope",
    "Message",
    "MessageRange",
    "MessageReceipt",
    "NewMessage",
    "NotFound",
    "Page",
    "Paged",
    "PermissionDenied",
    "Rendering",
    "ResourceExhausted",
    "RetryPolicy",
    "Role",
    "Scope",
    "StatusEntry",
    "StatusKind",
    "Thread",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
]
