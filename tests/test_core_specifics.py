"""Specifics extraction: examples and properties."""

from __future__ import annotations

import base64
import json
import random

from hypothesis import given
from hypothesis import strategies as st

from contextd import core

ELEVEN = (
    "Commit 3f9a2c1 fixed ORD-4471-XK for ACCT-99812 (€986.31) in v0.18.2, see #2291 and "
    "https://ci.example.com/runs/77; `pytest -x -q` gave 409 passed in 12 ms, then "
    "panic: runtime error: index out of range [5] with length 3"
)


def test_one_line_with_eleven_specifics_yields_all_eleven() -> None:
    assert core.extract_specifics(ELEVEN) == [
        "3f9a2c1",
        "ORD-4471-XK",
        "ACCT-99812",
        "€986.31",
        "v0.18.2",
        "#2291",
        "https://ci.example.com/runs/77",
        "pytest -x -q",
        "409 passed",
        "12 ms",
        "panic: runtime error: index out of range [5] with length 3",
    ]


def test_extracts_each_kind_in_order() -> None:
    text = (
        "Edit src/main.rs then run `cargo test --release` (docs: https://docs.rs/regex/.).\n"
        "It took 350 ms and 1.5 GB. HttpServer calls parse_args.\n"
        "ValueError: token budget exceeded\n"
    )
    assert core.extract_specifics_batch([text]) == [
        [
            ("path", "src/main.rs"),
            ("command", "cargo test --release"),
            ("url", "https://docs.rs/regex/"),
            ("number", "350 ms"),
            ("number", "1.5 GB"),
            ("identifier", "HttpServer"),
            ("identifier", "parse_args"),
            ("error", "ValueError: token budget exceeded"),
        ]
    ]


def test_error_lines_not_code_lines() -> None:
    text = (
        "Traceback (most recent call last):\n"
        '  File "/srv/app/orders.py", line 88, in refund\n'
        "KeyError: 'ACCT-77120'\n"
        "goroutine 1 [running]:\n"
        "    raise ValueError(f'Error: {x}')\n"
        '    log.Error("error: lease lost")\n'
        "error: could not compile `lease` (lib) due to 2 previous errors\n"
    )
    errors = [t for kind, t in core.extract_specifics_batch([text])[0] if kind == "error"]
    assert errors == [
        "KeyError: 'ACCT-77120'",
        "ValueError",
        "error: could not compile `lease` (lib) due to 2 previous errors",
    ]


def test_tool_call_arguments_are_decoded_and_ids_skipped() -> None:
    args = {"command": "curl -s https://api.example.com/v2/orders?id=9", "cwd": "/srv/app"}
    openai = json.dumps(
        [
            {
                "id": "call_9Zk2LmQ81xR",
                "type": "function",
                "function": {"name": "shell", "arguments": json.dumps(args)},
            }
        ]
    )
    found = core.extract_specifics(openai)
    assert found == ["curl -s https://api.example.com/v2/orders?id=9", "/srv/app"]
    assert not any("\\" in s or "call_" in s for s in found)
    result = json.dumps({"stdout": "see https://example.com/x\nok", "id": "toolu_01Ab9"})
    assert core.extract_specifics(result) == ["https://example.com/x"]


def test_shell_prompts_cjk_and_blobs() -> None:
    blob = base64.b64encode(random.Random(7).randbytes(600)).decode()
    text = (
        "$ git rebase -i HEAD~3\n"
        f"附件: data:image/png;base64,{blob}\n"
        f"raw {blob}\n"
        "订单ORD-2024-0117的金额为986.31元, 注文は¥12,800です。见 docs/返品.md 和 docs/refunds.md\n"
        "tool ids toolu_01XyZabc123 and call_abc123def are plumbing"
    )
    found = core.extract_specifics(text)
    assert found == [
        "git rebase -i HEAD~3",
        "ORD-2024-0117",
        "986.31元",
        "¥12,800",
        "docs/refunds.md",
    ]
    assert all(len(s) <= 240 for s in found)


def test_prose_has_no_specifics() -> None:
    assert core.extract_specifics("Let's talk about lunch and/or dinner tomorrow.") == []


def test_entries_are_capped() -> None:
    line = "error: " + "very long message " * 40
    (found,) = core.extract_specifics(line)
    assert len(found) == 240 and found.endswith("…") and line.startswith(found[:-1])
    assert core.extract_specifics("/x/" + "a" * 300 + ".txt") == []


PIECES = [*"abcXYZ_/.~`: 019\n-", "ms", "Error", "failed", "http://", "GB", "\\", "€", "#"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)


@given(text=st.one_of(TEXT, st.text(max_size=80)))
def test_results_are_unique_substrings(text: str) -> None:
    found = core.extract_specifics(text)
    assert len(found) == len(set(found))
    assert all(s and (s in text or (s.endswith("…") and s[:-1] in text)) for s in found)
    assert core.extract_specifics(text) == found
    assert [t for _, t in core.extract_specifics_batch([text])[0]] == found
