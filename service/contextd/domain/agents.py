"""Rules of agents that every engine applies inside its update transaction."""

from __future__ import annotations

from contextd.domain.errors import Aborted
from contextd.domain.model import Agent, AgentSettings, BuildOverrides
from contextd.domain.retention import RETENTION_FIELDS
from contextd.domain.validation import quote


def check_etag(agent: Agent, etag: str) -> None:
    if etag and etag != agent.etag:
        raise Aborted(
            f"agent {agent.name!r} changed since etag {quote(etag)} was read (now "
            f"{agent.etag}); read it again",
            reason="ETAG_MISMATCH",
            field="etag",
        )


def updated_options(
    current: BuildOverrides | None, given: BuildOverrides, fields: frozenset[str]
) -> BuildOverrides | None:
    """The build options after an update, or None when the update leaves them alone."""
    if "build_options" in fields:
        return given
    chosen = [f.split(".", 1)[1] for f in fields if f.startswith("build_options.")]
    if not chosen:
        return None
    values = (current or BuildOverrides()).as_dict()
    for option in chosen:
        value = getattr(given, option)
        if value is None:
            values.pop(option, None)
        else:
            values[option] = value
    return BuildOverrides(**values)  # type: ignore[arg-type]


def updated_json_settings(
    current: Agent, given: AgentSettings, fields: frozenset[str]
) -> AgentSettings | None:
    """The settings kept as JSON (build options, retention) after an update, each from
    `given` when the update names it and from `current` otherwise; None when the update
    changes none of them."""
    options = updated_options(current.build_options, given.build_options, fields)
    if options is None and not fields & RETENTION_FIELDS:
        return None
    return AgentSettings(
        build_options=options if options is not None else current.build_options or BuildOverrides(),
        retention=given.retention if "retention" in fields else current.retention,
        retention_overrides=(
            given.retention_overrides
            if "retention_overrides" in fields
            else current.retention_overrides
        ),
    )
