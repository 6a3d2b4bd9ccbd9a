"""fork() and close(): the worker processes, core pinning, thread limits, liveness, cleanup."""

import atexit
import gc
import logging
import multiprocessing
import os
import signal
import threading
import warnings
import weakref

# The commands the ranks serve: importing their modules registers the handlers
# (runtime/commands.py), before the workers fork and inherit the table.  Also registering:
# control (GROW_MESSAGE), cluster.layout (LAYOUT, through cluster.rendezvous), this module (QUIT).
from .functions import aside, distribute, overlap, rank_call  # noqa: F401
from .variables import checkpoint, collectives, rank_values, reductions  # noqa: F401
from .inputs import mappings  # noqa: F401
from .runtime import profiling  # noqa: F401
from .runtime import devices, process_setup, shmem, trace, worker
from .cluster import launch as mpi_launch, launchers
from .cluster.rendezvous import join_cluster
from .runtime.commands import Command, handler
from .comm import choose_backend, get_backend
from .comm.base import Wiring
from .runtime.control import Control
from .runtime.peers import ALONE
from .runtime.run import run_command
from .errors import SynkStateError
from .runtime.janitor import Janitor
from .runtime.liveness import Monitor, command_check, stop_process, worker_check
from .fork_plan import Machine, environment, plan, process_limit
from .runtime.state import (Config, MachineRanks, Placement, Processes, Registry, Runtime,
                            get_runtime, holding_calls, serialized, set_runtime)

