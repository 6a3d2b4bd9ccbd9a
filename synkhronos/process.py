"""fork() and close(): the worker processes, core pinning, thread limits, liveness, cleanup."""

import atexit
import ctypes
import logging
import math
import multiprocessing
import numbers
import os
import shutil
import signal
import time
import warnings
import weakref

from . import cluster as clusters
from . import gpu, node, shmem, worker
from .comm import choose_backend, get_backend
from .control import Command, Control, default_spin_s, run_command
from .errors import SynkStateError
from .liveness import Monitor, command_check, default_timeout_s, proc_start_time, worker_check
from .runtime import Runtime, get_runtime, serialized, set_runtime

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
JOIN_TIMEOUT_S = 5.0


@serialized
def fork(n_parallel=None, use_gpu=None, master_rank=0, profile_workers=False,
         max_n_var=1000, max_dim=16, timeout=None):
    """Start one worker process per additional rank; the caller becomes the master.

    Call before building any PyTensor function that synkhronos should run, and,
    in GPU mode, before anything initialises CUDA or JAX in this process.  In
    CPU mode (no GPU, or ``use_gpu=False``) there is one rank per usable core by
    default; each process is limited to one BLAS thread and, when there are
    enough cores, pinned to its own core.  In GPU mode there is one rank per
    GPU; each rank sees only its own GPU and functions compile with PyTensor's
    JAX backend.  The master is a rank and computes too.

    Under ``mpiexec -n N`` (several MPI processes, ``pip install
    "synkhronos[mpi]"``) the run spans N machines: every process forks its own
    ranks, then MPI starts; MPI rank 0 is the controller, where ``fork()``
    returns and the program goes on, and every other process serves as its
    machine's node master until the controller closes, never returning from
    ``fork()``.  Ranks are numbered machine by machine (``layout()``); see
    docs/clusters.md.

    Args:
        n_parallel: number of ranks (default: every usable core, or every
            GPU); in a cluster, ranks per machine (several MPI processes on
            one host divide its cores).  Any value >= 1 is accepted: in CPU mode more ranks than
            cores, in GPU mode ranks share GPUs round robin (then NCCL is not
            used, since it needs one GPU per rank).
        use_gpu: None picks GPU mode when NVIDIA GPUs are present, False forces
            CPU mode, True requires GPUs.
        master_rank: the rank of the calling process.
        profile_workers: record a cProfile of each worker, written to
            ``synk_worker_<rank>.prof`` in the working directory at close().
        max_n_var: most variables in one function call or collective.
        max_dim: most dimensions of any variable passed through synkhronos.
        timeout: seconds one command (a call, a collective) may run before
            the ranks still busy are reported and every worker is stopped
            (``WorkerStalledError``); None takes ``SYNK_TIMEOUT_S`` or 1800,
            ``math.inf`` waits forever.  A stopped worker process (SIGSTOP)
            is reported within a second whatever the timeout.

    Returns:
        The number of ranks (in a cluster, of every machine).

    Raises:
        SynkStateError: already forked (a ``RuntimeError``).
        TypeError: an argument of the wrong type.
        ValueError: ``n_parallel`` < 1, or ``master_rank`` not in
            ``range(n_parallel)`` (in a cluster, not 0).
        RuntimeError: ``use_gpu=True`` without a GPU.
        SynkStateError: GPU mode, but CUDA or JAX is already initialised in
            this process (a forked worker could not use its GPU).
    """
    rt = get_runtime()
    if rt is not None and not rt.closed:
        raise SynkStateError("fork() was already called; call close() before forking again")
    if use_gpu not in (None, True, False):
        raise TypeError(f"fork: use_gpu must be None, True or False; got {use_gpu!r}")
    n_gpus = gpu.count_gpus() if use_gpu is not False else 0
    if use_gpu and n_gpus == 0:
        raise RuntimeError("fork: use_gpu=True but no NVIDIA GPU was found; "
                           "use use_gpu=False (or None) for CPU mode")
    gpu_mode = n_gpus > 0
    if gpu_mode:
        used = gpu.cuda_in_use()
        if used is not None:
            raise SynkStateError(
                f"fork: {used} already initialised CUDA in this process, and a forked "
                "worker cannot use a GPU after that. Call synk.fork() first, before "
                "anything touches the GPU (jax.devices(), JAX arrays or functions, "
                "cupy, torch.cuda); importing those packages alone is fine. "
                "Or pass use_gpu=False for CPU mode.")
    cores = sorted(os.sched_getaffinity(0))
    host_cores = len(cores)
    mpi_info = clusters.launched()
    if mpi_info is not None and clusters.finished():
        raise SynkStateError("fork: this cluster job was closed; under mpiexec a program "
                             "forks once (MPI cannot start again)")
    if mpi_info is not None:
        # Several MPI processes on one host divide its cores (and GPUs) among them.
        if master_rank != 0:
            raise ValueError(f"fork: in a cluster the controller holds rank 0; master_rank "
                             f"must be 0, got {master_rank}")
        cores = clusters.share_cores(cores, mpi_info[2], mpi_info[3])
        if gpu_mode:
            n_gpus = len(clusters.share_cores(list(range(n_gpus)), mpi_info[2], mpi_info[3]))
    if n_parallel is None:
        n_parallel = n_gpus if gpu_mode else len(cores)
    _check_int("n_parallel", n_parallel, 1)
    _check_int("master_rank", master_rank, 0)
    if master_rank >= n_parallel:
        raise ValueError(f"fork: master_rank must be in range(n_parallel={n_parallel}); "
                         f"got {master_rank}")
    _check_int("max_n_var", max_n_var, 1)
    _check_int("max_dim", max_dim, 1)
    if timeout is None:
        timeout = default_timeout_s()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) \
            or math.isnan(timeout) or timeout <= 0:
        raise ValueError(f"fork: timeout must be a number of seconds > 0 (or math.inf); "
                         f"got {timeout!r}")

    shmem.sweep_stale()
    ctx = multiprocessing.get_context("fork")
    prefix = shmem.run_prefix(os.getpid())
    lock_fd = shmem.hold_run_lock(prefix)
    rt = Runtime(rank=master_rank, n_parallel=n_parallel, master_rank=master_rank,
                 master_pid=os.getpid(), prefix=prefix, lock_fd=lock_fd,
                 datas=weakref.WeakValueDictionary(), max_n_var=max_n_var, max_dim=max_dim,
                 device="gpu" if gpu_mode else "cpu", n_gpus=n_gpus,
                 gpu_ids=gpu.visible_ids(n_gpus), cores=cores,
                 profile_workers=bool(profile_workers), abandon=abandon)
    if not gpu_mode and n_parallel > 1 and gpu.jax_initialised():
        # The workers inherit JAX's backend without its threads: their first
        # JAX call would hang.  function() refuses JAX-mode functions then.
        rt.jax_before_fork = True
        logger.warning("JAX already ran in this process before fork(); workers cannot run "
                       "JAX-mode functions (call fork() before any JAX computation)")
    on_host = n_parallel * (1 if mpi_info is None else mpi_info[3])
    spin_s = default_spin_s(on_host, host_cores)
    try:
        rt.control = Control(rt, ctx, spin_s)
        rt.backend = get_backend(choose_backend(rt.device, n_parallel, n_gpus,
                                                mpi_info is not None))(rt, spin_s)
    except BaseException:
        if rt.control is not None:
            rt.control.close()
        shmem.sweep(prefix)
        os.close(lock_fd)
        raise
    set_runtime(rt)

    if gpu_mode:
        # The environment is inherited; each worker narrows it to its own GPU.
        _select_gpu(rt, master_rank)
    else:
        # Limit thread pools before forking: the children inherit the limits, and
        # changing OpenBLAS's pool after a fork leaves it slowing every round trip.
        _limit_threads(rt)
        # CPU mode on a machine with GPUs: mode="JAX" must not put every rank on GPU 0.
        rt.restore.append(gpu.keep_jax_on_cpu())
    # Children must not keep the janitor's pipe open, or it never sees EOF.
    read_fd, write_fd = os.pipe()
    for rank in rt.worker_ranks:
        p = ctx.Process(target=_worker_main, args=(rt, rank, read_fd, write_fd),
                        name=f"synk-rank-{rank}", daemon=True)
        p.start()
        rt.procs[rank] = p
    rt.monitor = rt.check = Monitor(rt.procs, float(timeout), rt.control.pending)
    rt.backend.bind_check(command_check(rt.check, rt.control.aborted_now))
    # With each start time: a pid the kernel gave to another process since is left alone.
    pids = [(p.pid, proc_start_time(p.pid)) for p in rt.procs.values()]
    # A bare fork, not a multiprocessing child: multiprocessing's exit hook
    # would wait for it, and it must outlive the master.
    janitor = os.fork()
    if janitor == 0:
        try:
            _janitor_main(rt.prefix, rt.cleanup_dirs, pids, read_fd, write_fd)
        finally:
            os._exit(0)
    rt.janitor = janitor
    os.close(read_fd)
    rt.janitor_fd = write_fd
    if mpi_info is not None:
        return _join_cluster(rt, mpi_info, spin_s)
    # Registered after multiprocessing's own exit hook, so it runs first,
    # while the workers are still there to be told to quit.
    atexit.unregister(_close_at_exit)
    atexit.register(_close_at_exit)
    if not gpu_mode:
        _pin(rt, master_rank, restore=True)
    logger.info("forked %d workers (%s mode, master rank %d, %d ranks on %d %s)",
                n_parallel - 1, rt.device, master_rank, n_parallel,
                n_gpus if gpu_mode else len(cores), "GPUs" if gpu_mode else "cores")
    return n_parallel


