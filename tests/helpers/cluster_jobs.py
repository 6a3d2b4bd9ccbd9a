"""MPI jobs on simulated machines (machines.py), or on this host where they cannot be made.

Shared by tests/cluster/test_cluster.py, tests/cluster/test_cluster_survival.py and
bench/faults.py: starting a job from machine 0, what it needs in its
environment under each MPI, and ``fault_run``, which times what a fault does
(the controller's error, mpiexec's end, the last process's end).
"""

import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

from .machines import Machines, mpi_flavor, why_no_machines
from .procs import DEADLINE_S, gone, wait_for

HELPERS = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HELPERS)
ROOT = os.path.dirname(TESTS)
FAULTS = os.path.join(HELPERS, "cluster_faults.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
FLAVOR = mpi_flavor(MPIEXEC)
NO_MACHINES = why_no_machines() if FLAVOR else None


def why_no_mpi():
    """Why cluster jobs cannot run in this environment (no mpi4py or no mpiexec), or None."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    if not os.path.exists(MPIEXEC):
        return f"no mpiexec next to {sys.executable} (pip install -e '.[mpi]')"
    return None


def _mpi_segments():
    return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm")}


class OneHost:
    """Every MPI process on this host: the part of Machines' interface these tests use."""

    def __init__(self, n):
        self.n = n
        self.names = [socket.gethostname()] * n
        self.cores = [sorted(os.sched_getaffinity(0))] * n
        self.before = set()

    def __enter__(self):
        self.before = _mpi_segments()
        return self

    def __exit__(self, *exc):
        pass

    def mpi_command(self, n, args, flags=(), forward=()):
        # Open MPI counts cores as slots.
        over = ["--oversubscribe"] if FLAVOR == "openmpi" else []
        return [MPIEXEC, *over, *flags, "-n", str(n), sys.executable, *args]

    def mpi_env(self):
        # Open MPI refuses root without being told twice.
        return ({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
                if FLAVOR == "openmpi" else {})

    def popen(self, i, args, cwd=None, **kw):
        return subprocess.Popen(args, cwd=cwd, **kw)

    def leftovers(self, prefix, script):
        procs = subprocess.run(["pgrep", "-fa", script], capture_output=True, text=True).stdout
        segs = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
        segs += sorted(_mpi_segments() - self.before)
        return {0: (procs.splitlines(), segs)} if procs or segs else {}


def machines(n):
    """n simulated machines, or this host standing in for them where they cannot be made."""
    return Machines(n) if NO_MACHINES is None else OneHost(n)


def _env(cluster, **extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SYNK_CLUSTER", None)
    env.update(cluster.mpi_env())
    env.update(extra)
    return env


def _forwarded(cluster, env):
    """The variables the job needs on every machine (Open MPI passes only those named with -x)."""
    return ["PYTHONPATH", *env, *(k for k in ("LOG", "PYTENSOR_FLAGS") if k in os.environ)]


def start(cluster, n, args, flags=(), **env):
    """Start ``python args`` under mpiexec on n machines (from machine 0); return the Popen."""
    if isinstance(cluster, Machines) and len({tuple(c) for c in cluster.cores[:n]}) < n:
        # Machines sharing a core: a rank spinning while it waits takes the core from
        # the other machine's ranks.
        env.setdefault("SYNK_SPIN_S", "0")
    cmd = cluster.mpi_command(n, args, flags, forward=_forwarded(cluster, env))
    return cluster.popen(0, cmd, cwd=TESTS, env=_env(cluster, **env), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)


def mpirun(cluster, n, args, timeout=200, flags=(), **env):
    """Run ``python args`` under mpiexec on n machines; return (exit status, output, seconds)."""
    t0 = time.monotonic()
    p = start(cluster, n, args, flags, **env)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"mpiexec ran past {timeout} s:\n{out}") from None
    return p.returncode, out, time.monotonic() - t0



class Fault(NamedTuple):
    """What one fault did: the job's output and exit status, and seconds from the fault to
    the controller's error, to mpiexec's end and to no process left on any machine (None:
    not within the bound)."""

    out: str
    rc: int
    error: str
    t_error: float
    t_mpirun: float
    t_gone: float


def fault_run(m, n, local, fault, name, flags=(), bound=30.0, **env):
    """Start the "run" job on n machines; once its controller calls functions, do ``fault()``.

    Watch the job for ``bound`` seconds; kill mpiexec if it is still there then (the
    machines' teardown ends the rest). Prints the measured times.
    """
    p = start(m, n, [FAULTS, "run", str(local)], flags, **env)
    lines, ready = [], threading.Event()

    def read():
        for line in p.stdout:
            lines.append(line)
            if line.startswith("READY"):
                ready.set()
        ready.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert ready.wait(150) and p.poll() is None, "".join(lines)
    t0 = time.monotonic()
    fault()
    t_mpirun = t_gone = None
    while time.monotonic() < t0 + bound and (t_mpirun is None or t_gone is None):
        now = time.monotonic()
        if t_mpirun is None and p.poll() is not None:
            t_mpirun = now - t0
        if t_gone is None and not any(m.processes(i) for i in range(m.n)):
            t_gone = now - t0
        time.sleep(0.05)
    if p.poll() is None:
        p.kill()
    p.wait()
    reader.join(10)
    out = "".join(lines)
    caught = re.search(r"^CAUGHT (\w+) at ([\d.]+) (.*)$", out, re.M)
    t_error = float(caught.group(2)) - t0 if caught else None
    error = f"{caught.group(1)}: {caught.group(3)}" if caught else None

    def s(t):
        return "never" if t is None else f"{t:.2f} s"
    print(f"{FLAVOR} {name}: error {error!r} after {s(t_error)}; mpiexec ended after "
          f"{s(t_mpirun)} (exit {p.returncode}); every process gone after {s(t_gone)}")
    return Fault(out, p.returncode, error, t_error, t_mpirun, t_gone)


def _left(cluster, prefix, script, lost=()):
    if isinstance(cluster, OneHost):
        return cluster.leftovers(prefix, script)
    # A machine whose every process was killed at once (its janitor too) keeps its
    # segments until the next fork there sweeps them, or loses them with its memory.
    return {i: (procs, [] if i in lost else segs)
            for i, (procs, segs) in cluster.leftovers().items() if procs or i not in lost}


def assert_nothing_left(cluster, out, script="cluster_faults.py", lost=()):
    """Assert that no process or segment of the job outlived it, on any machine.

    On simulated machines: nothing runs on any of them and every /dev/shm is
    empty but those of the ``lost`` machines (every process on them killed).
    On one host: no pid from the job's PIDS line lives, no segment with its
    prefix or MPI's is left, no process runs the script.
    """
    m = re.search(r"^PIDS ([\d ]+) (/synk_\S+)$", out, re.M)
    assert m, out
    pids = [int(p) for p in m.group(1).split()]
    prefix = m.group(2).lstrip("/")

    def clean():
        return all(gone(p) for p in pids) and not _left(cluster, prefix, script, lost)
    wait_for(clean, DEADLINE_S)
    alive = [p for p in pids if not gone(p)]
    left = _left(cluster, prefix, script, lost)
    assert not alive and not left, (alive, left, out)