logger = logging.getLogger(__name__)

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

    Under ``mpiexec -n N`` (several MPI processes; in a clone of the
    repository, ``pip install -e ".[mpi]"``) the run spans N machines: every process forks its own
    ranks, then MPI starts; MPI rank 0 is the controller, where ``fork()``
    returns and the program goes on, and every other process serves as its
    machine's node master until the controller closes, never returning from
    ``fork()``.  Ranks are numbered machine by machine (``layout()``); see
    the Clusters page of the documentation (docs/clusters.md).

    Args:
        n_parallel: number of ranks (default: every usable core, or every
            GPU); in a cluster, ranks per machine (several MPI processes on
            one host divide its cores).  Any value >= 1 the machine can start
            is accepted: in CPU mode more ranks than cores, in GPU mode ranks
            share GPUs round robin (then NCCL is not used, since it needs one
            GPU per rank).
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
        ValueError: ``n_parallel`` < 1 or more than the machine can start,
            ``master_rank`` not in ``range(n_parallel)`` (in a cluster, not
            0), or an invalid ``SYNK_*`` setting.
        RuntimeError: ``use_gpu=True`` without a GPU.
        SynkStateError: GPU mode, but CUDA or JAX is already initialised in
            this process (a forked worker could not use its GPU).
    """
    rt = get_runtime()
    if rt is not None and not rt.closed:
        raise SynkStateError("fork() was already called; call close() before forking again")
    p = plan(probe(use_gpu), n_parallel, use_gpu, master_rank, profile_workers, max_n_var,
             max_dim, timeout)
    return start(p)


def probe(use_gpu):
    """What ``fork()`` needs to know about this machine and process (``plan.Machine``)."""
    n_gpus = devices.count_gpus() if use_gpu is not False else 0
    launch = launchers.launched()
    return Machine(cores=tuple(sorted(os.sched_getaffinity(0))), n_gpus=n_gpus,
                   cuda_user=devices.cuda_in_use() if n_gpus else None, launch=launch,
                   cluster_finished=launch is not None and mpi_launch.finished(),
                   env=environment(), max_procs=process_limit(), shm_free=shmem.shm_space()[0],
                   shm_read_only=shmem.read_only())


def start(p):
    """Start what the ``plan.Plan`` ``p`` says; return the run's number of ranks."""
    shmem.sweep_stale()
    prefix = shmem.run_prefix(os.getpid())
    lock_fd = shmem.hold_run_lock(prefix)
    config = Config(master_pid=os.getpid(), prefix=prefix, device=p.device,
                    max_n_var=p.max_n_var, max_dim=p.max_dim, n_gpus=p.n_gpus,
                    gpu_ids=tuple(devices.visible_ids(p.n_gpus)), cores=p.cores,
                    profile_workers=p.profile_workers, spin_s=p.spin_s, timeout_s=p.timeout_s)
    place = Placement(rank=p.master_rank, n_parallel=p.n_parallel, master_rank=p.master_rank,
                      local_index=p.master_rank, n_local=p.n_parallel, leader=p.master_rank)
    rt = Runtime(config, place, Registry(datas=weakref.WeakValueDictionary()),
                 Processes(lock_fd=lock_fd), abandon=abandon, respawn=respawn)
    gpu_mode = p.device == "gpu"
    if not gpu_mode and p.n_parallel > 1 and devices.jax_initialised():
        # The workers inherit JAX's backend without its threads: their first
        # JAX call would hang.  function() refuses JAX-mode functions then.
        rt.jax_before_fork = True
        logger.warning("JAX already ran in this process before fork(); workers cannot run "
                       "JAX-mode functions (call fork() before any JAX computation)")
    try:
        rt.control = Control(rt, p.spin_s)
        rt.backend = get_backend(choose_backend(p.device, p.n_parallel, p.n_gpus,
                                                p.launch is not None))(_wiring(rt))
    except BaseException:
        if rt.control is not None:
            rt.control.close()
        shmem.sweep(prefix)
        os.close(lock_fd)
        raise
    set_runtime(rt)
    if trace.ON:
        trace.set_rank(place.local_index)

    if gpu_mode:
        # The environment is inherited; each worker narrows it to its own GPU.
        process_setup.select_gpu(rt, p.master_rank)
    else:
        # Limit thread pools before forking: the children inherit the limits, and
        # changing OpenBLAS's pool after a fork leaves it slowing every round trip.
        process_setup.limit_threads(rt)
        # CPU mode on a machine with GPUs: mode="JAX" must not put every rank on GPU 0.
        rt.processes.restore.append(devices.keep_jax_on_cpu())
    try:
        _start_workers(rt)
        rt.processes.monitor = Monitor(rt.processes.procs, p.timeout_s, rt.control.pending, rt.place,
                                       lambda: rt.peers.late_ranks(), also=rt.processes.check_janitor)
        rt.check = _leader_check(rt)
        rt.backend.bind_check(command_check(rt.check, rt.control.aborted_now))
        rt.processes.janitor = Janitor(prefix, rt.processes.cleanup_dirs,
                                       [proc.pid for proc in rt.processes.procs.values()],
                                       keep_fds=(lock_fd,))
        if p.launch is None:
            rt.processes.janitor.close_in_children(lock_fd)
    except BaseException as exc:
        # Out of processes or memory, Ctrl-C: stop the ranks started, free everything.
        abandon(rt, f"fork() failed: {exc!r}")
        raise
    # Registered after multiprocessing's own exit hook, so it runs first,
    # while the workers are still there to be told to quit.
    atexit.unregister(_close_at_exit)
    atexit.register(_close_at_exit)
    pin = (lambda: None) if gpu_mode else (lambda: process_setup.pin(rt, rt.place.local_index, restore=True))
    if p.launch is not None:
        return join_cluster(rt, p.launch, rt.processes.janitor.tell, join_workers, pin)
    pin()
    logger.info("forked %d workers (%s mode, master rank %d, %d ranks on %d %s)",
                p.n_parallel - 1, p.device, p.master_rank, p.n_parallel,
                p.n_gpus if gpu_mode else len(p.cores), "GPUs" if gpu_mode else "cores")
    return p.n_parallel


