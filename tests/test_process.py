"""fork() and close(): return values, argument checks, order, pinning, restarts."""

import gc
import multiprocessing
import os

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(60)

N_CORES = len(os.sched_getaffinity(0))


class ProcessInfo(Op):
    """Return [rank, pid, number of allowed cores, most threads of any BLAS/OpenMP pool]
    of the process that runs it, as a float64 vector (ignores its input's values)."""

    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [pt.dvector()])

    def perform(self, node, inputs, outputs):
        from threadpoolctl import threadpool_info
        threads = max([p["num_threads"] for p in threadpool_info()] or [1])
        outputs[0][0] = np.array([get_runtime().place.rank, os.getpid(),
                                  len(os.sched_getaffinity(0)), threads], dtype=np.float64)


def _process_info(n):
    """Build, distribute and call a function reporting each rank's process facts."""
    x = pt.dmatrix("x")
    f = synk.function([x], outputs=(ProcessInfo()(x), None), mode="FAST_COMPILE")
    synk.distribute()
    return [tuple(int(v) for v in r) for r in f(synk.data(np.zeros((n, 1))))]


def test_fork_returns_the_number_of_ranks(forked):
    assert forked(3) == 3
    rt = get_runtime()
    assert rt.place.n_parallel == 3 and rt.place.rank == 0 and rt.is_master
    assert sorted(rt.processes.procs) == [1, 2]
    assert all(p.is_alive() for p in rt.processes.procs.values())


def test_default_n_parallel_is_the_usable_cores(forked):
    assert forked(None) == N_CORES
    assert get_runtime().place.n_parallel == N_CORES


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(n_parallel=0), ValueError, "n_parallel"),
    (dict(n_parallel=-1), ValueError, "n_parallel"),
    (dict(n_parallel=1.5), TypeError, "n_parallel"),
    (dict(n_parallel="2"), TypeError, "n_parallel"),
    (dict(n_parallel=True), TypeError, "n_parallel"),
    (dict(n_parallel=2, master_rank=-1), ValueError, "master_rank"),
    (dict(n_parallel=2, master_rank=2), ValueError, "master_rank"),
    (dict(n_parallel=2, master_rank=1.0), TypeError, "master_rank"),
    (dict(n_parallel=2, master_rank=None), TypeError, "master_rank"),
    (dict(n_parallel=2, use_gpu="no"), TypeError, "use_gpu"),
    (dict(n_parallel=2, max_n_var=0), ValueError, "max_n_var"),
    (dict(n_parallel=2, max_dim=0), ValueError, "max_dim"),
])
def test_fork_rejects_bad_arguments(kwargs, exc, name):
    kwargs.setdefault("use_gpu", False)
    with pytest.raises(exc, match=name):
        synk.fork(**kwargs)
    assert get_runtime() is None
    assert [p for p in multiprocessing.active_children() if p.name.startswith("synk-")] == []


def test_fork_twice_raises_state_error(forked):
    forked(2)
    with pytest.raises(synk.SynkStateError, match="fork"):
        synk.fork(2, use_gpu=False)
    # Code written for the original catches RuntimeError.
    with pytest.raises(RuntimeError):
        synk.fork(2, use_gpu=False)
    assert get_runtime().place.n_parallel == 2      # the first runtime is untouched


def test_close_joins_workers_and_fork_works_again(forked):
    forked(2)
    procs = list(get_runtime().processes.procs.values())
    synk.close()
    assert get_runtime() is None
    assert all(not p.is_alive() for p in procs)
    assert all(p.exitcode == 0 for p in procs)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"synk_{os.getpid()}_")]
    assert forked(3) == 3
    info = _process_info(3)
    assert [r[0] for r in info] == [0, 1, 2]


def test_close_twice_warns(forked):
    forked(1)
    synk.close()
    with pytest.warns(UserWarning, match="close"):
        synk.close()


def test_close_before_fork_warns():
    with pytest.warns(UserWarning, match="close"):
        synk.close()


def test_one_rank_runs_in_the_master_alone(forked):
    assert forked(1) == 1
    assert get_runtime().processes.procs == {}
    info = _process_info(4)
    assert info[0][:2] == (0, os.getpid())