def _join_cluster(rt, mpi_info, spin_s):
    """Start MPI after the local fork; the controller returns the run's size, node masters serve."""
    sentinel, sentinel_fd = None, None
    if mpi_info[0] != 0:
        sentinel, sentinel_fd = clusters.start_sentinel(close_fds=[rt.janitor_fd])
    atexit.unregister(_close_at_exit)
    atexit.register(_close_at_exit)
    try:
        mpi = clusters.init_mpi()
        made = clusters.mpi_segments()
        if made:
            os.write(rt.janitor_fd, ("\n".join(made) + "\n").encode())
        cl = clusters.connect(rt, mpi, sentinel_fd, spin_s)
    except BaseException:
        abandon(rt, "the cluster could not be set up")
        raise
    layout = cl.layout
    offset = layout.offsets[cl.node]
    run_command(rt, Command.LAYOUT, clusters.LayoutMsg(offset, layout.n_parallel),
                local=lambda seq: clusters.set_layout(rt, offset, layout.n_parallel))
    cl.control = rt.control
    cl.sentinel = sentinel
    rt.cluster = cl
    if not cl.is_controller:
        rt.datas = {}  # segments mapped here, as in a worker (Data objects live in the controller)
    rt.backend.attach(cl)
    rt.monitor.offset = offset
    if cl.is_controller:
        rt.monitor.remote = cl.late_ranks
    monitor = rt.monitor
    poll = cl.poll if cl.is_controller else cl.node_check

    def check():
        monitor()
        poll()
    rt.check = check
    rt.backend.bind_check(command_check(check, rt.control.aborted_now))
    if rt.device != "gpu":
        _pin(rt, rt.local_index, restore=True)
    if not cl.is_controller:
        node.serve(rt, join_workers)  # never returns
    logger.info("cluster of %d machines, %d ranks (%s per machine)", layout.n_machines,
                layout.n_parallel, ", ".join(str(n) for n in layout.n_local))
    return layout.n_parallel