def _start_workers(rt, segments=None):
    """Fork a worker for every rank but the leader's, into ``rt.processes.procs``.

    ``segments``: see ``_worker_main``.  On failure (OSError: out of processes or
    memory) the ranks started are left for the caller to stop.
    """
    ctx = multiprocessing.get_context("fork")
    # The parent-death signal fires when the forking *thread* ends: only the main
    # thread lives as long as the process.  Otherwise the workers' own check on
    # their parent (liveness.worker_check) and the janitor end them.
    tie = threading.current_thread() is threading.main_thread()
    last = rt.control.seq  # a worker serves the commands posted after it started
    rank = None
    try:
        with process_setup.forking("distribute()" if segments is not None else "fork()"):
            _freeze(rt)
            for rank in rt.worker_ranks:
                proc = ctx.Process(target=_worker_main, args=(rt, rank, tie, last, segments),
                                   name=f"synk-rank-{rank}", daemon=True)
                proc.start()
                rt.processes.procs[rank] = proc
    except BaseException as exc:
        if rank is not None:
            exc.add_note(f"starting rank {rank} of n_parallel={rt.place.n_parallel} failed; "
                         "the ranks already started were stopped")
        raise


def _freeze(rt):
    """Exempt every object that exists now from the cyclic GC (``gc.freeze``) until close().

    A collection writes the header of every object it visits: in a worker, that
    would copy the pages it shares with the leader; in the leader, it would copy
    them too, leaving the old pages to the workers alone.  A program that froze
    objects itself keeps its own choice.
    """
    ours = gc.unfreeze in rt.processes.restore
    if ours or gc.get_freeze_count() == 0:
        gc.freeze()
        if not ours:
            rt.processes.restore.append(gc.unfreeze)


def respawn(rt, install):
    """``distribute()`` on one machine: ``install()`` here, then start the workers again from here.

    Forked now, a worker shares this process's compiled functions, their constants
    and the libraries compiling loaded, page for page, instead of unpickling and
    compiling every Function in memory of its own (bench/memory.py, issue 38).
    The workers of ``fork()`` hold only Data mappings: they quit, the new ones map
    the same Data.  Returns False, having done nothing, where this cannot be: GPU
    mode (CUDA must not start here before forking), a cluster, a backend with
    per-process links, JAX started here, ``synk.profile()`` recording.

    Raises:
        WorkerDiedError, OSError (out of processes or memory): every process is stopped.
    """
    if (rt.config.device != "cpu" or rt.peers is not ALONE or not rt.backend.restartable
            or devices.jax_initialised() or rt.profiler is not None):
        return False
    install()
    if not rt.worker_ranks:
        return True
    run_command(rt, Command.QUIT, None)  # the workers of fork() exit after it
    _stop_workers(rt, grace_s=JOIN_TIMEOUT_S)
    rt.processes.procs.clear()  # in place: the Monitor holds this dict
    segments = [(data_id, seg.name, seg.nbytes) for data_id, seg in
                filter(None, (d.replica() for d in list(rt.registry.datas.values())))]
    process_setup.warm_jit()
    try:
        _start_workers(rt, segments)
        rt.processes.janitor.watch([proc.pid for proc in rt.processes.procs.values()])
    except BaseException as exc:
        abandon(rt, f"distribute() could not start the workers again: {exc!r}")
        raise
    return True


def _leader_check(rt):
    """The check of a machine's leader while it waits: its workers, then the other machines."""
    monitor = rt.processes.monitor

    def check():
        monitor()
        rt.peers.poll()
    return check


def _wiring(rt):
    """What the run's backend is built from: the placement, names, and the janitor's list."""
    config = rt.config
    return Wiring(ranks=rt.place, machine=MachineRanks(rt.place), spin_s=config.spin_s,
                  prefix=config.prefix, master_pid=config.master_pid, max_dim=config.max_dim,
                  new_name=rt.segment_name, remove_after_crash=rt.processes.cleanup_dirs.append)


