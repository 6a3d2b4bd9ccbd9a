"""SharedArray: create, attach, view, unlink; the sweeps that clean up after runs."""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from synkhronos.runtime import shmem
from synkhronos.errors import SharedMemoryError
from synkhronos.runtime.shmem import SharedArray

_count = itertools.count()


def _name(pid=None):
    pid = os.getpid() if pid is None else pid
    return f"/synk_{pid}_t_{next(_count)}"


def _exists(name):
    return os.path.exists(os.path.join("/dev/shm", name.lstrip("/")))


@pytest.fixture
def seg():
    s = SharedArray(_name(), 4096)
    yield s
    s.unlink()
    s.close()


def test_create_makes_a_named_segment_of_the_size_asked(seg):
    assert _exists(seg.name)
    assert os.stat("/dev/shm" + seg.name).st_size == 4096
    assert seg.nbytes == 4096
    assert seg.owner


def test_view_is_a_writable_numpy_view(seg):
    v = seg.view(np.float64, (8, 4))
    assert v.shape == (8, 4) and v.dtype == np.float64
    v[:] = np.arange(32.0).reshape(8, 4)
    np.testing.assert_array_equal(seg.view(np.float64)[:32], np.arange(32.0))
    # Default view: the whole segment as bytes.
    assert seg.view().shape == (4096,)
    # An offset view sees the bytes further on.
    np.testing.assert_array_equal(seg.view(np.float64, (4,), offset=8 * 4), [4.0, 5.0, 6.0, 7.0])


def test_attach_sees_the_same_memory(seg):
    other = SharedArray.attach(seg.name, seg.nbytes)
    try:
        assert not other.owner
        seg.view(np.int32, (10,))[:] = np.arange(10)
        np.testing.assert_array_equal(other.view(np.int32, (10,)), np.arange(10))
        other.view(np.int32, (10,))[3] = -7
        assert seg.view(np.int32, (10,))[3] == -7
    finally:
        other.close()


def test_attach_from_another_process_sees_the_data(seg):
    seg.view(np.float64, (3,))[:] = [1.5, 2.5, 3.5]
    code = ("import numpy as np; from synkhronos.runtime.shmem import SharedArray; "
            f"s = SharedArray.attach({seg.name!r}, {seg.nbytes}); "
            "v = s.view(np.float64, (3,)); print(v.sum()); v[0] = 10.0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(7.5)
    assert seg.view(np.float64, (1,))[0] == 10.0


def test_unlink_removes_the_name_but_keeps_the_mapping(seg):
    v = seg.view(np.float64, (4,))
    v[:] = 3.0
    seg.unlink()
    assert not _exists(seg.name)
    np.testing.assert_array_equal(v, 3.0)
    with pytest.raises(SharedMemoryError, match="cannot open"):
        SharedArray.attach(seg.name, seg.nbytes)
    seg.unlink()  # a second unlink is harmless


def test_zero_byte_segment():
    s = SharedArray(_name(), 0)
    try:
        assert s.view(np.float64).shape == (0,)
    finally:
        s.unlink()
        s.close()


def test_close_twice_is_harmless():
    s = SharedArray(_name(), 64)
    s.unlink()
    s.close()
    s.close()


def test_sweep_unlinks_only_the_given_run():
    mine, theirs = shmem.run_prefix(os.getpid()), shmem.run_prefix(os.getpid())
    ours = [SharedArray(f"{mine}{k}", 64) for k in range(3)]
    other = SharedArray(f"{theirs}0", 64)
    try:
        removed = shmem.sweep(mine)
        for s in ours:
            assert not _exists(s.name)
            assert s.name.lstrip("/") in removed
        assert _exists(other.name)
    finally:
        for s in ours + [other]:
            s.unlink()
            s.close()


def _dead_pid():
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1   # no process can have this pid


def _lock_path(prefix):
    return os.path.join("/dev/shm", prefix[1:] + shmem.LOCK)


def test_sweep_stale_removes_runs_whose_lock_is_free_only():
    dead = shmem.run_prefix(os.getpid())          # its pid lives, but nobody holds its lock
    os.close(shmem.hold_run_lock(dead))
    # A run of another PID namespace: its pid means nothing here, but its lock is held.
    alive = shmem.run_prefix(_dead_pid())
    fd = shmem.hold_run_lock(alive)
    segs = [SharedArray(f"{dead}x", 64), SharedArray(f"{alive}x", 64)]
    try:
        removed = shmem.sweep_stale()
        assert not _exists(segs[0].name) and not os.path.exists(_lock_path(dead))
        assert segs[0].name.lstrip("/") in removed
        assert _exists(segs[1].name) and os.path.exists(_lock_path(alive))
    finally:
        os.close(fd)
        shmem.sweep(alive)
        for s in segs:
            s.unlink()
            s.close()


def test_sweep_stale_after_a_process_exits_without_unlinking():
    code = ("import os; from synkhronos.runtime import shmem; "
            "from synkhronos.runtime.shmem import SharedArray; "
            "p = shmem.run_prefix(os.getpid()); shmem.hold_run_lock(p); "
            "s = SharedArray(p + 'x', 64); print(s.name); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    name = out.stdout.strip()
    assert name.startswith("/synk_"), out.stderr
    # (Not asserted to exist here: another run's fork() may sweep it first.)
    shmem.sweep_stale()
    assert not _exists(name)


def test_run_prefixes_are_unguessable_and_carry_the_pid():
    a, b = shmem.run_prefix(4242), shmem.run_prefix(4242)
    assert a.startswith("/synk_4242_") and a.endswith("_") and a != b
    assert len(a.split("_")[2]) == 12


def test_a_taken_name_is_a_synk_error_naming_it():
    name = _name()
    first = SharedArray(name, 64)
    try:
        with pytest.raises(SharedMemoryError, match=name):
            SharedArray(name, 64)
    finally:
        first.unlink()
        first.close()


def test_more_than_dev_shm_holds_fails_at_once():
    free, _ = shmem.shm_space()
    with pytest.raises(SharedMemoryError, match=r"cannot allocate 4096\.0 GiB.*--shm-size"):
        SharedArray(_name(), 4 << 40)
    assert free is not None and free > 0
