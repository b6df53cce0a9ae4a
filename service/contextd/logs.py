"""Structured logs: one JSON object a line (or plain text), with the `extra` fields kept.

Both formats carry an event's fields: the start line's bound port, for one, is the only
way to learn which port `--addr host:0` picked, whichever format the operator chose.
"""

from __future__ import annotations

import json
import logging
import sys
import time

# Attributes every record has, plus the two that Formatter.format adds to it.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    """The `extra` fields a call attached to its record, in the order it gave them."""
    return {key: value for key, value in record.__dict__.items() if key not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message key=value ...``, for people reading a terminal.

    Values holding spaces, quotes or ``=`` (a path with a space, a reason) are written as
    JSON strings, so each line still splits unambiguously into its fields.
    """

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        for key, value in _fields(record).items():
            text = str(value)
            if not text or any(c.isspace() or c in '"=' for c in text):
                text = json.dumps(text)
            line += f" {key}={text}"
        return line


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
