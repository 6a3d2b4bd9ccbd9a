"""SharedArray: create, attach, view, unlink; the sweeps that clean up after runs."""

import itertools
import os
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest

from synkhronos import shmem
from synkhronos.shmem import SharedArray

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
    code = ("import numpy as np; from synkhronos.shmem import SharedArray; "
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
    with pytest.raises(posix_ipc.ExistentialError):
        SharedArray.attach(seg.name, seg.nbytes)
    seg.unlink()  # a second unlink is harmless


def test_zero_byte_segment():
    s = SharedArray(_name(), 0)
    try:
        assert s.view(np.float64).shape == (0,)
    finally:
        s.unlink()
        s.close()


def test_create_refuses_an_existing_name(seg):
    with pytest.raises(posix_ipc.ExistentialError):
        SharedArray(seg.name, 16)


def test_close_twice_is_harmless():
    s = SharedArray(_name(), 64)
    s.unlink()
    s.close()
    s.close()


def test_sweep_unlinks_only_the_given_master_pid():
    other_pid = os.getppid()
    mine = [SharedArray(_name(), 64) for _ in range(3)]
    theirs = SharedArray(_name(other_pid), 64)
    try:
        removed = shmem.sweep(os.getpid())
        for s in mine:
            assert not _exists(s.name)
            assert s.name.lstrip("/") in removed
        assert _exists(theirs.name)
    finally:
        for s in mine + [theirs]:
            s.unlink()
            s.close()


def _dead_pid():
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1   # no process can have this pid


def test_sweep_stale_removes_segments_of_dead_masters_only():
    dead = SharedArray(_name(_dead_pid()), 64)
    live = SharedArray(_name(), 64)
    try:
        shmem.sweep_stale()
        assert not _exists(dead.name)
        assert _exists(live.name)
    finally:
        for s in (dead, live):
            s.unlink()
            s.close()


def test_sweep_stale_after_a_process_exits_without_unlinking():
    code = ("import os; from synkhronos.shmem import SharedArray; "
            "s = SharedArray(f'/synk_{os.getpid()}_0_0x', 64); print(s.name); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    name = out.stdout.strip()
    assert name.startswith("/synk_"), out.stderr
    # (Not asserted to exist here: another run's fork() may sweep it first.)
    shmem.sweep_stale()
    assert not _exists(name)


def test_segment_prefix_matches_runtime_names():
    assert shmem.segment_prefix(4242) == "/synk_4242_"
