"""A build's options: its strategy options from the build overrides (remembered by
them), the largest budget a build applies, the renderings whose counts bound its budget
(`governing_formats`), and the name of the strategy its result and events report.

Kept apart from the builder: these are pure functions of a request and an agent's
options, read by the plan and the build's result, and by benchmarks on their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace

from contextd import core
from contextd.app.build.memo import Memo
from contextd.domain.context import (
    StrategyOptions,
)
from contextd.domain.errors import InvalidArgument
from contextd.domain.model import (
    BuildOverrides,
)

# The largest prompt budget a build applies, whatever a request or agent asks for.
MAX_BUILD_BUDGET_TOKENS = 1_000_000


# Strategy options by the overrides they came from (few distinct ones: agents' and calls').
_OPTIONS: Memo[BuildOverrides, StrategyOptions] = Memo(1_024)

# The build options that are strategy options under the same name.
_STRATEGY_FIELDS = tuple(
    f.name for f in fields(StrategyOptions) if f.name in BuildOverrides.__slots__
)


def strategy_options(overrides: BuildOverrides) -> StrategyOptions:
    """The options of a build: the overrides over the documented defaults. Remembered by
    the (frozen) overrides: making and checking them through ``dataclasses.replace`` cost
    a warm build about 20 microseconds, and a hot thread asks with the same ones."""
    return _OPTIONS.get(overrides, _strategy_options)


def _strategy_options(overrides: BuildOverrides) -> StrategyOptions:
    chosen = {
        name: value for name in _STRATEGY_FIELDS if (value := getattr(overrides, name)) is not None
    }
    try:
        return replace(StrategyOptions(), **chosen)
    except ValueError as exc:
        raise InvalidArgument(f"invalid build options: {exc}", field="options") from exc


def governing_formats(model: str, asked: Sequence[str]) -> tuple[str, ...]:
    """The renderings whose provider counts a build's budget bounds: those asked for,
    and the model's own provider's (Anthropic for Claude models, else OpenAI), so a build
    that asks for none still fits the request its model will be sent."""
    native = "anthropic" if core.model_info(model).name.startswith("claude") else "openai"
    return tuple(dict.fromkeys([native, *asked]))


def strategy_name(options: StrategyOptions) -> str:
    used = []
    if options.truncate:
        used.append("truncate")
    if options.summarize:
        used.append("summarize")
    if options.elide_tool_results:
        used.append("elide_tool_results")
    return ",".join(used)