def _select_gpu(rt, rank):
    per_gpu = -(-rt.n_parallel // rt.n_gpus)
    if rt.is_master:
        _save_env(rt, ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_MEM_FRACTION"))
    gpu.select_device(rt.gpu_ids[gpu.device_for_rank(rank, rt.n_gpus)], per_gpu)


def _save_env(rt, names):
    """Have close() put these environment variables back as they are now."""
    saved = {k: os.environ.get(k) for k in names}

    def restore():
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    rt.restore.append(restore)


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"fork: {name} must be an int; got {type(value).__name__}")
    if value < low:
        raise ValueError(f"fork: {name} must be >= {low}; got {value}")


THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
              "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def _limit_threads(rt):
    """Limit BLAS/OpenMP pools to one thread per process (undone by close()).

    threadpoolctl limits the pools already loaded; the environment covers
    those loaded later (PyTensor's compiled code pulls in SciPy's OpenBLAS on
    first use), which would otherwise start a thread per core and fight the
    other ranks for them.
    """
    from threadpoolctl import threadpool_limits

    _save_env(rt, THREAD_ENV)
    for k in THREAD_ENV:
        os.environ[k] = "1"
    limiter = threadpool_limits(limits=1)
    rt.restore.append(limiter.restore_original_limits)


def _pin(rt, rank, restore=False):
    """Pin this process to its own core when this machine has enough cores."""
    if rt.n_local <= len(rt.cores):
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {rt.cores[rank]})
        if restore:
            rt.restore.append(lambda: os.sched_setaffinity(0, before))


