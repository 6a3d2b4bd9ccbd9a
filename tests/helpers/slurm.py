"""A real Slurm on simulated machines (machines.py): munge, one slurmctld, one slurmd per node.

``Slurm(n)`` makes n compute nodes and a head node (n + 1 simulated machines,
the head last): slurmctld runs on the head, where jobs are submitted as from a
cluster's login node, and one slurmd runs on each compute node, under its own
name (``slurmd -N``; Debian's build allows several on one host). One munged,
with a key and socket of its own, authenticates them all; nothing of the
host's own munge or Slurm is used or touched. The configuration is the
smallest that runs MPI jobs: no accounting, ``proctrack/linuxproc``,
``task/none`` (so a job's processes keep the cores of their machine), one
partition of every node; a lost node is taken for down after about 10 s
(``SlurmdTimeout=5``, ``MessageTimeout=3``; Slurm's defaults: 300 s, 10 s), and a
job that loses a node is not requeued (``JobRequeue=0``).

Facts this relies on, measured on Debian 12 with Slurm 22.05:
``ip netns exec`` (which makes each machine's holder) remounts /sys without the
cgroup mounts, and slurmd refuses to start without them, so each node gets a
tmpfs on /sys/fs/cgroup with the named v1 hierarchy "systemd" under it (what
its cgroup plugin looks for; no controller is used); the spool
directories must exist before slurmd starts; PMIx (``srun --mpi=pmix``) keeps
its per-job directories under ``PMIxCliTmpDirBase``, which must differ between
nodes: a tmpfs in each node's mount namespace.

Everything is torn down on exit, even when a test fails: jobs cancelled, the
daemons ended (the machines' teardown kills what is left in them), munged
ended, the temp folder removed. Ports are drawn at random per run (they live
in the machines' own network namespaces anyway).
"""

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .machines import Machines, mpi_flavor, why_no_machines

# Slurm's own daemons, which stay between jobs (slurmscriptd: slurmctld's helper).
DAEMONS = ("slurmd", "slurmctld", "slurmscriptd")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "libpmix-dev")
TOOLS = ("slurmctld", "slurmd", "sbatch", "salloc", "srun", "squeue", "scancel", "sinfo",
         "munged")
PLUGINS = "/usr/lib/x86_64-linux-gnu/slurm-wlm"
# srun --mpi=pmix loads the unversioned libpmix.so, which only libpmix-dev installs.
LIBPMIX = "/usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so"
BIN = os.path.dirname(sys.executable)
HELPERS = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HELPERS)
ROOT = os.path.dirname(TESTS)


def why_no_slurm():
    """Return why this host cannot run the Slurm tests, or None when it can."""
    why = why_no_machines()
    if why:
        return why
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): `make test` installs "
                f"it as root where apt works (apt-get install {' '.join(PACKAGES)})")
    if shutil.which("munge") is None and not os.path.exists("/usr/sbin/munged"):
        return "munge is not installed"
    if mpi_flavor() is None:
        return f"no mpiexec next to {sys.executable}"
    return _why_no_cgroup_mount()


def _why_no_cgroup_mount():
    """slurmd wants a cgroup file system in each node (``Slurm._node_mounts``): try one."""
    d = tempfile.mkdtemp(prefix="synkcgprobe")
    try:
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            _CGROUP.format(d=d)], capture_output=True, text=True, timeout=20)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return None if p.returncode == 0 else f"cannot mount a cgroup file system: {p.stderr.strip()}"


# slurmd needs a cgroup file system at /sys/fs/cgroup, even with proctrack/linuxproc and
# task/none (its cgroup/v1 plugin looks for the systemd hierarchy); ip netns exec left none.
_CGROUP = ("mount -t tmpfs synkcg {d} && mkdir {d}/systemd && "
           "mount -t cgroup -o none,name=systemd synkcg {d}/systemd")


def why_no_pmix():
    """Return why ``srun --mpi=pmix`` cannot run here, or None when it can."""
    if not os.path.exists(os.path.join(PLUGINS, "mpi_pmix.so")):
        return "Slurm's PMIx plugin (mpi_pmix.so) is missing"
    if not os.path.exists(LIBPMIX):
        return f"{LIBPMIX} is missing (apt-get install libpmix-dev)"
    return None


