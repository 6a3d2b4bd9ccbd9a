"""Misusing fork() and profile(): fork from a thread that ends, fork while threads log, absurd
n_parallel, a failed start, errors and nesting inside profile(), calls from a child or a worker."""

import logging
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
from helpers.procs import DEADLINE_S, gone, kill_master_and_check, my_segments, wait_for
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(120)


def _sum_function():
    x = pt.dvector("x")
    f = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    return f


def _synk_children():
    import multiprocessing
    return [p for p in multiprocessing.active_children() if p.name.startswith("synk-")]


# ---- fork() from a thread ----------------------------------------------------------------

def test_fork_from_a_thread_that_ends_keeps_the_workers(forked):
    t = threading.Thread(target=forked, args=(2,))
    t.start()
    t.join()
    time.sleep(0.2)     # the parent-death signal, if any, has come by now
    f = _sum_function()
    assert f(np.arange(10.0)) == 45.0
    assert all(p.is_alive() for p in get_runtime().processes.procs.values())


THREAD_MASTER = textwrap.dedent("""
    import os, threading, time
    import synkhronos as synk
    from synkhronos.runtime.state import get_runtime
    t = threading.Thread(target=synk.fork, args=(2,), kwargs={"use_gpu": False})
    t.start()
    t.join()
    rt = get_runtime()
    print(rt.processes.janitor.pid, *[p.pid for p in rt.processes.procs.values()], flush=True)
    time.sleep(120)
""")


