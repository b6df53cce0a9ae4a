"""The shape of a benchmark's outcome, shared by every benchmark and by the report.

A benchmark returns a :class:`Section`: a table of medians, the targets it checks and
plain-language findings. Keeping results as data (and saving them as JSON) separates
measuring from writing, so the report can be regenerated without re-measuring.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Target:
    """One goal of the issue, with what was measured and whether it was met."""

    name: str
    goal: str
    measured: str
    met: bool | None  # None: not measured in this run (e.g. a quick run)
    why: str = ""  # what the measurements say about a miss (shown with missed targets)


@dataclass
class Bar:
    """One bar of the chart: contextd's speed-up over a baseline (> 1 is faster)."""

    label: str
    ratio: float
    target: float | None = None


@dataclass
class Section:
    key: str
    title: str
    method: str
    headers: list[str]
    rows: list[list[str]]
    targets: list[Target] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Section:
        return cls(
            key=data["key"],
            title=data["title"],
            method=data["method"],
            headers=list(data["headers"]),
            rows=[list(r) for r in data["rows"]],
            targets=[Target(**t) for t in data["targets"]],
            findings=list(data["findings"]),
            bars=[Bar(**b) for b in data["bars"]],
            raw=dict(data["raw"]),
        )
