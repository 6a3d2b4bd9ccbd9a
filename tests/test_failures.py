"""Failures: an exception in one rank, a worker killed, the master killed, exit without close()."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
from procs import DEADLINE_S, SleepIn, gone, my_segments, wait_for
from synkhronos.runtime import get_runtime

pytestmark = pytest.mark.timeout(90)


class Boom(Exception):
    """The error the test ops raise."""


class NoPickle(Exception):
    """An exception that pickles but cannot be rebuilt from its args."""

    def __init__(self, a, b):
        super().__init__(f"{a} {b}")


class FailIn(Op):
    """Return x; raise in every rank listed in the second input."""

    __props__ = ("kind",)

    def __init__(self, kind="boom"):
        self.kind = kind

    def make_node(self, x, ranks):
        x, ranks = pt.as_tensor_variable(x), pt.as_tensor_variable(ranks)
        return Apply(self, [x, ranks], [x.type()])

    def perform(self, node, inputs, outputs):
        x, ranks = inputs
        rank = get_runtime().rank
        if rank in ranks:
            if self.kind == "nopickle":
                raise NoPickle("no", "pickle")
            if self.kind == "value":
                raise ValueError(f"bad value in rank {rank}")
            raise Boom(f"boom in rank {rank}")
        outputs[0][0] = x.copy()


def _build(op):
    x = pt.dmatrix("x")
    ranks = pt.lvector("ranks")
    return synk.function([x], bcast_inputs=[ranks],
                         outputs=(op(x, ranks).sum(axis=0), "sum"), mode="FAST_COMPILE")


# ---- an exception inside a rank ---------------------------------------------------

def test_exception_in_a_worker_reaches_the_master(forked, rng):
    forked(3)
    f = _build(FailIn())
    g = _build(FailIn("nopickle"))
    synk.distribute()
    x = rng.standard_normal((7, 2))
    d = synk.data(x)

    def ranks(*rs):
        return synk.data(np.array(rs or (-1,), dtype=np.int64))

    np.testing.assert_allclose(f(d, ranks()), x.sum(axis=0), rtol=1e-12)

    for k in (1, 2):
        with pytest.raises(synk.WorkerError) as info:
            f(d, ranks(k))
        err = info.value
        assert err.rank == k
        assert set(err.failures) == {k}
        assert isinstance(err.__cause__, Boom)            # the worker's own error type
        assert str(err.__cause__).splitlines()[0] == f"boom in rank {k}"  # 2.x appends the node
        assert f"rank {k}" in str(err)
        text = err.failures[k]
        assert f"rank {k} of 3" in text and "Boom" in text and "perform" in text
        # the runtime stays usable
        np.testing.assert_allclose(f(d, ranks()), x.sum(axis=0), rtol=1e-12)

    # two failing ranks: the lowest is named, the other counted
    with pytest.raises(synk.WorkerError) as info:
        f(d, ranks(2, 1))
    assert info.value.rank == 1
    assert set(info.value.failures) == {1, 2}
    assert "1 other rank" in str(info.value)
    np.testing.assert_allclose(f(d, ranks()), x.sum(axis=0), rtol=1e-12)

    # an exception that cannot be rebuilt in the master: the text still arrives
    with pytest.raises(synk.WorkerError) as info:
        g(d, ranks(2))
    assert info.value.rank == 2
    assert "NoPickle" in info.value.failures[2]
    np.testing.assert_allclose(g(d, ranks()), x.sum(axis=0), rtol=1e-12)

    # the master's own share raising: the same WorkerError as for any rank,
    # and the workers' failures are not dropped
    with pytest.raises(synk.WorkerError, match="boom in rank 0") as info:
        f(d, ranks(0))
    assert info.value.rank == 0 and isinstance(info.value.__cause__, Boom)
    assert set(info.value.failures) == {0} and "rank 0 of 3" in info.value.failures[0]
    np.testing.assert_allclose(f(d, ranks()), x.sum(axis=0), rtol=1e-12)
    with pytest.raises(synk.WorkerError, match="boom in rank 0") as info:
        f(d, ranks(0, 2))
    assert set(info.value.failures) == {0, 2} and "1 other rank" in str(info.value)
    assert "boom in rank 2" in info.value.failures[2]
    np.testing.assert_allclose(f(d, ranks()), x.sum(axis=0), rtol=1e-12)
    assert all(p.is_alive() for p in get_runtime().procs.values())


def test_the_same_bug_raises_the_same_type_in_every_rank(forked, rng):
    forked(3)
    f = _build(FailIn("value"))
    synk.distribute()
    d = synk.data(rng.standard_normal((6, 2)))
    for rank in (0, 1, 2):                      # the master is rank 0
        with pytest.raises(ValueError, match=f"bad value in rank {rank}") as info:
            f(d, synk.data(np.array([rank])))
        err = info.value
        assert isinstance(err, synk.WorkerError) and err.rank == rank
        assert type(err.__cause__) is ValueError and set(err.failures) == {rank}
    with pytest.raises(synk.WorkerError) as info:
        f(d, synk.data(np.array([0, 1, 2])))
    assert set(info.value.failures) == {0, 1, 2}
    assert all(f"bad value in rank {r}" in info.value.failures[r] for r in range(3))


def test_exception_with_master_rank_one(forked, rng):
    forked(2, master_rank=1)
    f = _build(FailIn())
    synk.distribute()
    x = rng.standard_normal((4, 2))
    d = synk.data(x)
    with pytest.raises(synk.WorkerError) as info:
        f(d, synk.data(np.array([0])))
    assert info.value.rank == 0 and isinstance(info.value.__cause__, Boom)
    with pytest.raises(synk.WorkerError) as info:   # the master, rank 1: the same error
        f(d, synk.data(np.array([1])))
    assert info.value.rank == 1 and isinstance(info.value.__cause__, Boom)
    np.testing.assert_allclose(f(d, synk.data(np.array([-1]))), x.sum(axis=0), rtol=1e-12)


# ---- a worker killed --------------------------------------------------------------

def _assert_closed_and_clean(procs):
    assert get_runtime() is None
    assert all(not p.is_alive() for p in procs)
    assert my_segments() == []


def test_worker_killed_mid_call(forked, rng):
    forked(3)
    f = _build(SleepIn())
    synk.distribute()
    d = synk.data(rng.standard_normal((6, 2)))
    rt = get_runtime()
    procs = list(rt.procs.values())
    victim = rt.procs[2].pid
    killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError) as info:
        f(d, synk.data(np.array([2])))          # rank 2 sleeps until it is killed
    killer.join()
    assert time.monotonic() - t0 < DEADLINE_S
    assert info.value.rank == 2
    assert info.value.exitcode == -signal.SIGKILL
    assert "rank 2" in str(info.value)
    _assert_closed_and_clean(procs)
    # fork() works again, and so does a new function
    assert forked(2) == 2
    x = pt.dmatrix("x")
    g = synk.function([x], (x.sum(axis=0), "sum"))
    synk.distribute()
    data = rng.standard_normal((5, 2))
    np.testing.assert_allclose(g(synk.data(data)), data.sum(axis=0), rtol=1e-12)


def test_worker_killed_while_idle(forked, rng):
    forked(2)
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"))
    synk.distribute()
    d = synk.data(rng.standard_normal((4, 2)))
    f(d)
    rt = get_runtime()
    procs = list(rt.procs.values())
    os.kill(rt.procs[1].pid, signal.SIGKILL)
    rt.procs[1].join(DEADLINE_S)
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerDiedError) as info:
        f(d)
    assert time.monotonic() - t0 < DEADLINE_S
    assert info.value.rank == 1
    _assert_closed_and_clean(procs)
    # the old function and data belong to the closed run
    with pytest.raises(synk.SynkStateError):
        f(d)
    with pytest.warns(UserWarning):
        synk.close()


def test_worker_killed_while_data_allocates(forked):
    forked(3)
    rt = get_runtime()
    procs = list(rt.procs.values())
    os.kill(rt.procs[1].pid, signal.SIGKILL)
    rt.procs[1].join(DEADLINE_S)
    with pytest.raises(synk.WorkerDiedError) as info:
        synk.data(np.zeros((10, 3)))
    assert info.value.rank == 1
    _assert_closed_and_clean(procs)


def test_close_after_a_worker_died(forked):
    forked(3)
    rt = get_runtime()
    procs = list(rt.procs.values())
    synk.data(np.zeros((4, 2)))
    os.kill(rt.procs[2].pid, signal.SIGKILL)
    rt.procs[2].join(DEADLINE_S)
    synk.close()                                  # no exception: it cleans up what is left
    _assert_closed_and_clean(procs)


# ---- the master killed, or exiting without close() ---------------------------------

MASTER_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import pytensor.tensor as pt
    import synkhronos as synk
    from synkhronos.runtime import get_runtime

    synk.fork(3, use_gpu=False)
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    d = synk.data(np.ones((10, 2)))
    assert f(d) == 20.0
    rt = get_runtime()
    print(rt.janitor, *[p.pid for p in rt.procs.values()], flush=True)
    print(" ".join(n for n in os.listdir("/dev/shm") if n.startswith(f"synk_{os.getpid()}_")),
          flush=True)
    how = sys.argv[1]
    if how == "sleep":
        time.sleep(120)
    elif how == "raise":
        raise SystemExit("leaving with an error, no close()")
    # "return": fall off the end without close()
""")


