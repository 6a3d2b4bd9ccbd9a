"""What each process of a run does to itself: pin its core, limit its threads, select its GPU.

Also how the leader forks without handing a child a half-written log record, and
what it builds first so that its children share it (``warm_jit``).
"""

import contextlib
import ctypes
import functools
import logging
import os
import signal
import sys
import time

from . import devices

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
LOGGING_WAIT_S = 2.0


def select_gpu(rt, rank):
    per_gpu = -(-rt.place.n_parallel // rt.config.n_gpus)
    if rt.is_master:
        save_env(rt, ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_MEM_FRACTION"))
    devices.select_device(rt.config.gpu_ids[devices.device_for_rank(rank, rt.config.n_gpus)], per_gpu)


def save_env(rt, names):
    """Have close() put these environment variables back as they are now."""
    saved = {k: os.environ.get(k) for k in names}

    def restore():
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    rt.processes.restore.append(restore)


THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
              "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def limit_threads(rt):
    """Limit BLAS/OpenMP pools to one thread per process (undone by close()).

    threadpoolctl limits the pools already loaded; the environment covers
    those loaded later (PyTensor's compiled code pulls in SciPy's OpenBLAS on
    first use), which would otherwise start a thread per core and fight the
    other ranks for them.
    """
    from threadpoolctl import threadpool_limits

    save_env(rt, THREAD_ENV)
    for k in THREAD_ENV:
        os.environ[k] = "1"
    limiter = threadpool_limits(limits=1)
    rt.processes.restore.append(limiter.restore_original_limits)


def pin(rt, rank, restore=False):
    """Pin this process to its own core when this machine has enough cores."""
    if rt.place.n_local <= len(rt.config.cores):
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {rt.config.cores[rank]})
        if restore:
            rt.processes.restore.append(lambda: os.sched_setaffinity(0, before))


@contextlib.contextmanager
def logging_held(wait_s=LOGGING_WAIT_S):
    """Hold every logging handler's lock while forking: no child inherits a record half written.

    logging re-creates its locks in a child, but a thread caught inside a
    handler's ``emit`` still holds its stream's own lock (a file's buffer):
    the child's first record there would wait forever.  Locks are taken all
    or none, with a bounded wait, since handlers may take each other's
    (MemoryHandler) and logging's module lock, which fork takes too; past
    ``wait_s`` the fork goes ahead without them.
    """
    handlers = [ref() for ref in list(getattr(logging, "_handlerList", ()))]
    locks = [h.lock for h in handlers if h is not None and getattr(h, "lock", None) is not None]
    if getattr(logging, "_lock", None) is not None:
        locks.insert(0, logging._lock)  # held here, fork's own hook takes it at once
    held = []
    deadline = time.monotonic() + wait_s
    while locks and time.monotonic() < deadline:
        for lock in locks:
            if not lock.acquire(timeout=0.01):
                break
            held.append(lock)
        else:
            break
        while held:
            held.pop().release()
    try:
        yield
    finally:
        while held:
            held.pop().release()


def set_pdeathsig():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux; the janitor still kills us
        pass


def warm_jit():
    """If numba is loaded, build its CPU typing and target contexts here, before forking.

    Every process builds them on its first numba-compiled call (PyTensor's default
    linker from 3.0): about 37 MiB and 70 ms each.  Built in the leader before it
    forks, they stay shared with its workers.
    """
    if "numba" not in sys.modules:
        return
    try:
        from numba.core.registry import cpu_target

        cpu_target.typing_context.refresh()
        cpu_target.target_context.refresh()
    except Exception as exc:  # noqa: BLE001 - only memory is at stake: each worker builds its own
        logger.debug("numba's contexts were not built before forking: %r", exc)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap():
    """Give the heap's free pages back to the system (glibc's ``malloc_trim``); else nothing.

    glibc keeps what a process freed (a model's compile, a call's intermediates)
    for later allocations.  Called where a long phase begins or a process goes
    idle: dp.sample before and after its chains, a worker idle for 50 ms.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
