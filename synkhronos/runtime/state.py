"""Runtime: the one process-global state of synkhronos, in typed parts, and guards on it."""

import collections
import contextlib
import functools
import itertools
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, MutableMapping, Optional

from ..errors import SynkStateError
from .peers import ALONE, Peers


@dataclass(frozen=True)
class Config:
    """What ``fork()`` decided for the run; the same in every process, never changed.

    Attributes:
        master_pid: the pid of the process that called ``fork()`` on this machine.
        prefix: every shared-memory segment name of the run starts so (shmem.run_prefix).
        device: "cpu" or "gpu".
        max_n_var: most variables in one call or collective.
        max_dim: most dimensions of a variable.
        n_gpus: GPUs this machine's ranks use (0 in CPU mode).
        gpu_ids: CUDA device ids, indexed round robin by rank.
        cores: usable cores, indexed by local rank when pinning.
        profile_workers: workers record a cProfile until the end.
        spin_s: how long waits spin before sleeping.
        timeout_s: the longest one command may run.
    """

    master_pid: int
    prefix: str = "/synk_"
    device: str = "cpu"
    max_n_var: int = 1000
    max_dim: int = 16
    n_gpus: int = 0
    gpu_ids: tuple = ()
    cores: tuple = ()
    profile_workers: bool = False
    spin_s: float = 0.0
    timeout_s: float = 1800.0


@dataclass(slots=True)
class Placement:
    """Where this process stands among the ranks.

    On one machine every rank is local and the leader (the process that posts
    commands here) is the master.  In a cluster machine ``m`` holds global
    ranks ``rank_offset .. rank_offset + n_local - 1``, its leader is local
    index 0, and the global numbers are known only after LAYOUT.
    """

    rank: int
    n_parallel: int
    master_rank: int
    local_index: int
    n_local: int
    leader: int
    rank_offset: int = 0


@dataclass(slots=True)
class Registry:
    """What the run knows by id: functions, shared variables and Data."""

    datas: MutableMapping[int, Any] = field(default_factory=dict)  # id -> Data (master, weakly) / SharedArray
    functions: list = field(default_factory=list)
    shareds: list = field(default_factory=list)          # shared variables known to distribute()
    shared_ids: dict = field(default_factory=dict)       # id(var) -> index in shareds
    device_shareds: set = field(default_factory=set)     # ids of shared vars whose values live on a device
    distributed: bool = False
    freed: collections.deque = field(default_factory=collections.deque)  # dropped Data ids, for the ranks
    wire: dict = field(default_factory=dict)             # master: repeated commands' kept messages
    # Bumped whenever this process's Data memory, functions or place among the ranks
    # change: what was prepared for a kept message (views of Data and of this rank's rows,
    # a function) is valid for one epoch only.
    epoch: int = 0

    def unmap(self, ids):
        """Close this process's mappings of Data objects the master dropped."""
        self.epoch += 1
        for data_id in ids:
            seg = self.datas.pop(data_id, None)
            if seg is not None:
                seg.close()


@dataclass(slots=True)
class Processes:
    """The leader's: its workers, janitor and what ``close()`` must undo (empty in a worker)."""

    procs: dict = field(default_factory=dict)       # local index -> multiprocessing.Process
    janitor: Optional[Any] = None                   # janitor.Janitor
    monitor: Optional[Callable] = None              # liveness.Monitor, also the leader's check
    restore: list = field(default_factory=list)     # callables undoing fork() in this process
    unpinned: Optional[frozenset] = None            # this process's cores before fork() pinned it
    core_trade: Optional[Any] = None                # cores.CoreTrade (one machine, ranks pinned)
    cleanup_dirs: list = field(default_factory=list)  # removed by the janitor after a crash
    lock_fd: int = -1                               # the run's lock (shmem.hold_run_lock)

    def check_janitor(self):
        """Start the janitor again if it ended (``Janitor.check``); nothing where there is none."""
        if self.janitor is not None:
            self.janitor.check()


class MachineRanks:
    """This machine's ranks, as a backend that moves bytes inside one machine sees them.

    ``rank`` is the local index, ``n_parallel`` the machine's ranks, ``master_rank``
    its leader; read live from the run's ``Placement``.
    """

    __slots__ = ("place",)

    def __init__(self, place):
        self.place = place

    @property
    def rank(self):
        return self.place.local_index

    @property
    def n_parallel(self):
        return self.place.n_local

    @property
    def master_rank(self):
        return self.place.leader


