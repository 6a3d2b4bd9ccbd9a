"""Failures: an exception in a rank, a worker killed or stopped, a rank past the timeout, the
master killed or gone without close(), a full /dev/shm, and what a hostile but fair user tries
(dropped Data, calls from two threads, guessable segment names, small misuses)."""

import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import posix_ipc
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
from helpers.procs import (DEADLINE_S, SleepIn, busy_loops, close_process, gone, kill_master_and_check,
                           my_segments, wait_for)
from synkhronos.runtime import shmem
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(120)


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
        rank = get_runtime().place.rank
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


def _sum_function():
    x = pt.dmatrix("x")
    return synk.function([x], (x.sum(axis=0), "sum"))


# ---- an exception inside a rank ----------------------------------------------------------

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
    assert all(p.is_alive() for p in get_runtime().processes.procs.values())


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


# ---- a worker killed ---------------------------------------------------------------------

def _assert_closed_and_clean(procs, wait=False):
    """The runtime is closed, its workers joined (``wait``: within seconds), its segments gone."""
    assert get_runtime() is None
    if wait:
        assert wait_for(lambda: all(not p.is_alive() for p in procs))
    assert all(not p.is_alive() for p in procs)
    assert my_segments() == []


def test_worker_killed_mid_call(forked, rng):
    forked(3)
    f = _build(SleepIn())
    synk.distribute()
    d = synk.data(rng.standard_normal((6, 2)))
    rt = get_runtime()
    procs = list(rt.processes.procs.values())
    victim = rt.processes.procs[2].pid
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
    procs = list(rt.processes.procs.values())
    os.kill(rt.processes.procs[1].pid, signal.SIGKILL)
    rt.processes.procs[1].join(DEADLINE_S)
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
    procs = list(rt.processes.procs.values())
    os.kill(rt.processes.procs[1].pid, signal.SIGKILL)
    rt.processes.procs[1].join(DEADLINE_S)
    with pytest.raises(synk.WorkerDiedError) as info:
        synk.data(np.zeros((10, 3)))
    assert info.value.rank == 1
    _assert_closed_and_clean(procs)


def test_close_after_a_worker_died(forked):
    forked(3)
    rt = get_runtime()
    procs = list(rt.processes.procs.values())
    synk.data(np.zeros((4, 2)))
    os.kill(rt.processes.procs[2].pid, signal.SIGKILL)
    rt.processes.procs[2].join(DEADLINE_S)
    synk.close()                                  # no exception: it cleans up what is left
    _assert_closed_and_clean(procs)


# ---- a worker stopped, or past the timeout -----------------------------------------------

@pytest.mark.parametrize("what", ["call", "all_reduce"])
def test_a_stopped_worker_is_named_within_seconds(forked, what):
    forked(3)
    f = _sum_function()
    v = pytensor.shared(np.ones(4), name="v")
    g = synk.function([], v.sum())
    synk.distribute()
    d = synk.data(np.ones((6, 2)))
    rt = get_runtime()
    procs = list(rt.processes.procs.values())
    os.kill(rt.processes.procs[2].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerStalledError) as info:
        f(d) if what == "call" else synk.all_reduce(v, "sum")
    assert time.monotonic() - t0 < DEADLINE_S
    assert info.value.rank == 2 and "stopped" in str(info.value)
    assert what in str(info.value)
    assert isinstance(info.value, synk.WorkerDiedError)    # handled as a dead rank
    _assert_closed_and_clean(procs, wait=True)
    del g


def test_a_rank_past_the_timeout_is_named_with_what_it_did(forked):
    forked(2, timeout=1.0)
    x = pt.dmatrix("x")
    ranks = pt.lvector("ranks")
    f = synk.function([x], bcast_inputs=[ranks], outputs=(SleepIn(60)(x, ranks).sum(), "sum"),
                      mode="FAST_COMPILE", name="slow_step")
    synk.distribute()
    d = synk.data(np.ones((4, 2)))
    procs = list(get_runtime().processes.procs.values())
    assert f(d, synk.data(np.array([-1]))) == 8.0
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerStalledError) as info:
        f(d, synk.data(np.array([1])))
    assert time.monotonic() - t0 < DEADLINE_S
    msg = str(info.value)
    assert info.value.rank == 1 and "rank 1 ran call of slow_step for" in msg
    assert "timeout of 1 s" in msg
    _assert_closed_and_clean(procs, wait=True)