@pytest.mark.parametrize("n", [2, 3])
def test_master_rank_one_computes_rank_ones_share(forked, n):
    forked(n, master_rank=1)
    rt = get_runtime()
    assert rt.place.rank == 1 and rt.is_master
    assert sorted(rt.processes.procs) == [r for r in range(n) if r != 1]
    info = _process_info(n)
    assert [r[0] for r in info] == list(range(n))          # rank order
    assert info[1][1] == os.getpid()                       # the master ran rank 1's rows
    for r in rt.processes.procs:
        assert info[r][1] == rt.processes.procs[r].pid


def test_master_rank_one_splits_data_like_any_rank(forked):
    forked(3, master_rank=1)
    x = pt.dmatrix("x")
    f = synk.function([x], outputs=[(x.sum(axis=0), None), (x * 2, "gather")])
    synk.distribute()
    data = np.arange(21.0).reshape(7, 3)
    per_rank, gathered = f(synk.data(data))
    for got, share in zip(per_rank, np.array_split(data, 3)):
        np.testing.assert_array_equal(got, share.sum(axis=0))
    np.testing.assert_array_equal(gathered, data * 2)


@pytest.mark.skipif(N_CORES < 2, reason="pinning needs two cores")
def test_workers_are_pinned_and_single_threaded(forked):
    n = N_CORES
    forked(n)
    rt = get_runtime()
    info = _process_info(n)
    cores = [os.sched_getaffinity(p.pid) for p in rt.processes.procs.values()]
    cores.append(os.sched_getaffinity(0))
    assert all(len(c) == 1 for c in cores)
    assert len(set.union(*cores)) == n                    # one core each
    for rank, pid, n_allowed, threads in info:
        assert n_allowed == 1
        assert threads == 1
    synk.close()
    # close() gives the master its cores back.
    assert len(os.sched_getaffinity(0)) == N_CORES


def test_more_ranks_than_cores_are_not_pinned(forked):
    n = N_CORES + 1
    forked(n)
    info = _process_info(n)
    assert [r[0] for r in info] == list(range(n))
    for rank, pid, n_allowed, threads in info:
        assert n_allowed == N_CORES
        assert threads == 1


def test_use_gpu_true_without_gpus_raises():
    from synkhronos.runtime import devices
    if devices.count_gpus():
        pytest.skip("this machine has GPUs")
    with pytest.raises(RuntimeError, match="use_gpu"):
        synk.fork(2, use_gpu=True)
    assert get_runtime() is None


def test_fork_with_use_gpu_none_runs_in_cpu_mode(forked):
    from synkhronos.runtime import devices
    if devices.count_gpus():
        pytest.skip("this machine has GPUs")
    assert synk.fork(2) == 2
    assert get_runtime().config.device == "cpu"


