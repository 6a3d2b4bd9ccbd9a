"""Jobs on the Slurm of helpers/slurm.py: every launch route's batch script, its run, and faults.

Shared by tests/cluster/test_slurm.py and bench/slurm_routes.py.  A route is how a
user starts the program in a batch script (``ROUTES``: ``mpiexec`` or
``mpirun`` inside the allocation, ``srun --mpi=...``, or ``salloc`` from the
head node); ``run_route`` runs helpers/slurm_job.py through it and reads what
the controller saw (layout, each rank's cores); ``refused`` runs a route the
library must refuse; ``fault_run`` breaks a machine while the controller calls
a function (helpers/cluster_faults.py "run"), and times the error, the end of
every process of the job, and the job's end in Slurm.
"""

import os
import re
import subprocess
import sys
import time
from typing import NamedTuple

from .slurm import TESTS

JOB = "helpers/slurm_job.py"
FAULTS = "helpers/cluster_faults.py"
LIMIT_S = 150  # every launcher runs under `timeout`: a one-sided MPI_Init failure can hang

# name -> (MPI flavor, the command that starts Python in the batch script)
ROUTES = {
    "sbatch + mpiexec": ("mpich", "mpiexec"),
    "salloc + mpiexec": ("mpich", "mpiexec"),  # salloc runs it on the head node
    "srun --mpi=pmi2": ("mpich", "srun --mpi=pmi2"),
    "sbatch + mpirun": ("openmpi", "mpirun"),
    "sbatch + mpirun --with-ft ulfm": ("openmpi", "mpirun --with-ft ulfm"),
    "srun --mpi=pmix": ("openmpi", "srun --mpi=pmix"),
}
# Routes the library refuses at fork(): name -> (flavor or None for both, command, message).
REFUSED = {
    "srun --mpi=pmix with MPICH": ("mpich", "srun --mpi=pmix", r"speaks PMI-1/PMI-2, not PMIx"),
    "srun --mpi=pmi2 with Open MPI": ("openmpi", "srun --mpi=pmi2", r"speaks PMIx only"),
    "srun without --mpi": (None, "srun --mpi=none", r"srun started this program as task \d "
                                                    r"of \d .* without MPI"),
}
# The route docs/slurm.md recommends for each MPI, and its srun route.
RECOMMENDED = {"mpich": "sbatch + mpiexec", "openmpi": "sbatch + mpirun --with-ft ulfm"}
SRUN = {"mpich": "srun --mpi=pmi2", "openmpi": "srun --mpi=pmix"}
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE")


def batch_script(launch, args, limit=LIMIT_S):
    return (f"#!/bin/sh\ntimeout {limit} {launch} python {' '.join(args)}\n"
            "echo \"LAUNCHER EXIT $?\"\n")


def sbatch(slurm, script, nodes, per_node, env=None, extra=()):
    """Submit the batch script text ``script`` from the head node (``sbatch -N nodes
    --ntasks-per-node per_node``, then ``extra``, from tests/); return its ``Job``."""
    jobs = os.path.join(slurm.dir, "jobs")
    os.makedirs(jobs, exist_ok=True)
    k = len(os.listdir(jobs))
    path, out = os.path.join(jobs, f"job{k}.sh"), os.path.join(jobs, f"job{k}.out")
    with open(path, "w") as f:
        f.write(script)
    t0 = time.monotonic()
    p = slurm.run_head(["sbatch", "--parsable", "-N", str(nodes), f"--ntasks-per-node={per_node}",
                        *extra, "-o", out, path], env=env, cwd=TESTS, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"sbatch: {p.stderr.strip()}")
    return Job(slurm, p.stdout.strip().split(";")[0], out, t0)


