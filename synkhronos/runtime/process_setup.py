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
import threading
import time
import warnings

from . import cores, devices

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
            trade = rt.processes.core_trade = cores.core_trade(rt)
            if trade is not None:
                rt.processes.restore.append(trade.close)
            rt.processes.unpinned = frozenset(before)
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


# CPython 3.12+ warns at every os.fork() of a process with more than one OS thread.
FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks"
OWN_THREADS = "synk-"
"""The name prefix of synkhronos's own threads (door, heartbeats, overlap, gloo groups)."""

_said = []  # the Python threads forking() has warned about, once per process


@contextlib.contextmanager
def forking(what):
    """Fork inside this: no log record half written, no warning for what is safe, one for what is not.

    synkhronos forks on purpose (its ranks, sentinels, helpers).  What makes
    a fork unsafe is a lock some other thread holds at that moment: the child
    keeps it held, with no thread to release it.  Native pools (BLAS, OpenMP,
    Numba's), limited to one thread per rank before the fork, take no lock
    the child needs, and neither do synkhronos's own threads (``synk-*``); so
    CPython's DeprecationWarning ("this process is multi-threaded") is not
    shown for them.  Other Python threads (the program's own, a notebook's,
    a library's) are named once per process, with what to do.

    Args:
        what: what forks, for the warning (``"fork()"``, ``"distribute()"``).
    """
    me = threading.current_thread()
    others = sorted(t.name for t in threading.enumerate()
                    if t is not me and t.is_alive() and not t.name.startswith(OWN_THREADS)
                    and not isinstance(t, threading._DummyThread))
    if others and not _said:
        _said.append(others)
        warn_caller(
            f"synkhronos {what} forks the ranks while {len(others)} other thread(s) run in this "
            f"process ({', '.join(others)}): a lock one of them holds at that moment stays held "
            "in every rank, which would hang there if the rank needs it. Start such threads "
            "after synk.distribute() (which forks the ranks again), or stop them before",
            RuntimeWarning)
    with logging_held(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", FORK_WARNING, DeprecationWarning)
        yield


def fork_quietly():
    """``os.fork()`` for a helper process whose child runs only code of ours, needing no other thread's lock.

    Returns what ``os.fork()`` returns; CPython 3.12+'s warning about other
    threads is not shown (see ``forking``).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", FORK_WARNING, DeprecationWarning)
        return os.fork()


def warn_caller(message, category):
    """``warnings.warn`` at the line of the program that called into synkhronos."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 2
    while frame is not None and (frame.f_code.co_filename.startswith(package)
                                 or frame.f_code.co_filename == contextlib.__file__):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


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