def test_profile_workers_writes_one_profile_per_worker(forked, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    forked(3, profile_workers=True)
    _process_info(3)
    synk.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["synk_worker_1.prof",
                                                         "synk_worker_2.prof"]
    import pstats
    pstats.Stats(str(tmp_path / "synk_worker_1.prof"))      # a readable cProfile dump


def test_thread_limits_are_restored_after_close(forked):
    before = os.environ.get("OMP_NUM_THREADS")
    forked(2)
    assert os.environ["OMP_NUM_THREADS"] == "1"
    synk.close()
    assert os.environ.get("OMP_NUM_THREADS") == before


def test_profile_breaks_each_ranks_time_down_and_adds_up(forked, tmp_path):
    import json
    import time

    from helpers.procs import SleepIn

    forked(2)
    x = pt.dmatrix("x")
    who = pt.lvector("who")
    w = pytensor.shared(np.ones((300, 300)), name="w")
    # Rank 1 sleeps 30 ms in every call: the master waits for it at the end barrier.
    slow_x = SleepIn(0.03)(x, who)
    f = synk.function([x], (pt.tanh(slow_x.dot(w)).dot(w).sum(), "sum"), name="heavy",
                      bcast_inputs=[who])
    v = pytensor.shared(np.ones(1000), name="v")
    g = synk.function([], v.sum())
    synk.distribute()
    d = synk.data(np.ones((400, 300)))
    ranks = np.array([1])
    f(d, ranks)                                        # compiled and warm
    walls = []
    with synk.profile() as prof:
        for _ in range(10):
            t0 = time.perf_counter()
            f(d, ranks, batch=np.arange(400)[::-1])
            walls.append(time.perf_counter() - t0)
        synk.all_reduce(v, "sum")
    totals = prof.totals()
    assert set(totals) == {0, 1}
    master = totals[0]["call of heavy"]
    assert master["calls"] == 10
    parts = sum(master[c] for c in ("control", "gather", "compute", "collective", "wait",
                                    "reduce"))
    assert parts == pytest.approx(master["wall"], rel=1e-6)
    # Against the wall time the caller measured around each call: within 10%.
    assert master["wall"] == pytest.approx(sum(walls), rel=0.10)
    worker = totals[1]["call of heavy"]
    assert worker["calls"] == 10 and worker["compute"] > 0.5 * worker["wall"]
    assert worker["gather"] > 0 and master["reduce"] > 0
    # The master's share takes a few ms; rank 1's sleep alone is 10 x 30 ms.
    assert master["wait"] > 0.15
    assert totals[1]["all_reduce"]["calls"] == 1
    table = prof.table()
    assert "call of heavy" in table and "compute" in table
    path = tmp_path / "trace.json"
    prof.write_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["tid"] for e in events} == {0, 1}
    assert any(e["name"] == "compute" and e["tid"] == 1 for e in events)
    # Profiling is off again: nothing is recorded.
    f(d, ranks)
    assert get_runtime().profiler is None
    del g


def test_a_bad_setting_leaves_nothing_and_fork_works_after(forked, monkeypatch):
    monkeypatch.setenv("SYNK_SPIN_S", "abc")
    with pytest.raises(ValueError, match="SYNK_SPIN_S"):
        synk.fork(2, use_gpu=False)
    assert get_runtime() is None
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"synk_{os.getpid()}_")]
    assert [p for p in multiprocessing.active_children() if p.name.startswith("synk-")] == []
    monkeypatch.delenv("SYNK_SPIN_S")
    assert forked(2) == 2
    assert [r[0] for r in _process_info(2)] == [0, 1]


class _FailIn(Op):
    """Return x; raise ValueError in rank 1."""

    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        if get_runtime().place.rank == 1:
            raise ValueError("planted")
        outputs[0][0] = inputs[0]


def test_profile_goes_on_recording_after_a_failed_call(forked):
    forked(2)
    x = pt.dmatrix("x")
    f = synk.function([x], x.sum())
    bad = synk.function([x], _FailIn()(x).sum())
    synk.distribute()
    d = synk.data(np.ones((4, 2)))
    with synk.profile() as prof:
        f(d)
        with pytest.raises(ValueError, match="planted"):
            bad(d)
        f(d)
        f(d)
    totals = prof.totals()
    assert totals[0]["call of function"]["calls"] == 4      # as many as rank 1 ran
    assert totals[1]["call of function"]["calls"] == 4


def test_what_the_workers_start_from_stays_frozen_until_close(forked, rng):
    # Frozen objects are out of the cyclic GC's reach: no collection, in a worker or in
    # the master, writes their headers, so the pages the workers share stay shared.
    assert gc.get_freeze_count() == 0
    forked(2)
    at_fork = gc.get_freeze_count()
    assert at_fork > 0
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(), "sum"))
    synk.distribute()                       # the workers start again: frozen with the function
    assert gc.get_freeze_count() > at_fork
    assert f(synk.data(np.ones((5, 2)))) == 10.0
    gc.collect()
    assert f(synk.data(np.ones((3, 2)))) == 6.0
    synk.close()
    assert gc.get_freeze_count() == 0


def test_a_programs_own_frozen_objects_are_left_alone(forked):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        forked(2)
        x = pt.dmatrix("x")
        f = synk.function([x], (x.sum(), "sum"))
        synk.distribute()
        assert f(np.ones((4, 2))) == 8.0
        assert 0 < gc.get_freeze_count() <= frozen  # nothing frozen since (some died)
        synk.close()
        assert 0 < gc.get_freeze_count() <= frozen  # and nothing unfrozen
    finally:
        gc.unfreeze()
