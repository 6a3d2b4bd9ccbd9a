"""Runtime: the one process-global state of synkhronos, and guards on it."""

import collections
import functools
import itertools
import threading
from dataclasses import dataclass, field

from .errors import SynkStateError


@dataclass
class Runtime:
    """Everything ``fork()`` sets up; ``close()`` drops it.

    Exists in the master and, as a copy made by fork, in every worker.
    """

    rank: int
    n_parallel: int
    master_rank: int
    master_pid: int
    prefix: str = "/synk_"          # every segment name of the run starts so (shmem.run_prefix)
    device: str = "cpu"
    max_n_var: int = 1000
    max_dim: int = 16
    control: object = None          # control.Control
    backend: object = None          # comm.base.Backend
    procs: dict = field(default_factory=dict)   # rank -> Process (master only)
    janitor: object = None
    datas: dict = field(default_factory=dict)   # data id -> Data (master: weakly) / SharedArray
    functions: list = field(default_factory=list)
    shareds: list = field(default_factory=list)  # shared vars known to distribute()
    shared_ids: dict = field(default_factory=dict)  # id(var) -> index in shareds
    distributed: bool = False
    closed: bool = False
    counter: object = field(default_factory=itertools.count)
    restore: list = field(default_factory=list)  # callables undoing fork() in master
    check: object = None            # raises if another rank died or stalled (liveness)
    monitor: object = None          # master: liveness.Monitor, which is also its check
    abandon: object = None          # process.abandon: stop everything after a fatal failure
    n_gpus: int = 0
    gpu_ids: list = field(default_factory=list)  # CUDA device ids, indexed round robin by rank
    cores: list = field(default_factory=list)    # usable cores, indexed by rank when pinning
    janitor_fd: int = -1            # master: write end of the pipe the janitor watches
    profile_workers: bool = False   # workers record a cProfile until QUIT
    profiler: object = None         # profiling.Profiler while synk.profile() records
    lock_fd: int = -1               # the run's lock (shmem.hold_run_lock), held by every process
    freed: collections.deque = field(default_factory=collections.deque)  # dropped Data ids
    wire: dict = field(default_factory=dict)  # master: repeated calls' messages, pickled (post)
    cleanup_dirs: list = field(default_factory=list)  # removed by the janitor after a crash
    device_shareds: set = field(default_factory=set)  # ids of shared vars whose values live on the device
    jax_before_fork: bool = False   # JAX ran in the master before fork(): workers cannot
    in_call: bool = False           # running a call's graph: in-graph collectives combine ranks
    # This machine's part of the run.  On one machine: every rank, and the
    # leader (the process that posts commands here) is the master.  In a
    # cluster (cluster.py): machine ``node`` holds global ranks
    # ``rank_offset .. rank_offset + n_local - 1``; its leader is local index 0.
    local_index: int = -1           # this process's index among the machine's ranks
    n_local: int = 0
    leader: int = -1                # local index of the machine's leader
    rank_offset: int = 0
    cluster: object = None          # cluster.Cluster: the MPI side (controller and node masters)

    def __post_init__(self):
        if self.n_local == 0:
            self.n_local = self.n_parallel
        if self.local_index < 0:
            self.local_index = self.rank
        if self.leader < 0:
            self.leader = self.master_rank

    @property
    def is_master(self):
        return self.rank == self.master_rank

    @property
    def worker_ranks(self):
        """Local indices of this machine's workers (every rank but the leader's)."""
        return [r for r in range(self.n_local) if r != self.leader]

    def segment_name(self, tag):
        """Return a fresh segment name: the run's prefix, rank, counter, tag."""
        return f"{self.prefix}{self.rank}_{next(self.counter)}{tag}"


_state = {"runtime": None}
# One lock serialises the public entry points: a call from a second thread
# waits for the first to finish instead of interleaving commands.
_LOCK = threading.RLock()


def serialized(fn):
    """Decorate a public entry point: one thread at a time in the whole library."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _LOCK:
            return fn(*args, **kwargs)
    return wrapper


def get_runtime():
    """Return the current Runtime, or None before fork() and after close()."""
    return _state["runtime"]


def set_runtime(rt):
    _state["runtime"] = rt


def require_forked(what):
    """Return the Runtime; raise SynkStateError naming ``what`` if not forked."""
    rt = _state["runtime"]
    if rt is None or rt.closed:
        raise SynkStateError(f"{what} needs fork() first")
    return rt


def require_distributed(what):
    """Return the Runtime; raise SynkStateError unless distribute() has run."""
    rt = require_forked(what)
    if not rt.distributed:
        raise SynkStateError(f"{what} needs distribute() first")
    return rt