def _start_master(how):
    return subprocess.Popen([sys.executable, "-c", MASTER_SCRIPT, how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _read_pids_and_segments(proc):
    line = proc.stdout.readline()
    if not line:
        raise AssertionError("master script failed:\n" + proc.stderr.read())
    pids = [int(p) for p in line.split()]
    segments = proc.stdout.readline().split()
    assert len(pids) == 3 and segments       # the janitor and two workers; segments exist
    return pids, segments


def test_master_killed_workers_exit_and_segments_go():
    proc = _start_master("sleep")
    try:
        pids, segments = _read_pids_and_segments(proc)
        assert all(not gone(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(DEADLINE_S)
        assert wait_for(lambda: all(gone(p) for p in pids)), "workers outlived their master"
        assert wait_for(lambda: not my_segments(proc.pid)), my_segments(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("how", ["return", "raise"])
def test_exit_without_close_cleans_up(how):
    proc = _start_master(how)
    try:
        pids, segments = _read_pids_and_segments(proc)
        proc.wait(60)
        err = proc.stderr.read()
        assert proc.returncode == (0 if how == "return" else 1), err
        assert "Traceback" not in err
        assert wait_for(lambda: all(gone(p) for p in pids))
        assert my_segments(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_stale_segments_of_a_killed_run_are_swept_by_the_next_fork(forked):
    # A master killed before its janitor could run (here: both killed at once)
    # leaves segments; the next fork() on the machine removes them.
    proc = _start_master("sleep")
    try:
        pids, segments = _read_pids_and_segments(proc)
        janitor = pids[0]
        os.kill(janitor, signal.SIGKILL)
        assert wait_for(lambda: gone(janitor))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(DEADLINE_S)
        # workers die with their master (parent-death signal) even without the janitor
        assert wait_for(lambda: all(gone(p) for p in pids[1:])), "workers outlived master"
        # Nobody unlinked them, though another run's fork() on this machine may
        # sweep them first: asserting they still exist here would race with it.
        forked(1)
        assert my_segments(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