def test_the_timeout_comes_from_the_environment_and_is_checked(forked, monkeypatch):
    monkeypatch.setenv("SYNK_TIMEOUT_S", "123")
    forked(1)
    assert get_runtime().processes.monitor.timeout_s == 123.0
    synk.close()
    for bad in (0, -1, float("nan"), "10", True):
        with pytest.raises(ValueError, match="timeout"):
            synk.fork(1, use_gpu=False, timeout=bad)
        assert get_runtime() is None


# ---- the master killed, or exiting without close() ---------------------------------------

MASTER_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import pytensor.tensor as pt
    import synkhronos as synk
    from synkhronos.runtime.state import get_runtime

    synk.fork(3, use_gpu=False)
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    d = synk.data(np.ones((10, 2)))
    assert f(d) == 20.0
    rt = get_runtime()
    print(rt.processes.janitor.pid, *[p.pid for p in rt.processes.procs.values()], flush=True)
    print(" ".join(n for n in os.listdir("/dev/shm") if n.startswith(f"synk_{os.getpid()}_")),
          flush=True)
    how = sys.argv[1]
    if how == "janitor":   # the janitor killed: noticed at the next segment, started again
        import logging, signal
        logging.basicConfig()
        os.kill(rt.processes.janitor.pid, signal.SIGKILL)
        rt.processes.janitor.proc.wait(30)
        d2 = synk.data(np.ones((5, 2)))
        assert f(d2) == 10.0
        print(rt.processes.janitor.pid, flush=True)
        time.sleep(120)
    elif how == "sleep":
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
    except BaseException:
        proc.kill()
        raise
    kill_master_and_check(proc, pids)


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
        close_process(proc)


def test_a_killed_janitor_is_started_again_and_still_cleans_up():
    proc = _start_master("janitor")
    try:
        pids, segments = _read_pids_and_segments(proc)
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        janitor = int(line)
        assert janitor != pids[0] and gone(pids[0]) and not gone(janitor)
        # The master killed: the new janitor stops the workers and unlinks every segment,
        # those made before its start and the one made after.
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(DEADLINE_S)
        assert wait_for(lambda: all(gone(p) for p in [janitor, *pids[1:]]))
        assert wait_for(lambda: my_segments(proc.pid) == [])
        err = proc.stderr.read()
        assert err.count("started another") == 1, err
        assert f"the janitor (pid {pids[0]}), which cleans up after a crash, ended (signal 9)" in err
    finally:
        close_process(proc)


def test_a_janitor_found_ended_when_told_of_new_workers_is_started_again(caplog):
    """watch() (distribute()'s new workers) to a janitor that has ended: no BrokenPipeError;
    a new janitor is started, holding the new pid, and stops that worker when released."""
    import logging

    from synkhronos.runtime.janitor import Janitor

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    janitor = Janitor(f"/synk_test_janitor_{os.getpid()}_", [], [])
    try:
        first = janitor.pid
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: janitor.proc.poll() is not None)
        with caplog.at_level(logging.WARNING, logger="synkhronos"):
            janitor.watch([worker.pid])
        assert janitor.pid != first and janitor.proc.poll() is None
        assert any("started another" in r.getMessage() for r in caplog.records), caplog.records
        janitor.release(DEADLINE_S)
        assert wait_for(lambda: worker.poll() is not None)   # stopped by the new janitor
        assert worker.returncode == -signal.SIGKILL
    finally:
        worker.kill()
        worker.wait()
        if janitor.proc.poll() is None:
            janitor.release(DEADLINE_S)


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
        close_process(proc)


ZMQ_MASTER = textwrap.dedent("""
    import os, time
    os.environ["SYNK_BACKEND"] = "zmq"
    import numpy as np
    import synkhronos as synk
    from synkhronos.runtime.state import get_runtime
    synk.fork(2, use_gpu=False)
    print(get_runtime().backend.dir, flush=True)
    time.sleep(120)
""")