class Job:
    """A submitted job: its id, its output file, and when it was submitted."""

    def __init__(self, slurm, job_id, out, t0):
        self.slurm, self.id, self.out, self.t0 = slurm, job_id, out, t0
        self.state = None  # its last state in slurmctld (scontrol)
        self.took = None   # seconds from sbatch to the job's end, once ended
        self.proc = None   # salloc's process, for a job started with salloc

    def output(self):
        if self.proc is not None:
            return self.proc.out
        try:
            with open(self.out, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wait_output(self, pattern, timeout):
        """Wait until the output matches ``pattern`` (a regex, multi-line); return the match."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output(), re.M):
            if time.monotonic() > deadline or self.ended():
                break
            time.sleep(0.1)
        return re.search(pattern, self.output(), re.M)

    def ended(self):
        """Whether the job has ended and left squeue (its state then kept in ``state``)."""
        if self.took is not None:
            return True
        p = self.slurm.run_head(["scontrol", "-o", "show", "job", self.id], timeout=20)
        m = re.search(r"\bJobState=(\S+)", p.stdout)
        if m:
            self.state = m.group(1)
        if not any(j == self.id for j, _ in self.slurm.squeue()) and \
                (self.state is None or self.state in ENDED):
            self.took = time.monotonic() - self.t0
        return self.took is not None

    def wait(self, timeout=LIMIT_S + 30):
        """Wait for the job's end (scancel it past ``timeout``); return its output."""
        deadline = time.monotonic() + timeout
        while not self.ended():
            if time.monotonic() > deadline:
                self.slurm.run_head(["scancel", self.id], timeout=20)
                raise AssertionError(f"job {self.id} ran past {timeout} s:\n{self.output()}\n"
                                     f"{self.slurm.logs()}")
            time.sleep(0.2)
        return self.output()


class _Salloc:
    """salloc run from the head node, its output gathered by a thread."""

    def __init__(self, slurm, nodes, per_node, args, env):
        self.out = ""
        self.p = slurm.popen_head(["timeout", str(LIMIT_S), "salloc", "-N", str(nodes),
                                   f"--ntasks-per-node={per_node}", "mpiexec", "python", *args],
                                  env=env, cwd=TESTS, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)

    def communicate(self):
        self.out, _ = self.p.communicate(timeout=LIMIT_S + 30)
        m = re.search(r"Granted job allocation (\d+)", self.out)
        return m.group(1) if m else None


def start(slurm, route, per_node, args, nodes=2, limit=LIMIT_S, **env):
    """Start ``python args`` through ``route`` on ``nodes`` nodes (under ``timeout limit``);
    return its ``Job``."""
    launch = ROUTES.get(route, (None, route))[1]
    env = slurm.env(**env)
    if route == "salloc + mpiexec":
        t0 = time.monotonic()
        s = _Salloc(slurm, nodes, per_node, args, env)
        job = Job(slurm, s.communicate(), None, t0)
        job.proc = s
        return job
    return sbatch(slurm, batch_script(launch, args, limit), nodes, per_node, env=env)


class Result(NamedTuple):
    """What one route did: whether the contract held, what the controller saw, the job's time
    from sbatch to its end, and what it left (``Slurm.leftovers``)."""

    route: str
    per_node: int
    ok: bool
    layout: str       # "n_machines: host xN, host xN"
    cores: list       # each machine's ranks' cores (bit masks)
    took: float
    state: str
    left: dict
    out: str

    def line(self):
        left = "nothing" if not self.left else repr(self.left)
        return (f"{self.route}, 2 nodes x {self.per_node}: {'PASS' if self.ok else 'FAIL'}; "
                f"layout {self.layout}; cores {self.cores}; sbatch to job end {self.took:.1f} s "
                f"({self.state}); left: {left}")


def run_route(slurm, route, per_node, ranks=1):
    """Run helpers/slurm_job.py through ``route``, ``per_node`` MPI processes on each of 2
    nodes; return its ``Result`` once the job has ended and left nothing (or 10 s passed)."""
    job = start(slurm, route, per_node, [JOB, str(ranks)])
    out = job.wait()
    lay = re.search(r"^LAYOUT (\d+) (.*)$", out, re.M)
    layout, cores = "none", []
    if lay:
        n = int(lay.group(1))
        hosts = lay.group(2).split()[n:]
        layout = f"{n} machines: " + ", ".join(f"{h} x{hosts.count(h)}" for h in dict.fromkeys(hosts))
    c = re.search(r"^CORES (.*)$", out, re.M)
    if c:
        cores = [[int(x) for x in m.split(",")] for m in c.group(1).split()]
    left = settle(slurm)
    return Result(route, per_node, "ALL OK" in out, layout, cores, job.took, job.state, left, out)


def settle(slurm, lost=(), timeout=10.0):
    """Wait until nothing of a job is left on any machine; return what is left then."""
    deadline = time.monotonic() + timeout
    while slurm.leftovers(lost) and time.monotonic() < deadline:
        time.sleep(0.1)
    return slurm.leftovers(lost)


def refused(slurm, name):
    """Run the refused route ``name`` (2 nodes x 1); return (its Job's output, seconds, left)."""
    launch = REFUSED[name][1]
    job = sbatch(slurm, batch_script(launch, [JOB, "1"]), 2, 1, env=slurm.env())
    out = job.wait()
    return out, job.took, settle(slurm)


FAULTS_KINDS = ("processes killed", "node crashed", "link cut", "controller killed",
                "job cancelled")


class Fault(NamedTuple):
    """What one fault did, in seconds from the fault: the controller's error, the end of every
    process of the job (on a cut node: but Slurm's step daemon, which waits for the link),
    the job's end in Slurm; what was left then, and (a cut) how long after mending the link
    the cut node's step daemon took to go."""

    route: str
    fault: str
    out: str
    error: str
    t_error: float
    t_gone: float
    t_node: float     # node 1's processes gone (but Slurm's step daemon)
    t_end: float
    state: str
    left: dict
    t_mended: float
    named: bool       # the controller named node 1's machine (its error, or its log line)

    def line(self):
        def s(t):
            return "never" if t is None else f"{t:.1f} s"
        mended = f"; cut node's slurmstepd gone {s(self.t_mended)} after mending" \
            if self.fault == "link cut" else ""
        return (f"{self.route}, {self.fault}: error {self.error!r} after {s(self.t_error)}; "
                f"machine named: {'yes' if self.named else 'no'}; every "
                f"process gone after {s(self.t_gone)}; job ended ({self.state}) after "
                f"{s(self.t_end)}; node 1's processes gone after {s(self.t_node)}; left: "
                f"{self.left or 'nothing'}{mended}")


def fault_run(slurm, route, fault, heartbeat_s=3, bound=60.0):
    """Run helpers/cluster_faults.py through ``route`` on 2 nodes x 1; once the controller
    calls functions, do ``fault`` to node 1 (or kill the controller); return a ``Fault``."""
    killer = fault == "controller killed"
    job = start(slurm, route, 1, [FAULTS, "kill-controller" if killer else "run", "1"],
                SYNK_HEARTBEAT_S=str(heartbeat_s), SYNK_SPIN_S="0")
    ready = job.wait_output(r"^PIDS" if killer else r"^READY", LIMIT_S)
    assert ready and (killer or not job.ended()), job.output()
    t0 = time.monotonic()
    m, lost, waiting = slurm.machines, (), ()
    if fault == "processes killed":
        m.kill(1, "cluster_faults.py")
        lost = (1,)
    elif fault == "node crashed":
        m.crash(1)
        lost = (1,)
    elif fault == "link cut":
        m.cut(1)
        waiting = (1,)
    elif fault == "job cancelled":  # scancel, as at the job's time limit: SIGTERM, then SIGKILL
        slurm.run_head(["scancel", job.id], timeout=20)

    def left():
        return {i: (procs, segs) for i, (procs, segs) in slurm.leftovers(lost).items()
                if i not in waiting or segs or any("slurmstepd" not in c for _, c in procs)}
    t_gone = t_end = t_node = None
    while time.monotonic() < t0 + bound and (t_gone is None or t_end is None):
        now = time.monotonic() - t0
        if t_node is None and 1 not in left():
            t_node = now
        if t_gone is None and not left():
            t_gone = now
        if t_end is None and job.ended():
            t_end = now
        time.sleep(0.1)
    rest = left()
    t_mended = None
    if waiting:
        m.mend(1)
        t1 = time.monotonic()
        if not settle(slurm, lost, timeout=bound + 30):
            t_mended = time.monotonic() - t1
    out = job.output()
    caught = re.search(r"^CAUGHT (\w+) at ([\d.]+) (.*)$", out, re.M)
    named = re.search(NAMED + r"(: | lost: the connection to its sentinel closed)", out)
    return Fault(route, fault, out, f"{caught.group(1)}: {caught.group(3)}" if caught else None,
                 float(caught.group(2)) - t0 if caught else None, t_gone, t_node, t_end, job.state,
                 rest, t_mended, bool(named))


NAMED = r"machine 1 \(\S+, ranks 1\.\.1\)"  # how the controller names node 1's machine


def fork_once(slurm, node):
    """Fork and close a 1-rank run on ``node`` (no MPI); return what is left in its /dev/shm.

    ``fork()`` first removes the segments of runs that are provably dead.
    """
    code = "import synkhronos as synk; synk.fork(1, use_gpu=False); synk.close()"
    env = slurm.env(SYNK_CLUSTER="0")
    p = slurm.machines.run(node, [sys.executable, "-c", code], env=env, cwd=TESTS,
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return slurm.machines.segments(node)
