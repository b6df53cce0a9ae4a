"""The hot cache takes a small append's rows through Python lists (hot.py,
`_list_arrays`): the arrays must be those of the Arrow path, nulls, long content
and multi-byte text included."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa

from contextd.adapters.duckdb import hot
from contextd.adapters.duckdb.base import _ARROW_SCHEMA


def _batch(rows: int) -> pa.Table:
    pick = random.Random(rows)
    cols: dict[str, list[object]] = {name: [] for name in _ARROW_SCHEMA.names}
    for i in range(rows):
        for name in _ARROW_SCHEMA.names:
            kind = _ARROW_SCHEMA.field(name).type
            value: object
            if name == "content_long":
                value = None if i % 3 else "é" * (5_000 + i)
            elif name in ("source_time_us", "group_start"):
                value = None if i % 2 else 1_000 + i
            elif pa.types.is_string(kind):
                value = "x→" * pick.randint(0, 5)
            elif pa.types.is_boolean(kind):
                value = bool(i % 2)
            else:
                value = pick.randint(0, 100)
            cols[name].append(value)
    return pa.table(cols, schema=_ARROW_SCHEMA)


def test_small_batches_give_the_arrays_of_the_arrow_path() -> None:
    for rows in (1, 2, 7, hot._SMALL_BATCH):
        batch = _batch(rows)
        small = hot._list_arrays(batch.to_pydict())
        via_arrow = hot._batch_arrays(batch)  # small: through Python lists too
        large = hot._arrow_batch_arrays(batch)
        assert small.keys() == large.keys() == via_arrow.keys()
        for name, array in small.items():
            assert array.dtype == large[name].dtype, name
            assert np.array_equal(array, large[name]), (rows, name)
            assert np.array_equal(via_arrow[name], large[name]), (rows, name)
