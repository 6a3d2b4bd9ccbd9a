"""Past the usual rank counts: a rank killed among 16 is named, and 64 tiny ranks start,
compute and end on this machine's few cores (or fork() refuses them, naming the limit).

Every test checks that no process and no shared-memory segment outlives the run.
"""

import os
import signal

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos import fork_plan
from synkhronos.runtime.state import get_runtime

from helpers.procs import DEADLINE_S, my_segments, wait_for

pytestmark = pytest.mark.timeout(120)

MODE = "FAST_COMPILE"


def test_a_killed_rank_is_named_at_16_ranks(forked, rng):
    forked(16)
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode=MODE)
    synk.distribute()
    data = rng.standard_normal((101, 2))
    d = synk.data(data)
    np.testing.assert_allclose(f(d), data.sum(axis=0), rtol=1e-12)
    procs = list(get_runtime().processes.procs.values())
    victim = get_runtime().processes.procs[11]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(DEADLINE_S)
    with pytest.raises(synk.WorkerDiedError, match="rank 11 ") as info:
        f(d)
    assert info.value.rank == 11
    assert get_runtime() is None
    assert wait_for(lambda: all(not p.is_alive() for p in procs))
    assert my_segments() == []


def test_64_tiny_ranks_start_compute_and_end(forked, rng):
    limit = fork_plan.process_limit()
    if limit is not None and limit[0] < 64:
        with pytest.raises(ValueError, match="n_parallel=64 is more ranks than this machine can start"):
            forked(64)
        return
    assert forked(64) == 64
    x = pt.dmatrix("x")
    s = pytensor.shared(np.zeros(2), name="s")
    f = synk.function([x], [(x.sum(axis=0), "sum"), (x.max(), "max"), (x[:, :1] * 2, "gather")],
                      updates=[(s, x.sum(axis=0))], mode=MODE)
    synk.distribute()
    procs = list(get_runtime().processes.procs.values())
    assert len(procs) == 63 and all(p.is_alive() for p in procs)
    data = rng.standard_normal((200, 2))      # 3 or 4 rows a rank
    got = f(synk.data(data))
    np.testing.assert_allclose(got[0], data.sum(axis=0), rtol=1e-12)
    assert got[1] == data.max()
    np.testing.assert_allclose(got[2], data[:, :1] * 2, rtol=1e-12)
    synk.all_reduce(s, "sum")
    for r, v in enumerate(synk.gather(s)):
        np.testing.assert_allclose(v, data.sum(axis=0), rtol=1e-12, err_msg=f"rank {r}")
    synk.close()
    assert wait_for(lambda: all(not p.is_alive() for p in procs))
    assert my_segments() == []
