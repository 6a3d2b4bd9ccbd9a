"""Faults a hostile but fair user finds: a full /dev/shm, stopped and hung ranks, dropped
Data, calls from two threads, guessable segment names, and a few smaller ones."""

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

import synkhronos as synk
from procs import DEADLINE_S, SleepIn, my_segments, wait_for
from synkhronos import shmem
from synkhronos.runtime import get_runtime

pytestmark = pytest.mark.timeout(120)


def _sum_function():
    x = pt.dmatrix("x")
    return synk.function([x], (x.sum(axis=0), "sum"))


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


def _assert_closed_and_clean(procs):
    assert get_runtime() is None
    assert wait_for(lambda: all(not p.is_alive() for p in procs))
    assert my_segments() == []


@pytest.mark.parametrize("what", ["call", "all_reduce"])
def test_a_stopped_worker_is_named_within_seconds(forked, what):
    forked(3)
    f = _sum_function()
    v = pytensor.shared(np.ones(4), name="v")
    g = synk.function([], v.sum())
    synk.distribute()
    d = synk.data(np.ones((6, 2)))
    rt = get_runtime()
    procs = list(rt.procs.values())
    os.kill(rt.procs[2].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerStalledError) as info:
        f(d) if what == "call" else synk.all_reduce(v, "sum")
    assert time.monotonic() - t0 < DEADLINE_S
    assert info.value.rank == 2 and "stopped" in str(info.value)
    assert what in str(info.value)
    assert isinstance(info.value, synk.WorkerDiedError)    # handled as a dead rank
    _assert_closed_and_clean(procs)
    del g


def test_a_rank_past_the_timeout_is_named_with_what_it_did(forked):
    forked(2, timeout=1.0)
    x = pt.dmatrix("x")
    ranks = pt.lvector("ranks")
    f = synk.function([x], bcast_inputs=[ranks], outputs=(SleepIn(60)(x, ranks).sum(), "sum"),
                      mode="FAST_COMPILE", name="slow_step")
    synk.distribute()
    d = synk.data(np.ones((4, 2)))
    procs = list(get_runtime().procs.values())
    assert f(d, synk.data(np.array([-1]))) == 8.0
    t0 = time.monotonic()
    with pytest.raises(synk.WorkerStalledError) as info:
        f(d, synk.data(np.array([1])))
    assert time.monotonic() - t0 < DEADLINE_S
    msg = str(info.value)
    assert info.value.rank == 1 and "rank 1 ran call of slow_step for" in msg
    assert "timeout of 1 s" in msg
    _assert_closed_and_clean(procs)


def test_the_timeout_comes_from_the_environment_and_is_checked(forked, monkeypatch):
    monkeypatch.setenv("SYNK_TIMEOUT_S", "123")
    forked(1)
    assert get_runtime().monitor.timeout_s == 123.0
    synk.close()
    for bad in (0, -1, float("nan"), "10", True):
        with pytest.raises(ValueError, match="timeout"):
            synk.fork(1, use_gpu=False, timeout=bad)
        assert get_runtime() is None


def _fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_dropped_data_is_freed_on_every_rank(forked):
    forked(3)
    f = _sum_function()
    synk.distribute()
    pids = [os.getpid()] + [p.pid for p in get_runtime().procs.values()]
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
    assert len(get_runtime().datas) <= 3


def test_num_slices_past_the_rows_costs_no_more_than_rows(forked, rng):
    forked(2)
    x = pt.dmatrix("x")
    f = synk.function([x], [(x.sum(axis=0), "sum"), (x.max(axis=0), "max")])
    synk.distribute()
    data = rng.standard_normal((10, 3))
    d = synk.data(data)
    want = [data.sum(axis=0), data.max(axis=0)]
    for num_slices in (10, 10 ** 7, 10 ** 10):
        got = f(d, num_slices=num_slices)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
        np.testing.assert_array_equal(got[1], want[1])


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


def test_an_empty_selection_reduces_like_pytensor(forked):
    forked(2)
    x = pt.dmatrix("x")
    f = synk.function([x], [(x.sum(axis=0), "sum"), (x.sum(), "avg")])
    synk.distribute()
    serial = pytensor.function([x], [x.sum(axis=0), x.sum()])
    d = synk.data(np.ones((5, 3)))
    empty = np.ones((0, 3))
    for got in (f(d, batch=[]), f(d, batch=slice(2, 2)), f(empty)):
        want = serial(empty)
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1] == want[1] == 0.0


def test_small_misuses_get_specific_errors(forked):
    forked(2)
    x = pt.dmatrix("x")
    with pytest.raises(TypeError, match="numeric"):
        synk.data(["a", "bb"])
    with pytest.raises(TypeError, match="pair of 2 entries; got a 3-tuple"):
        synk.function([x], (x.sum(), "sum", "avg"))
    with pytest.raises(TypeError, match="3-tuple"):
        synk.function([x], [x.sum(), (x.sum(), "sum", "avg")])


ZMQ_MASTER = textwrap.dedent("""
    import os, time
    os.environ["SYNK_BACKEND"] = "zmq"
    import numpy as np
    import synkhronos as synk
    from synkhronos.runtime import get_runtime
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
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
