"""What the use cases need from storage, as `typing.Protocol` interfaces; an engine is an
adapter (`contextd.adapters.<engine>`) that satisfies them and passes tests/contract/."""