def test_zmq_socket_dirs_go_when_the_master_is_killed():
    proc = subprocess.Popen([sys.executable, "-c", ZMQ_MASTER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        path = proc.stdout.readline().strip()
        assert path.startswith(tempfile.gettempdir()), proc.stderr.read()
        assert os.path.isdir(path)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(DEADLINE_S)
        assert wait_for(lambda: not os.path.exists(path)), path
        assert wait_for(lambda: my_segments(proc.pid) == [])
    finally:
        close_process(proc)


# ---- shared memory: full, dropped, squatted ----------------------------------------------

# A full /dev/shm, in a private 64 MB tmpfs (the size of Docker's default).
FULL_SHM_SCRIPT = textwrap.dedent("""
    import os
    import numpy as np
    import pytensor, pytensor.tensor as pt
    import synkhronos as synk

    synk.fork(2, use_gpu=False)
    x = pt.fmatrix("x")
    v = pytensor.shared(np.zeros(3, "float32"), name="v")
    f = synk.function([x], (x.sum(), "sum"))
    g = synk.function([], v.sum())
    synk.distribute()
    small = synk.data(np.ones((4, 3), "float32"))

    def expect(label, call):
        try:
            call()
        except synk.SharedMemoryError as exc:
            msg = str(exc)
            assert "MiB" in msg and "free of" in msg and "--shm-size" in msg, msg
            print(label, "raised", type(exc).__name__, flush=True)
        else:
            raise AssertionError(label + ": no error")
        assert f(small) == 12.0, "not usable afterwards"
        synk.broadcast(v, np.ones(3, "float32"))

    mb200 = 50 << 20   # float32 elements in 200 MB
    expect("data", lambda: synk.data(np.ones(mb200, "float32")))
    expect("data4tb", lambda: synk.data(dtype="float32", ndim=1, shape=(1 << 40,)))
    expect("broadcast", lambda: synk.broadcast(v, np.ones(mb200, "float32")))
    expect("input", lambda: f(np.ones((mb200 // 4, 4), "float32")))
    synk.close()
    print("left:", sorted(n for n in os.listdir("/dev/shm") if n.startswith("synk_")))
""")


def test_a_full_dev_shm_raises_and_the_library_goes_on(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare on this machine: cannot make a private 64 MB /dev/shm")
    script = tmp_path / "full_shm.py"
    script.write_text(FULL_SHM_SCRIPT)
    cmd = ["unshare", "-m", "sh", "-c",
           f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {script}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    if out.returncode != 0 and "raised" not in out.stdout and (
            "mount" in out.stderr or "unshare" in out.stderr):
        pytest.skip(f"cannot mount a private /dev/shm here: {out.stderr.strip()[-200:]}")
    assert out.returncode == 0, out.stdout + out.stderr        # no SIGBUS (exit 135)
    for label in ("data", "data4tb", "broadcast", "input"):
        assert f"{label} raised" in out.stdout, out.stdout + out.stderr
    assert "left: []" in out.stdout


def test_more_than_dev_shm_holds_fails_at_once(forked):
    forked(2)
    t0 = time.monotonic()
    with pytest.raises(synk.SharedMemoryError, match="4096.0 GiB"):
        synk.data(dtype="float32", ndim=1, shape=(1 << 40,))     # 4 TB: sparse before
    assert time.monotonic() - t0 < DEADLINE_S
    f = _sum_function()
    synk.distribute()
    assert f(synk.data(np.ones((3, 2))))[0] == 3.0


def _fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_dropped_data_is_freed_on_every_rank(forked):
    forked(3)
    f = _sum_function()
    synk.distribute()
    pids = [os.getpid()] + [p.pid for p in get_runtime().processes.procs.values()]
    f(synk.data(np.ones((5, 2))))
    gc.collect()
    f(synk.data(np.ones((5, 2))))      # the next command frees the dropped one in the workers
    before = ([_fd_count(p) for p in pids], len(my_segments()))
    for step in range(300):
        out = f(synk.data(np.full((7, 2), float(step))))
        np.testing.assert_array_equal(out, [7.0 * step] * 2)
    gc.collect()
    f(synk.data(np.ones((5, 2))))
    after = ([_fd_count(p) for p in pids], len(my_segments()))
    # No growth (counts may drop: garbage of earlier tests, inherited by fork, goes too).
    assert all(a <= b for a, b in zip(after[0], before[0])), (before, after)
    assert after[1] == before[1], (before, after)
    assert len(get_runtime().registry.datas) <= 3


def test_guessable_names_do_not_matter(forked):
    pid = os.getpid()
    # What a local user could pre-create under the old, predictable names.
    squatted = [posix_ipc.SharedMemory(f"/synk_{pid}_0_{k}{tag}", posix_ipc.O_CREX, size=64)
                for k, tag in enumerate(("ctrl", "err", "msg"))]
    try:
        forked(2)
        f = _sum_function()
        synk.distribute()
        assert f(synk.data(np.ones((2, 2))))[0] == 2.0
        synk.close()
    finally:
        for s in squatted:
            s.close_fd()
            s.unlink()


def test_a_taken_segment_name_is_a_synk_error_naming_it(forked, monkeypatch):
    prefix = shmem.run_prefix(os.getpid())
    monkeypatch.setattr(shmem, "run_prefix", lambda pid: prefix)
    taken = posix_ipc.SharedMemory(f"{prefix}0_0ctrl", posix_ipc.O_CREX, size=64)
    try:
        with pytest.raises(synk.SharedMemoryError, match=f"{prefix}0_0ctrl"):
            synk.fork(2, use_gpu=False)
        assert get_runtime() is None
        left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix[1:])]
        assert set(left) <= {f"{prefix[1:]}0_0ctrl"}     # nothing of the failed run's
    finally:
        taken.close_fd()
        try:
            taken.unlink()
        except posix_ipc.ExistentialError:
            pass
    monkeypatch.undo()
    forked(2)                                             # and fork works afterwards


# ---- misuse and concurrency --------------------------------------------------------------

def test_two_threads_hammering_are_serialised(forked, rng):
    forked(2)
    x = pt.dmatrix("x")
    v = pytensor.shared(np.zeros(3), name="v")
    f = synk.function([x], (x.sum(axis=0), "sum"))
    g = synk.function([], v.sum())
    synk.distribute()
    errors = []

    def calls(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(60):
                a = r.standard_normal((int(r.integers(1, 9)), 3))
                np.testing.assert_allclose(f(synk.data(a)), a.sum(axis=0), rtol=1e-12)
                np.testing.assert_allclose(f(a), a.sum(axis=0), rtol=1e-12)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def collectives():
        try:
            for k in range(60):
                synk.broadcast(v, np.full(3, float(k)))
                synk.all_reduce(v, "sum")
                np.testing.assert_array_equal(synk.get_value(1, v), np.full(3, 2.0 * k))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=calls, args=(s,)) for s in (1, 2)]
    threads.append(threading.Thread(target=collectives))
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "threads deadlocked"
    assert not errors, errors
    del g


def test_small_misuses_get_specific_errors(forked):
    forked(2)
    x = pt.dmatrix("x")
    with pytest.raises(TypeError, match="numeric"):
        synk.data(["a", "bb"])
    with pytest.raises(TypeError, match="pair of 2 entries; got a 3-tuple"):
        synk.function([x], (x.sum(), "sum", "avg"))
    with pytest.raises(TypeError, match="3-tuple"):
        synk.function([x], [x.sum(), (x.sum(), "sum", "avg")])


def test_close_frees_everything_when_a_step_of_it_fails(forked, monkeypatch, caplog):
    # A backend that cannot close (its peer killed mid-call): the segments still go now,
    # not when the janitor sees this process end.
    forked(3)
    rt = get_runtime()
    procs = list(rt.processes.procs.values())
    synk.data(np.zeros((4, 2)))

    def broken():
        raise OSError("the backend's peer is gone")
    monkeypatch.setattr(rt.backend, "close", broken)
    synk.close()
    _assert_closed_and_clean(procs)
    assert any("could not close the backend" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(120)
def test_close_after_a_worker_died_under_load(forked):
    # Beside busy loops on every core the killed worker's end and close() interleave
    # differently; the segments are gone when close() returns, every time.
    with busy_loops():
        for i in range(3):
            forked(3)
            rt = get_runtime()
            procs = list(rt.processes.procs.values())
            synk.data(np.zeros((4, 2)))
            os.kill(rt.processes.procs[1 + i % 2].pid, signal.SIGKILL)
            synk.close()
            _assert_closed_and_clean(procs)
