"""A local stand-in for the Anthropic Messages API, for tests of the real SDK client.

`FakeAnthropic` is an http.server on 127.0.0.1:0 in a thread. Each POST /v1/messages is
recorded (headers and JSON body) and answered by the reply set with one of `reply_*`:
a canned Messages API response, an error status with the API's error body, raw bytes,
or a delay longer than the client's timeout; `queue` replies are used first, in order.
`reply_lossy()` answers like a lossy model: a checkpoint with every section, in prose
that paraphrases the latest request and drops nearly every specific (paths, numbers,
ids, commands), so a test can see that the ledger, not the model, keeps the evidence.
Tests never reach the network.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    delay_s: float = 0.0
    content_type: str = "application/json"


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: Any
    peer: tuple[str, int]  # the client's address: equal for requests on one connection


def message_json(text: str, model: str = "claude-haiku-4-5") -> dict[str, Any]:
    """A minimal but complete Messages API response with one text block."""
    return {
        "id": "msg_fake_1",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 34},
    }


SECTIONS = ("Goal", "Constraints", "Progress", "Decisions", "Next steps", "Critical context")


def full_checkpoint(text: str) -> str:
    """``text`` with every checkpoint section it lacks added (as "None."), so a canned
    answer passes the summarizer's quality gate."""
    missing = [name for name in SECTIONS if not re.search(rf"^## {name}$", text, re.MULTILINE)]
    return "\n\n".join([text, *(f"## {name}\nNone." for name in missing)])


def lossy_checkpoint(prompt: str) -> str:
    """What a lossy model writes for a summary prompt: the six sections in prose, the
    latest request paraphrased without a single word holding a digit, slash, dot or
    other symbol, and nothing else of the conversation."""
    conversation = prompt.rsplit("<conversation>", 1)[-1]
    requests = [line[6:] for line in conversation.splitlines() if line.startswith("User: ")]
    latest = requests[-1] if requests else "carry on"
    words = [w for w in latest.split() if re.fullmatch(r"[A-Za-z]+[,.]?", w)][:12]
    gist = " ".join(words).rstrip(",.") or "carry on with the task"
    body = {
        "Goal": f"The user is working on this: {gist}.",
        "Constraints": "None.",
        "Progress": "The assistant looked into the problem and made several changes.",
        "Decisions": "Some approaches were compared and one was chosen.",
        "Next steps": "Continue where the conversation left off.",
        "Critical context": "Details were discussed earlier in the conversation.",
    }
    return "\n\n".join(f"## {name}\n{body[name]}" for name in SECTIONS)


@dataclass
class FakeAnthropic:
    reply: Reply = field(
        default_factory=lambda: Reply(body=json.dumps(message_json("ok")).encode())
    )
    requests: list[Recorded] = field(default_factory=list)
    queue: list[Reply] = field(default_factory=list)
    lossy: bool = False
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _released: threading.Event = field(default_factory=threading.Event)
    # hold(): requests wait at this gate until release(); `arrived` tells a test one came.
    _gate: threading.Event | None = None
    arrived: threading.Event = field(default_factory=threading.Event)

    @property
    def base_url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def reply_text(self, text: str) -> None:
        self.lossy = False
        self.reply = Reply(body=json.dumps(message_json(text)).encode())

    def reply_lossy(self) -> None:
        """Answer every request like a lossy model (see :func:`lossy_checkpoint`)."""
        self.lossy = True

    def then_text(self, *texts: str) -> None:
        """Answer the next requests with these texts, in order, before the reply set."""
        self.queue.extend(Reply(body=json.dumps(message_json(t)).encode()) for t in texts)

    def reply_json(self, payload: Any, status: int = 200) -> None:
        self.reply = Reply(status=status, body=json.dumps(payload).encode())

    def reply_error(self, status: int) -> None:
        error = {"type": ERROR_TYPES.get(status, "api_error"), "message": f"fake {status}"}
        self.reply_json({"type": "error", "error": error}, status)

    def reply_raw(self, body: bytes, status: int = 200, content_type: str = "text/plain") -> None:
        self.reply = Reply(status=status, body=body, content_type=content_type)

    def hold(self) -> None:
        """Make the next requests wait until release(), so a test can act while a summary
        is in flight (deterministically, without sleeps)."""
        self.arrived.clear()
        self._gate = threading.Event()

    def release(self) -> None:
        if self._gate is not None:
            self._gate.set()

    def reply_slow(self, delay_s: float) -> None:
        self.reply = Reply(body=json.dumps(message_json("too late")).encode(), delay_s=delay_s)

    def start(self) -> FakeAnthropic:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the real API

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                raw = self.rfile.read(length)
                try:
                    body: Any = json.loads(raw)
                except ValueError:
                    body = raw.decode(errors="replace")
                fake.requests.append(
                    Recorded(
                        self.path,
                        {k.lower(): v for k, v in self.headers.items()},
                        body,
                        self.client_address,
                    )
                )
                queued = bool(fake.queue)
                reply = fake.queue.pop(0) if queued else fake.reply
                if fake.lossy and not queued and isinstance(body, dict):
                    messages = body.get("messages") or [{}]
                    prompt = messages[-1].get("content", "")
                    text = lossy_checkpoint(prompt if isinstance(prompt, str) else "")
                    reply = Reply(body=json.dumps(message_json(text)).encode())
                gate = fake._gate
                if gate is not None:
                    fake.arrived.set()
                    gate.wait(30)
                if reply.delay_s and fake._released.wait(reply.delay_s):
                    return  # stopped while sleeping: the client has given up already
                if self.path.split("?")[0] != "/v1/messages":
                    reply = Reply(status=404, body=b'{"type":"error","error":{}}')
                try:
                    self.send_response(reply.status)
                    self.send_header("content-type", reply.content_type)
                    self.send_header("content-length", str(len(reply.body)))
                    self.send_header("request-id", "req_fake")
                    self.end_headers()
                    self.wfile.write(reply.body)
                except OSError:
                    pass  # the client timed out and closed the connection

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.block_on_close = False
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._released.set()
        self.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeAnthropic:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