@dataclass(slots=True)
class Runtime:
    """Everything ``fork()`` sets up; ``close()`` drops it.

    Exists in the master and, as a copy made by fork, in every worker.
    """

    config: Config
    place: Placement
    registry: Registry = field(default_factory=Registry)
    processes: Processes = field(default_factory=Processes)
    control: Optional[Any] = None       # control.Control
    backend: Optional[Any] = None       # comm.base.Backend
    check: Optional[Callable] = None    # raises if another rank died or stalled (liveness)
    abandon: Optional[Callable] = None  # process.abandon: stop everything after a fatal failure
    # process.respawn: distribute() starts the workers again from the master, or says it cannot
    respawn: Callable = lambda rt, install: False
    peers: Peers = ALONE                # the other machines (cluster: the controller, a node master)
    profiler: Optional[Any] = None      # profiling.Profiler while synk.profile() records
    counter: Any = field(default_factory=itertools.count)
    closed: bool = False
    in_call: bool = False               # running a call's graph: in-graph collectives combine ranks
    jax_before_fork: bool = False       # JAX ran in the master before fork(): workers cannot
    chunk_boards: dict = field(default_factory=dict)  # a worker's chunk boards (functions/chunks.py)

    @property
    def is_master(self):
        place = self.place
        return place.rank == place.master_rank

    @property
    def worker_ranks(self):
        """Local indices of this machine's workers (every rank but the leader's)."""
        leader = self.place.leader
        return [r for r in range(self.place.n_local) if r != leader]

    @contextlib.contextmanager
    def calling(self, flag=True):
        """Mark the runtime as inside a call's graph (``in_call``) for the ``with`` block.

        A collective or a call made from inside one of the graph's Ops then raises
        at once. The per-call hot paths set the flag by hand: a generator-based
        context manager costs about a microsecond there.
        """
        self.in_call = flag
        try:
            yield
        finally:
            self.in_call = False

    def segment_name(self, tag):
        """Return a fresh segment name: the run's prefix, rank, counter, tag.

        In the leader, first sees that its janitor still lives to clean the segment up.
        """
        self.processes.check_janitor()
        return f"{self.config.prefix}{self.place.rank}_{next(self.counter)}{tag}"


_state = {"runtime": None}
# One lock serialises the public entry points: a call from a second thread
# waits for the first to finish instead of interleaving commands.
_LOCK = threading.RLock()


def serialized(fn):
    """Decorate a public entry point: one thread at a time, and only in the master's process."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # Before the lock: a child forked while another thread held it would wait forever.
        rt = _state["runtime"]
        if rt is not None and _PID[0] != rt.config.master_pid:
            _require_master_process(fn.__qualname__)
        with _LOCK:
            depth = _DEPTH[0] = _DEPTH[0] + 1
            try:
                if depth == 1:
                    # The peers' turn between commands (a machine joins).
                    rt = _state["runtime"]
                    if rt is not None and rt.peers is not ALONE and not rt.closed and rt.is_master:
                        rt.peers.between(fn.__name__)
                return fn(*args, **kwargs)
            finally:
                _DEPTH[0] -= 1
    return wrapper


@contextlib.contextmanager
def holding_calls(timeout_s=0.0):
    """Hold the public-call lock for the block; yield whether it is held.

    ``timeout_s`` 0: only if no public call is under way (a background thread,
    the elastic door, serves the run's sockets only between calls); else wait
    up to ``timeout_s`` for it (at exit), and run the block all the same.
    """
    got = _LOCK.acquire(timeout=timeout_s) if timeout_s > 0 else _LOCK.acquire(blocking=False)
    try:
        yield got
    finally:
        if got:
            _LOCK.release()


_DEPTH = [0]  # public calls under way in the thread that holds _LOCK
# This process's pid: os.getpid() is a system call, and every public call asks.
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))
# For a repeated call's own check (functions/kept.py, KeptCall.ready): what ``serialized``
# holds and asks, without its argument packing, on one machine (no peers' turn to give).
CALL_LOCK = _LOCK
PID = _PID


def _require_master_process(what):
    """Raise SynkStateError in a process other than the one that forked the live run.

    A child of the master (``os.fork()``, a fork-started multiprocessing
    worker) inherits the Runtime, and its commands would reach the workers
    amid the master's.
    """
    rt = _state["runtime"]
    if rt is None or rt.closed or _PID[0] == rt.config.master_pid:
        return
    if not rt.is_master:
        raise SynkStateError(
            f"{what}(): called in rank {rt.place.rank}, a worker{' inside a call' if rt.in_call else ''}"
            "; synkhronos functions and collectives run from the master's program only, "
            "between calls (inside a graph use synkhronos.ingraph)")
    raise SynkStateError(
        f"{what}(): this process (pid {os.getpid()}) is not the synkhronos master "
        f"(pid {rt.config.master_pid}); only the process that called fork() drives "
        "the ranks, not a child of it (os.fork(), multiprocessing)")


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
    if not rt.registry.distributed:
        raise SynkStateError(f"{what} needs distribute() first")
    return rt
