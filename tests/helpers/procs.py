"""Helpers for tests that kill, stop or outlive processes: their segments, exits and deadlines."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

from synkhronos.runtime.state import get_runtime

DEADLINE_S = 10.0    # "within a few seconds", with room for a loaded 2-core machine


@contextlib.contextmanager
def busy_loops(n=None):
    """Spin ``n`` Python loops (default: one more than the cores) for the ``with`` block."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(n or (os.cpu_count() or 2) + 1)]
    try:
        yield busy
    finally:
        for p in busy:
            p.kill()
            p.wait()


def my_segments(pid=None):
    """The shared-memory segments of runs whose master is ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"synk_{pid}_"))


def gone(pid):
    """True once ``pid`` has exited (a zombie waiting for its reaper counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_for(pred, timeout=DEADLINE_S):
    """Poll ``pred`` until it holds or ``timeout`` passes; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


class SleepIn(Op):
    """Return x; first sleep ``seconds`` in every rank listed in the second input."""

    __props__ = ("seconds",)

    def __init__(self, seconds=30):
        self.seconds = seconds

    def make_node(self, x, ranks):
        x, ranks = pt.as_tensor_variable(x), pt.as_tensor_variable(ranks)
        return Apply(self, [x, ranks], [x.type()])

    def perform(self, node, inputs, outputs):
        x, ranks = inputs
        if get_runtime().place.rank in ranks:
            time.sleep(self.seconds)
        outputs[0][0] = x.copy()


def kill_master_and_check(proc, pids):
    """SIGKILL the master ``proc`` (its workers' ``pids`` alive); assert nothing of its run outlives it.

    Closes ``proc`` whatever happens.
    """
    try:
        assert all(not gone(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(DEADLINE_S)
        assert wait_for(lambda: all(gone(p) for p in pids)), "workers outlived their master"
        assert wait_for(lambda: not my_segments(proc.pid)), my_segments(proc.pid)
    finally:
        close_process(proc)


class FailInRank(Op):
    """Return x; in global rank ``rank``, raise ValueError (how="raise") or die by SIGKILL ("kill")."""

    __props__ = ("rank", "how")

    def __init__(self, rank, how="raise"):
        self.rank = rank
        self.how = how

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        if get_runtime().place.rank == self.rank:
            if self.how == "kill":
                # The wall clock, which simulated machines share: a test times the death's
                # detection from here, not from a call that first compiles the graph.
                print(f"KILLED AT {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"planted failure in rank {self.rank}")
        outputs[0][0] = inputs[0]


def close_process(proc):
    """Kill ``proc`` if it still runs, reap it, and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