def _set_pdeathsig():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux; the janitor still kills us
        pass


def _worker_main(rt, rank, read_fd, write_fd):
    os.close(read_fd)
    os.close(write_fd)
    clusters.close_launcher_fds()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the master's to handle
    _set_pdeathsig()
    if os.getppid() != rt.master_pid:
        os._exit(1)
    rt.local_index = rank
    rt.rank = rt.rank_offset + rank
    rt.procs = {}
    rt.restore = []
    rt.datas = {}  # this rank's mappings, by Data id
    if rt.device == "gpu":
        _select_gpu(rt, rank)
    else:
        _pin(rt, rank)
    rt.check = worker_check(rt.master_pid)
    rt.backend.bind_check(command_check(rt.check, rt.control.aborted_now))
    worker.loop(rt)


def _janitor_main(prefix, dirs, pids, read_fd, write_fd):
    """Wait for the master to go; then kill its workers, unlink its segments, remove its dirs."""
    os.close(write_fd)
    clusters.close_launcher_fds()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Its own session: mpiexec (and shells) kill a failed job's process groups,
    # and the janitor must outlive them to clean up.
    os.setsid()
    # The master may name more files to remove, one path per line (the
    # segments MPI made, which a killed MPI process leaves behind).
    told = b""
    try:
        while True:
            got = os.read(read_fd, 4096)
            if not got:
                break
            told += got
    except OSError:
        pass
    for pid, started in pids:
        if proc_start_time(pid) != started:
            continue  # gone already, and the pid maybe reused
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shmem.sweep(prefix)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    for path in told.decode(errors="replace").splitlines():
        if path.startswith(shmem.SHM_DIR + "/"):
            try:
                os.unlink(path)
            except OSError:
                pass
    os._exit(0)


@serialized
def close():
    """Stop and join the workers and free all shared memory.  Runs at exit too.

    Data objects and shared variables stay readable in the master, but can no
    longer be used with synkhronos functions or collectives.
    """
    rt = get_runtime()
    if rt is None or rt.closed:
        warnings.warn("synkhronos.close(): not forked (or already closed)", stacklevel=2)
        return
    _close(rt)


def _close(rt):
    try:
        run_command(rt, Command.QUIT, None)
    except Exception as exc:  # noqa: BLE001 - the workers are stopped below whatever happened
        logger.warning("workers did not quit cleanly: %s", exc)
    join_workers(rt)


def join_workers(rt):
    """After QUIT: join the workers (killing those that linger) and free everything."""
    for p in rt.procs.values():
        p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()
    _teardown(rt)
    logger.info("closed %d workers", len(rt.procs))


def abandon(rt, reason):
    """Kill every worker and free everything after a failure the runtime can't survive."""
    logger.error("stopping all workers: %s", reason)
    if rt.cluster is not None and rt.cluster.is_controller:
        rt.cluster.end()  # every node master stops too (or its sentinel kills it)
    for p in rt.procs.values():
        if p.is_alive():
            p.kill()
    for p in rt.procs.values():
        p.join(JOIN_TIMEOUT_S)
    _teardown(rt)


def _teardown(rt):
    if rt.closed:
        return  # abandoned already, while close() asked the workers to quit
    rt.closed = True  # once, even if a step below fails
    for data in list(rt.datas.values()):
        # The master's are Data objects; a node master's, segments it mapped.
        release = getattr(data, "_release", None)
        (data.close if release is None else release)()
    rt.datas.clear()
    rt.backend.close()
    rt.control.close()
    shmem.sweep(rt.prefix)
    os.close(rt.lock_fd)
    if rt.janitor is not None:
        os.close(rt.janitor_fd)
        _reap(rt.janitor, JOIN_TIMEOUT_S)
        rt.janitor = None
    for undo in reversed(rt.restore):
        try:
            undo()
        except Exception:  # noqa: BLE001 - restoring limits is best effort
            pass
    for f in rt.functions:
        f._detach()
    set_runtime(None)
    if rt.cluster is not None and rt.cluster.is_controller and not rt.cluster.broken:
        # After this mpiexec lets the node masters end; MPI cannot start again here.
        clusters.finalize(rt.cluster.MPI)


def _reap(pid, timeout):
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def _close_at_exit():
    rt = get_runtime()
    if rt is not None and not rt.closed and rt.is_master and os.getpid() == rt.master_pid:
        _close(rt)
