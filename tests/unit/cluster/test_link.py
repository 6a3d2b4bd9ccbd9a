"""cluster.link: what needs no MPI (the compact form of a reduction's partial)."""

import numpy as np

from synkhronos.cluster import link

def test_compact_partials_round_trip_exactly():
    arrays = [np.float32(1.5) * np.ones(3, np.float32), np.arange(6.).reshape(2, 3),
              np.array(7, dtype=np.int64), np.zeros((0, 4), np.float16)]
    packed = link._pack_partial((arrays, 2.5))
    got, mass = link._unpack_partial(packed)
    assert mass == 2.5
    for a, b in zip(arrays, got):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    # Anything else is pickled instead.
    assert link._pack_partial(([np.ones(1 << 15)], 1.0)) is None   # large
    assert link._pack_partial((None, 1.0)) is None
    assert link._pack_partial(([np.array([object()])], 1.0)) is None