def test_workers_forked_from_a_thread_still_end_with_their_master():
    proc = subprocess.Popen([sys.executable, "-c", THREAD_MASTER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
    except BaseException:
        proc.kill()
        raise
    kill_master_and_check(proc, [int(p) for p in line.split()])


def test_fork_while_a_thread_logs_to_a_file(forked, tmp_path):
    # The thread writes records through the same handler as the ranks: a rank
    # that inherits the handler's stream locked waits forever on its first record.
    handler = logging.FileHandler(tmp_path / "log.txt")
    spam, synk_log = logging.getLogger("test.spam"), logging.getLogger("synkhronos")
    saved = synk_log.level, synk_log.propagate
    spam.propagate = synk_log.propagate = False
    spam.setLevel(logging.DEBUG)
    synk_log.setLevel(logging.DEBUG)
    spam.addHandler(handler)
    synk_log.addHandler(handler)
    stop = threading.Event()

    def write():
        while not stop.is_set():
            spam.debug("x" * 500)
    t = threading.Thread(target=write, daemon=True)
    t.start()
    try:
        for _ in range(3):
            forked(2, timeout=10)       # a rank stuck on the lock: WorkerStalledError
            f = _sum_function()
            assert f(np.arange(10.0)) == 45.0
            synk.close()
    finally:
        stop.set()
        t.join()
        spam.removeHandler(handler)
        synk_log.removeHandler(handler)
        synk_log.level, synk_log.propagate = saved
        spam.propagate = True
        handler.close()
    assert "rank 1 ran" in (tmp_path / "log.txt").read_text()


# ---- n_parallel the machine cannot start -------------------------------------------------

def test_more_ranks_than_the_machine_can_start_names_n_parallel():
    with pytest.raises(ValueError, match=r"n_parallel=1000000 is more ranks than"):
        synk.fork(10**6, use_gpu=False)
    assert get_runtime() is None and not _synk_children()


def test_a_failed_start_stops_the_ranks_started_and_fork_works_after(forked, monkeypatch):
    real_fork, calls = os.fork, []

    def fork_twice():
        calls.append(1)
        if len(calls) == 2:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real_fork()
    monkeypatch.setattr(os, "fork", fork_twice)
    with pytest.raises(BlockingIOError) as info:
        synk.fork(3, use_gpu=False)
    monkeypatch.undo()
    assert get_runtime() is None
    assert wait_for(lambda: not _synk_children())
    assert my_segments() == []
    assert "starting rank 2 of n_parallel=3 failed" in "".join(info.value.__notes__)
    assert forked(3) == 3
    assert _sum_function()(np.arange(10.0)) == 45.0


# ---- profile() ---------------------------------------------------------------------------

class Interrupt(Op):
    """Return x; raise KeyboardInterrupt in the master (as Ctrl-C would, mid-call)."""

    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        if get_runtime().is_master:
            raise KeyboardInterrupt("Ctrl-C")
        outputs[0][0] = inputs[0].copy()


def test_a_worker_dying_inside_profile_surfaces(forked):
    forked(2)
    f = _sum_function()
    with pytest.raises(synk.WorkerDiedError):
        with synk.profile():
            f(np.arange(4.0))
            os.kill(get_runtime().processes.procs[1].pid, signal.SIGKILL)
            assert wait_for(lambda: not get_runtime().processes.procs[1].is_alive())
            f(np.arange(4.0))
    assert get_runtime() is None


def test_ctrl_c_inside_profile_surfaces(forked):
    forked(2)
    x = pt.dvector("x")
    f = synk.function([x], (Interrupt()(x).sum(), "sum"), mode="FAST_COMPILE")
    synk.distribute()
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C"):
        with synk.profile():
            f(np.arange(4.0))
    assert get_runtime() is None


def test_nested_profiles_each_record_and_the_outer_counts_the_inner(forked):
    forked(2)
    f = _sum_function()
    with synk.profile() as outer:
        f(np.arange(4.0))
        with synk.profile() as inner:
            f(np.arange(4.0))
        f(np.arange(4.0))
    for rank in (0, 1):
        assert inner.totals()[rank]["call of function"]["calls"] == 1
        assert outer.totals()[rank]["call of function"]["calls"] == 3
        assert "profile" not in inner.totals()[rank]
    assert get_runtime().profiler is None
    # Entering one profile twice is refused; the run goes on.
    ctx = synk.profile()
    with ctx:
        with pytest.raises(synk.SynkStateError, match="open already"):
            ctx.__enter__()
    assert f(np.arange(4.0)) == 6.0


# ---- calls from a process other than the master ------------------------------------------

def _in_child(body):
    """Run ``body()`` in an os.fork() child; return the child's exit status (killed if hung)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = body()
        finally:
            os._exit(code)
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


def test_a_child_of_the_master_cannot_drive_the_workers(forked):
    forked(2)
    f = _sum_function()
    v = synk.data(np.arange(4.0))
    assert f(v) == f(v) == 6.0         # a repeat: the child's call below takes its fast path

    def body():
        for call in (lambda: f(v), lambda: f(np.arange(4.0)), lambda: synk.data(np.ones(2)),
                     lambda: v.set_value(np.ones(3)), synk.close, synk.profile().__enter__):
            try:
                call()
                return 2
            except synk.SynkStateError as exc:
                if "not the synkhronos master" not in str(exc):
                    return 3
        return 0
    assert _in_child(body) == 0
    assert f(v) == 6.0                 # the master's run is untouched


CHILD_MASTER = textwrap.dedent("""
    import os, time
    import synkhronos as synk
    from synkhronos.runtime.state import get_runtime
    synk.fork(2, use_gpu=False)
    rt = get_runtime()
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print(child, *[p.pid for p in rt.processes.procs.values()], flush=True)
    time.sleep(120)
""")


def test_a_child_of_a_killed_master_does_not_keep_its_run_alive():
    # The child holds no pipe to the janitor and no run lock: the janitor cleans up at once.
    proc = subprocess.Popen([sys.executable, "-c", CHILD_MASTER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    child = None
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        child, *workers = [int(p) for p in line.split()]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(DEADLINE_S)
        assert wait_for(lambda: all(gone(p) for p in workers)), "workers outlived their master"
        assert wait_for(lambda: not my_segments(proc.pid)), my_segments(proc.pid)
        assert not gone(child)
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


class CallsData(Op):
    """Return x; in rank 1, call synk.data() (a master-only entry point)."""

    __props__ = ()

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        if get_runtime().place.rank == 1:
            synk.data(np.ones(2))
        outputs[0][0] = inputs[0].copy()


def test_a_worker_calling_the_api_gets_a_state_error(forked):
    forked(2)
    x = pt.dvector("x")
    f = synk.function([x], (CallsData()(x).sum(), "sum"), mode="FAST_COMPILE")
    synk.distribute()
    with pytest.raises(synk.WorkerError, match="a worker") as info:
        f(np.arange(4.0))
    assert isinstance(info.value.__cause__, synk.SynkStateError)
    assert not get_runtime().closed    # a worker's error: the run goes on
