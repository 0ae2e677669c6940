"""The request table's string columns: one shared str per distinct value, the same values as pyarrow's to_pylist."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from moeplace.data import DATA_DIR
from moeplace.trace.reader import read_requests, shared_strings


def test_shared_strings_equal_to_pylist_with_nulls_and_chunks():
    col = pa.chunked_array([["code", "chat", None, "code"], [], ["math", "code"]])
    got = shared_strings(col)
    assert got.dtype == object and got.tolist() == col.to_pylist()
    assert got[0] is got[3] is got[5]  # one object per distinct value
    assert shared_strings(pa.chunked_array([], pa.string())).tolist() == []


def test_bundled_request_tables_read_the_same_values():
    for name in ("reference-default.trace", "reference-fg.trace"):
        r = read_requests(DATA_DIR / name)
        assert len(r) > 0
        for col in (r.domain, r.source):
            assert all(isinstance(x, str) for x in col.tolist())
            assert len({id(x) for x in col.tolist()}) == len(set(col.tolist()))  # shared objects
        assert np.unique(r.domain).size >= 2
