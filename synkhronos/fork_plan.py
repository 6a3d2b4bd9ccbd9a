"""What ``fork()`` will start: a pure plan from its arguments and what was found on the machine.

``plan()`` validates every argument and setting and decides the mode, the
number of ranks, the cores and GPUs, before anything is created: a bad value
leaves nothing behind, and the decision is checkable without processes.
"""

import errno
import math
import numbers
import os
import resource
from typing import NamedTuple, Optional

from .comm import backend_names
from .runtime.control import ERR_BYTES, MSG_BYTES, RANK_BASE, RANK_STRIDE
from .errors import SharedMemoryError, SynkStateError
from .runtime.shmem import shm_read_only_text
from .runtime.liveness import DEFAULT_TIMEOUT_S


class Machine(NamedTuple):
    """What ``fork()`` found before planning (process.probe).

    Attributes:
        cores: the usable cores (``os.sched_getaffinity``).
        n_gpus: NVIDIA GPUs visible (0 when ``use_gpu=False``).
        cuda_user: what already initialised CUDA in this process, or None.
        launch: this process's ``cluster.launchers.Launch`` under mpiexec, or None.
        cluster_finished: this process's cluster job already ended.
        env: the ``SYNK_*`` settings (``os.environ``).
        max_procs: ``(n, what)``: at most n more processes may start here, a limit set
            by ``what`` (``process_limit``); None if unknown.
        shm_free: bytes free in /dev/shm, or None if unknown.
        shm_read_only: /dev/shm is mounted read-only.
    """

    cores: tuple
    n_gpus: int = 0
    cuda_user: Optional[str] = None
    launch: Optional[tuple] = None
    cluster_finished: bool = False
    env: dict = {}
    max_procs: Optional[tuple] = None
    shm_free: Optional[int] = None
    shm_read_only: bool = False


class Plan(NamedTuple):
    """What ``fork()`` starts."""

    n_parallel: int          # ranks on this machine
    master_rank: int
    device: str              # "cpu" or "gpu"
    n_gpus: int
    cores: tuple             # this process's share of the host's cores
    spin_s: float
    timeout_s: float
    max_n_var: int
    max_dim: int
    profile_workers: bool
    launch: Optional[tuple]  # cluster: this process's Launch


def plan(machine, n_parallel=None, use_gpu=None, master_rank=0, profile_workers=False,
         max_n_var=1000, max_dim=16, timeout=None):
    """Return the ``Plan`` for ``fork(...)`` with these arguments on ``machine``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an argument or ``SYNK_*`` setting out of range.
        RuntimeError: ``use_gpu=True`` without a GPU.
        SynkStateError: GPU mode with CUDA already initialised; a cluster job forked twice.
    """
    if use_gpu not in (None, True, False):
        raise TypeError(f"fork: use_gpu must be None, True or False; got {use_gpu!r}")
    n_gpus = machine.n_gpus if use_gpu is not False else 0
    if use_gpu and n_gpus == 0:
        raise RuntimeError("fork: use_gpu=True but no NVIDIA GPU was found; "
                           "use use_gpu=False (or None) for CPU mode")
    gpu_mode = n_gpus > 0
    if gpu_mode and machine.cuda_user is not None:
        raise SynkStateError(
            f"fork: {machine.cuda_user} already initialised CUDA in this process, and a forked "
            "worker cannot use a GPU after that. Call synk.fork() first, before "
            "anything touches the GPU (jax.devices(), JAX arrays or functions, "
            "cupy, torch.cuda); importing those packages alone is fine. "
            "Or pass use_gpu=False for CPU mode.")
    cores = tuple(machine.cores)
    launch = machine.launch
    per_host = 1
    if launch is not None:
        if machine.cluster_finished:
            raise SynkStateError("fork: this cluster job was closed; under mpiexec a program "
                                 "forks once (MPI cannot start again)")
        if master_rank != 0:
            raise ValueError(f"fork: in a cluster the controller holds rank 0; master_rank "
                             f"must be 0, got {master_rank}")
        # Several MPI processes on one host divide its cores (and GPUs) among them.
        cores = tuple(share(cores, launch.local_index, launch.local_count))
        if gpu_mode:
            n_gpus = len(share(list(range(n_gpus)), launch.local_index, launch.local_count))
        per_host = launch.local_count
    if n_parallel is None:
        n_parallel = n_gpus if gpu_mode else len(cores)
    _check_int("n_parallel", n_parallel, 1)
    _check_capacity(machine, n_parallel)
    _check_int("master_rank", master_rank, 0)
    if master_rank >= n_parallel:
        raise ValueError(f"fork: master_rank must be in range(n_parallel={n_parallel}); "
                         f"got {master_rank}")
    _check_int("max_n_var", max_n_var, 1)
    _check_int("max_dim", max_dim, 1)
    problems = setting_problems(machine.env, cluster=launch is not None)
    if problems:
        raise ValueError(f"fork: {next(iter(problems.values()))}")
    if timeout is None:
        timeout = _env_seconds(machine.env, "SYNK_TIMEOUT_S", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) \
            or math.isnan(timeout) or timeout <= 0:
        raise ValueError(f"fork: timeout must be a number of seconds > 0 (or math.inf); "
                         f"got {timeout!r}")
    # Waiters spin only while every rank on the host has a core of its own.
    spin_default = 0.0 if n_parallel * per_host > len(machine.cores) else 0.01
    spin_s = _env_seconds(machine.env, "SYNK_SPIN_S", spin_default)
    return Plan(n_parallel, master_rank, "gpu" if gpu_mode else "cpu", n_gpus, cores, spin_s,
                float(timeout), max_n_var, max_dim, bool(profile_workers), launch)


