"""Rules of agents that every engine applies inside its update transaction."""

from __future__ import annotations

from contextd.domain.errors import Aborted
from contextd.domain.model import Agent, BuildOverrides
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
