"""cluster.reports: a node master's report of success, packed and read back without pickle."""

import numpy as np
import pytest

from synkhronos.cluster import reports


def test_packed_contributions_read_back_as_they_were():
    rng = np.random.default_rng(0)
    contributions = [
        (3, [np.array(2.5, np.float32), rng.normal(size=(2, 3)), np.arange(5, dtype=np.int8)], 1.0),
        (4, [np.array(True), np.zeros((0, 2), np.float16), np.array([1 + 2j])], 7),
        (5, [], 2.0),
    ]
    buf = bytearray(reports.pack_outputs(41, contributions))
    rep = reports.unpack_outputs(buf)
    assert rep.seq == 41 and rep.failures == [] and rep.died is None
    assert len(rep.contributions) == len(contributions)
    for (rank, arrays, weight), (r2, a2, w2) in zip(contributions, rep.contributions):
        assert (rank, float(weight)) == (r2, w2)
        assert len(arrays) == len(a2)
        for a, b in zip(arrays, a2):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


@pytest.mark.parametrize("why,contributions", [
    ("object arrays", [(1, [np.array([object()])], 1.0)]),
    ("not contiguous", [(1, [np.ones((4, 4))[:, 1]], 1.0)]),
    ("a machine's combined part", [(1, ("part",), 1.0)]),
    ("too large", [(1, [np.zeros(reports.PACKED_MAX_BYTES // 8 + 1)], 1.0)]),
    ("a weight that is no number", [(1, [np.ones(2)], None)]),
])
def test_what_does_not_pack_travels_pickled(why, contributions):
    assert reports.pack_outputs(1, contributions) is None, why