def share(items, index, count):
    """The part of ``items`` (cores, GPUs) one of ``count`` MPI processes on a host uses."""
    n = len(items)
    if count <= 1:
        return list(items)
    if count >= n:
        return [items[index % n]]
    return list(items[index * n // count:(index + 1) * n // count])


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"fork: {name} must be an int; got {type(value).__name__}")
    if value < low:
        raise ValueError(f"fork: {name} must be >= {low}; got {value}")


def _check_capacity(machine, n_parallel):
    """Refuse more ranks than this machine can start, before anything is created."""
    # n_parallel - 1 workers and the janitor: n_parallel new processes.
    if machine.max_procs is not None and n_parallel > machine.max_procs[0]:
        limit, what = machine.max_procs
        raise ValueError(f"fork: n_parallel={n_parallel} is more ranks than this machine can "
                         f"start: at most {limit} more processes ({what})")
    if machine.shm_read_only:
        raise SharedMemoryError(errno.EROFS, shm_read_only_text("fork"))
    need = control_bytes(n_parallel)
    if machine.shm_free is not None and need > machine.shm_free:
        raise ValueError(f"fork: n_parallel={n_parallel} is more ranks than /dev/shm holds: "
                         f"their control block needs {need / 2**20:.0f} MiB "
                         f"({ERR_BYTES // 1024} KiB per rank), {machine.shm_free / 2**20:.0f} "
                         "MiB are free")


def control_bytes(n_ranks):
    """Bytes of shared memory the control block of ``n_ranks`` ranks takes (control.Control)."""
    return 8 * (RANK_BASE + RANK_STRIDE * n_ranks) + ERR_BYTES * n_ranks + MSG_BYTES


def process_limit():
    """Return ``(n, what)``: at most n more processes may start here, as ``what`` sets; or None.

    The smallest of the kernel's limits, the container's (cgroup ``pids.max``)
    and the user's (``ulimit -u``, not enforced for root).
    """
    found = []
    for path, what in (("/proc/sys/kernel/pid_max", "kernel.pid_max"),
                       ("/proc/sys/kernel/threads-max", "kernel.threads-max")):
        found.append((_read_int(path), what))
    pids_max = _read_int("/sys/fs/cgroup/pids.max")
    if pids_max is not None:
        current = _read_int("/sys/fs/cgroup/pids.current") or 0
        found.append((pids_max - current, f"the cgroup's pids.max of {pids_max}"))
    if os.geteuid() != 0:
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if soft != resource.RLIM_INFINITY:
            found.append((soft, f"ulimit -u of {soft}"))
    found = [f for f in found if f[0] is not None]
    return min(found) if found else None


def _read_int(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):  # absent, or "max"
        return None


# What each SYNK_* setting must be: name -> (problem with ``value`` or None, whether
# only a cluster reads it).
def _seconds(allow_zero):
    def problem(value):
        try:
            ok = float(value) >= 0 if allow_zero else float(value) > 0
        except ValueError:
            ok = False
        return None if ok else f"a number of seconds {'>= 0' if allow_zero else '> 0'}"
    return problem


def _backend(value):
    return None if value in backend_names() else f"one of {', '.join(backend_names())}"


SETTINGS = {
    "SYNK_SPIN_S": (_seconds(allow_zero=True), False),
    "SYNK_TIMEOUT_S": (_seconds(allow_zero=False), False),
    "SYNK_HEARTBEAT_S": (_seconds(allow_zero=False), True),
    "SYNK_BACKEND": (_backend, False),
    "SYNK_CLUSTER": (lambda v: None if v in ("0", "1") else "0 or 1", False),
    "SYNK_CONTROLLER_HOST": (lambda v: None, True),
    "SYNK_ON_MACHINE_LOSS": (lambda v: None if v in ("continue", "end") else "continue or end",
                             True),
    "SYNK_MACHINES": (lambda v: None if v.isdigit() and int(v) >= 1 else "a number >= 1", True),
    "SYNK_CHUNK_ROWS": (lambda v: None if v.strip().isdigit() else
                        "a number of rows >= 0 (0: no chunks)", False),
    "SYNK_CORE_TRADE": (_seconds(allow_zero=True), False),
}


def setting_problems(env, cluster=True):
    """Return ``{name: message}`` for the ``SYNK_*`` settings in ``env`` that are invalid.

    Empty values count as unset.  Settings only a cluster reads are checked
    when ``cluster`` is true; names synkhronos does not know are not checked.
    """
    out = {}
    for name, (problem, cluster_only) in SETTINGS.items():
        raw = env.get(name)
        if raw is None or raw == "" or (cluster_only and not cluster):
            continue
        want = problem(raw)
        if want is not None:
            out[name] = f"{name} must be {want}; got {raw!r}"
    return out


def _env_seconds(env, name, default):
    """A number of seconds from the setting ``name`` (checked by setting_problems), or ``default``."""
    raw = env.get(name)
    return default if raw is None or raw == "" else float(raw)


def environment():
    """The ``SYNK_*`` settings ``plan`` reads, from ``os.environ``."""
    return {k: v for k, v in os.environ.items() if k.startswith("SYNK_")}