def _worker_main(rt, rank, tie, last=0, segments=None):
    """A worker's life: set up this process, then serve commands posted after ``last``.

    ``segments``: ``(data_id, name, nbytes)`` of every Data made before this
    worker started (``respawn``), mapped here as DATA_ALLOC would have.
    """
    mpi_launch.close_launcher_fds()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the master's to handle
    if tie:
        process_setup.set_pdeathsig()
    if os.getppid() != rt.config.master_pid:
        os._exit(1)
    rt.place.local_index = rank
    rt.place.rank = rt.place.rank_offset + rank
    if trace.ON:
        trace.set_rank(rank)
    rt.processes = Processes()
    rt.registry.datas = {}  # this rank's mappings, by Data id
    if segments:
        mappings.map_segments(rt, segments)
    if rt.config.device == "gpu":
        process_setup.select_gpu(rt, rank)
    else:
        process_setup.pin(rt, rank)
    rt.check = worker_check(rt.config.master_pid)
    rt.backend.bind_check(command_check(rt.check, rt.control.aborted_now))
    worker.loop(rt, last)


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
        profiling.end_open_profiles(rt)  # close() inside synk.profile(): keep its records
        run_command(rt, Command.QUIT, None)
    except Exception as exc:  # noqa: BLE001 - the workers are stopped below whatever happened
        logger.warning("workers did not quit cleanly: %s", exc)
    join_workers(rt)


@handler(Command.QUIT, final=True)
def _quit(rt, payload):
    """The last command: each rank exits once it has reported (worker.loop)."""


def join_workers(rt):
    """After QUIT: join the workers (killing those that linger) and free everything."""
    _stop_workers(rt, grace_s=JOIN_TIMEOUT_S)
    _teardown(rt)
    logger.info("closed %d workers", len(rt.processes.procs))


def abandon(rt, reason):
    """Kill every worker and free everything after a failure the runtime can't survive."""
    logger.error("stopping all workers: %s", reason)
    rt.peers.end()  # in a cluster, every node master stops too (or its sentinel kills it)
    _stop_workers(rt, grace_s=0)
    _teardown(rt)


def _stop_workers(rt, grace_s):
    """Give the workers ``grace_s`` to exit by themselves, then kill and join them."""
    procs = list(rt.processes.procs.values())
    for proc in procs:
        proc.join(grace_s)
    for proc in procs:
        if proc.is_alive():
            stop_process(proc.pid)
    for proc in procs:
        proc.join(JOIN_TIMEOUT_S)


def _teardown(rt):
    if rt.closed:
        return  # abandoned already, while close() asked the workers to quit
    rt.closed = True  # once, even if a step below fails
    # Every step runs whatever an earlier one raised (a backend whose peer was killed): the
    # segments must not wait for the janitor.  Data: the master's close, a node master's detach.
    steps = [(f"release Data {i}", getattr(d, "detach", None) or d.close)
             for i, d in list(rt.registry.datas.items())]
    steps += [("clear Data", rt.registry.datas.clear), ("close the backend", rt.backend.close),
              ("close the control block", rt.control.close),
              ("unlink the run's segments", lambda: shmem.sweep(rt.config.prefix)),
              ("release the janitor", lambda: _release_janitor(rt)),
              ("close the run's lock", lambda: os.close(rt.processes.lock_fd))]
    steps += [("restore process limits", undo) for undo in reversed(rt.processes.restore)]
    steps += [(f"forget {f}", f.forget_run) for f in rt.registry.functions]
    for what, step in steps:
        try:
            step()
        except Exception:  # noqa: BLE001 - the next steps still free what they hold
            logger.warning("close: could not %s", what, exc_info=True)
    set_runtime(None)
    rt.peers.close()


def _release_janitor(rt):
    if rt.processes.janitor is not None:
        rt.processes.janitor.release(JOIN_TIMEOUT_S)  # first: children forked later close the lock fd
        rt.processes.janitor = None


def _close_at_exit():
    rt = get_runtime()
    if rt is not None and not rt.closed and rt.is_master and os.getpid() == rt.config.master_pid:
        with holding_calls(JOIN_TIMEOUT_S):
            _close(rt)