_CONF = """\
ClusterName={cluster}
SlurmctldHost={head}({head_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
KillWait=2
MessageTimeout=3
MailProg=/bin/true
MinJobAge=120
JobRequeue=0
InactiveLimit=0
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{nodes}
PartitionName=synk Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """A Slurm cluster of ``n_nodes`` simulated compute nodes and a head; a context manager.

    Args:
        n_nodes: compute nodes (each a simulated machine running slurmd).
        cpus: CPUs each node declares (default: every core of this host, which every
            node may use: two MPI processes on a node then get disjoint cores).
        slurmd_timeout: seconds after which slurmctld takes a silent node for down.

    Attributes:
        machines: the ``Machines`` (nodes 0..n_nodes-1, the head last).
        nodes: the compute nodes' names.
        head: the head node's index in ``machines``.
        dir: the private folder (configuration, logs, state, spool).
    """

    def __init__(self, n_nodes, cpus=None, slurmd_timeout=5):
        self.n_nodes = n_nodes
        cores = sorted(os.sched_getaffinity(0))
        self.cpus = cpus or len(cores)
        self.slurmd_timeout = slurmd_timeout
        self.machines = Machines(n_nodes + 1, cores_each=[cores] * (n_nodes + 1))
        self.head = n_nodes
        self.nodes = []
        self.dir = None
        self.conf = None
        self.munged = None
        self.daemons = []  # (machine, Popen): slurmctld first
        self.ctld_port, self.slurmd_port = random.sample(range(10000, 30000), 2)

    # -- setup and teardown ---------------------------------------------------------------------
    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _make(self):
        m = self.machines
        m.__enter__()
        self.nodes = m.names[:self.n_nodes]
        self.dir = tempfile.mkdtemp(prefix=f"{m.tag}-slurm-")
        os.chmod(self.dir, 0o755)
        for sub in ("state", "log", "munge", *(f"spool/{n}" for n in self.nodes)):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        self._start_munge()
        self.conf = os.path.join(self.dir, "slurm.conf")
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={self.cpus} State=UNKNOWN"
                          for n, a in zip(self.nodes, m.addresses))
        with open(self.conf, "w") as f:
            f.write(_CONF.format(
                cluster=f"synk{os.getpid()}", head=m.names[self.head],
                head_addr=m.addresses[self.head], ctld_port=self.ctld_port,
                slurmd_port=self.slurmd_port, munge_socket=self.munge_socket,
                slurmd_timeout=self.slurmd_timeout, dir=self.dir, nodes=nodes))
        # PMIx's per-job directories, on a tmpfs of each node's own (else the nodes clash).
        pmix_dir = os.path.join(self.dir, "pmix")
        os.makedirs(pmix_dir)
        with open(os.path.join(self.dir, "mpi.conf"), "w") as f:
            f.write(f"PMIxCliTmpDirBase={pmix_dir}\n")
        # Each node's (and the head's) own temp folder, for the job's TMPDIR: what MPI
        # leaves there (Open MPI's session folders, Hydra's topology files) goes with it.
        self.tmp = os.path.join(self.dir, "tmp")
        os.makedirs(self.tmp)
        for i in range(self.n_nodes + 1):
            self._node_mounts(i, pmix_dir if i < self.n_nodes else None)
        log = open(os.path.join(self.dir, "log", "slurmctld.out"), "w")
        self.daemons.append((self.head, m.popen(
            self.head, ["slurmctld", "-D", "-i", "-f", self.conf], stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, env=self._daemon_env())))
        log.close()
        for i, name in enumerate(self.nodes):
            log = open(os.path.join(self.dir, "log", f"slurmd-{name}.out"), "w")
            self.daemons.append((i, m.popen(
                i, ["slurmd", "-D", "-N", name, "-f", self.conf], stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, env=self._daemon_env())))
            log.close()
        self.wait_idle()

    def _start_munge(self):
        d = os.path.join(self.dir, "munge")
        self.munge_socket = os.path.join(d, "munge.socket")
        key = os.path.join(d, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(128))
        os.chmod(key, 0o400)
        shutil.chown(d, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        os.chmod(d, 0o711)  # munged: execute for all on the socket's folder, writable by none
        self.munged = subprocess.Popen(
            ["setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "munged", "-F",
             f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
             f"--seed-file={d}/munged.seed"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.munge_socket):
            if self.munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self.munged.stderr.read()}")
            time.sleep(0.02)

    def _node_mounts(self, i, pmix_dir):
        script = f"mount -t tmpfs -o mode=1777 synktmp {self.tmp}"
        if pmix_dir:
            script += (f" && {_CGROUP.format(d='/sys/fs/cgroup')}"
                       f" && mount -t tmpfs -o mode=0755 synkpmix {pmix_dir}")
        p = self.machines.run(i, ["sh", "-c", script], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"node {i}: {script}: {p.stderr.strip()}")

    def _daemon_env(self):
        return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "LANG": "C.UTF-8", "HOME": "/root"}

    def close(self):
        """Cancel every job, end every daemon, tear the machines down, remove the folder."""
        m = self.machines
        if self.conf and self.daemons:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self.run_head(["scancel", "--full", "--quiet", "--partition=synk"], timeout=10)
        for _, p in reversed(self.daemons):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in reversed(self.daemons):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.daemons = []
        m.close()
        if self.munged is not None:
            self.munged.terminate()
            try:
                self.munged.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.munged.kill()
                self.munged.wait()
            self.munged.stderr.close()
            self.munged = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- using it ---------------------------------------------------------------------------------
    def env(self, **extra):
        """The environment a job is submitted with: this interpreter's bin first, the
        project on PYTHONPATH, the MPI's settings for the simulated network, ``extra``."""
        env = dict(os.environ)
        env.pop("SYNK_CLUSTER", None)
        env["SLURM_CONF"] = self.conf
        env["TMPDIR"] = self.tmp
        env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env.update(self.machines.mpi_env())
        env.update(extra)
        return env

    def run_head(self, args, env=None, **kw):
        """subprocess.run ``args`` on the head node (where jobs are submitted)."""
        return self.machines.run(self.head, args, env=env or self.env(), capture_output=True,
                                 text=True, **kw)

    def popen_head(self, args, env=None, **kw):
        """subprocess.Popen ``args`` on the head node."""
        return self.machines.popen(self.head, args, env=env or self.env(), **kw)

    def sinfo(self):
        """{node: state} as slurmctld sees them."""
        p = self.run_head(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=20)
        return dict(line.split() for line in p.stdout.splitlines() if line.strip())

    def squeue(self):
        """The jobs slurmctld still holds: [(job id, state)]."""
        p = self.run_head(["squeue", "-h", "-o", "%i %T"], timeout=20)
        if p.returncode != 0:
            raise RuntimeError(f"squeue: {p.stderr.strip()}")
        return [tuple(line.split()) for line in p.stdout.splitlines() if line.strip()]

    def wait_idle(self, timeout=60):
        """Wait until every node is idle."""
        deadline = time.monotonic() + timeout
        states = {}
        while time.monotonic() < deadline:
            for _, p in self.daemons:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon ended (exit {p.returncode}):\n"
                                       f"{self.logs()}")
            try:
                states = self.sinfo()
            except subprocess.TimeoutExpired:
                states = {}
            if len(states) == self.n_nodes and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.1)
        raise RuntimeError(f"Slurm's nodes did not come up: {states}\n{self.logs()}")

    def logs(self, tail=40):
        """The last lines of every daemon's log."""
        out = []
        log_dir = os.path.join(self.dir, "log")
        for name in sorted(os.listdir(log_dir)):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                lines = f.readlines()[-tail:]
            out.append(f"--- {name}\n{''.join(lines)}")
        return "\n".join(out)

    def leftovers(self, lost=()):
        """{machine: (processes, segments)}: what runs on each machine besides Slurm's own
        daemons (``DAEMONS``), and what is in its /dev/shm (not counted on the ``lost``
        machines, whose every process was killed at once: their janitor too)."""
        out = {}
        for i in range(self.n_nodes + 1):
            procs = [(p, c) for p, c in self.machines.processes(i)
                     if c and c.replace(":", " ").split()[0] not in DAEMONS]
            segs = [] if i in lost else self.machines.segments(i)
            if procs or segs:
                out[i] = (procs, segs)
        return out
