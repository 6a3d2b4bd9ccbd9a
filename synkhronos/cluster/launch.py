"""How this process was launched (mpiexec or not), MPI's start and end, and a node master's exit."""

import atexit
import ctypes
import logging
import os
import sys
from typing import NamedTuple

from ..runtime.liveness import proc_start_time, stop_process

logger = logging.getLogger(__name__)


class Launch(NamedTuple):
    """This process's place in an MPI job, read from mpiexec's environment."""

    rank: int           # MPI rank (0: the controller)
    size: int           # MPI processes in the job (machines)
    local_index: int    # index among the MPI processes on this host
    local_count: int    # MPI processes on this host


_ENV_KEYS = (
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
)


class Elastic(NamedTuple):
    """This process's place in a cluster whose machines come and go (cluster/elastic.py).

    The controller runs with ``SYNK_LISTEN=[HOST:]PORT``; each node master,
    started on its own, with ``SYNK_JOIN=HOST:PORT``; both hold the job's
    secret (``SYNK_SECRET`` or ``SYNK_SECRET_FILE``).
    """

    rank: int           # 0: the controller; -1: a node master (its machine number comes at join)
    size: int           # machines the controller's fork() waits for (SYNK_MACHINES), itself included
    local_index: int    # always 0: one node master per machine
    local_count: int    # always 1
    host: str           # where the controller listens (SYNK_LISTEN) or is (SYNK_JOIN)
    port: int
    secret: bytes


SECRET_MIN_BYTES = 16


def elastic_launch(env):
    """The ``Elastic`` this process was started as (``SYNK_LISTEN`` or ``SYNK_JOIN``), or None.

    Raises:
        ValueError: both set, an address without a port, or no secret of at
            least ``SECRET_MIN_BYTES`` bytes.
    """
    listen, join = env.get("SYNK_LISTEN"), env.get("SYNK_JOIN")
    if not listen and not join:
        return None
    if listen and join:
        raise ValueError("fork: set SYNK_LISTEN (the controller) or SYNK_JOIN (a node master), "
                         "not both")
    where = listen or join
    host, _, port = where.rpartition(":")
    if not port.isdigit() or (join and not host):
        raise ValueError(f"fork: {'SYNK_LISTEN' if listen else 'SYNK_JOIN'} must be "
                         f"{'[HOST:]PORT' if listen else 'HOST:PORT'}; got {where!r}")
    secret = env.get("SYNK_SECRET", "").encode()
    path = env.get("SYNK_SECRET_FILE")
    if not secret and path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"fork: SYNK_SECRET_FILE {path!r} cannot be read ({exc})") from None
    if len(secret) < SECRET_MIN_BYTES:
        raise ValueError(f"fork: machines that come and go need the job's secret, at least "
                         f"{SECRET_MIN_BYTES} bytes, in SYNK_SECRET or a file named by "
                         "SYNK_SECRET_FILE (the same on every machine)")
    machines = env.get("SYNK_MACHINES", "1")
    if not machines.isdigit() or int(machines) < 1:
        raise ValueError(f"fork: SYNK_MACHINES must be a number of machines >= 1; got {machines!r}")
    return Elastic(0 if listen else -1, int(machines), 0, 1, host, int(port), secret)


def launched(env=None):
    """Return this process's ``Launch`` (or ``Elastic``), or None.

    Read from the environment mpiexec sets (MPICH's Hydra, Open MPI, PMIx),
    without initialising MPI, or from ``SYNK_LISTEN``/``SYNK_JOIN``.  None when
    not started by mpiexec, when the job has one process, or when
    ``SYNK_CLUSTER=0``.
    """
    env = os.environ if env is None else env
    if env.get("SYNK_CLUSTER", "1") == "0":
        return None
    elastic = elastic_launch(env)
    if elastic is not None:
        return elastic
    for rank_k, size_k, lrank_k, lsize_k in _ENV_KEYS:
        if rank_k in env and size_k in env:
            size = int(env[size_k])
            if size < 2:
                return None
            return Launch(int(env[rank_k]), size, int(env.get(lrank_k, 0)),
                          int(env.get(lsize_k, 1)))
    return None


def close_launcher_fds():
    """In a process forked from an MPI process: close its link to the MPI launcher.

    mpiexec (MPICH's Hydra) passes each process a socket (``PMI_FD``); a forked
    child that keeps it open can make the launcher see the MPI process's end
    wrongly, and end the job.
    """
    fd = os.environ.get("PMI_FD")
    if fd and fd.isdigit():
        try:
            os.close(int(fd))
        except OSError:
            pass


def init_mpi():
    """Initialise MPI (after the local fork) and return the module; finalised by ``finalize``."""
    import mpi4py
    mpi4py.rc.finalize = False  # synkhronos finalises at close; never a blocking atexit
    mpi4py.rc.thread_level = "single"
    from mpi4py import MPI
    return MPI


def mpi_segments():
    """The /dev/shm files this process has mapped since MPI started (MPICH's ``mpich_shm_*``).

    MPI unlinks them when it finalises; a killed process leaves them, so the
    janitor removes them after its master has gone.
    """
    out = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                name = os.path.basename(path)
                if path.startswith("/dev/shm/") and not name.startswith("synk_"):
                    out.add(path.replace(" (deleted)", ""))
    except OSError:
        pass
    return sorted(out)


_FINISHED = []
_LOST = []


def finished():
    """Whether this process's cluster job has ended (MPI cannot start again)."""
    return bool(_FINISHED)


def mark_finished():
    """Note that this process's cluster job has ended (it forks once, as under MPI)."""
    _FINISHED.append(True)


def lost_a_process():
    """Note that this job went on after losing a process (ULFM): MPI_Finalize would not return."""
    _LOST.append(True)


def finalize(mpi):
    """Finalise MPI in this process (after which mpiexec lets the others run on).

    Not after the job lost a process: Open MPI 5.0's MPI_Finalize then waits
    forever for it (across machines), so the process ends without it.
    """
    _FINISHED.append(True)
    if _LOST:
        logger.info("MPI_Finalize skipped: the job lost a process")
        return
    try:
        if mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    except Exception as exc:  # noqa: BLE001 - exiting anyway
        logger.warning("MPI_Finalize failed: %s", exc)


def exit_finalized(status=0):
    """End this process after ``finalize``, the way a C program ends: ``exit(status)``.

    MPICH's PMI client tells mpiexec that the process finished in a C exit
    handler; ``os._exit`` skips it, and mpiexec then takes the exit for a crash
    and kills every other process of the job, a controller still running the
    user's script after ``close()`` included.  C's exit runs that handler and
    none of Python's (no ``atexit``, no ``finally`` in the user's script around
    ``fork()``).  Python's own buffers are flushed first, as a normal exit would.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError, RuntimeError):
            # RuntimeError: SIGTERM's handler ends here, maybe in the middle of a write.
            pass
    try:
        ctypes.CDLL(None).exit(status)
    except (OSError, AttributeError):  # no C library to call: no PMI handler either
        pass
    os._exit(status)


# What mpiexec is called in each MPI (MPICH's Hydra, Open MPI's PRRTE).
LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpirun", "prterun", "prte", "orterun")


def parent_and_name(pid):
    """(parent pid, command name) of process ``pid``, from /proc; (None, None) if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None, None
    head, tail = stat.rsplit(b")", 1)
    return int(tail.split()[1]), head.split(b"(", 1)[1].decode(errors="replace")


def launcher_pid(pid=None, depth=4):
    """The pid of the mpiexec that started this process (an ancestor on this host), or None."""
    pid = os.getpid() if pid is None else pid
    for _ in range(depth):
        pid, _ = parent_and_name(pid)
        if not pid or pid == 1:
            return None
        if parent_and_name(pid)[1] in LAUNCHERS:
            return pid
    return None


def end_launcher_at_exit(why):
    """When this process exits, end the mpiexec that started it (SIGTERM).

    For a machine that stopped answering: mpiexec would wait for its daemon
    there forever (a cut link carries no news of its end), so mpiexec would
    never return.  At exit, not now: the user's program goes on after the error.
    """
    pid = launcher_pid()
    if pid is not None:
        atexit.register(_end_launcher, pid, why)


def _end_launcher(pid, why):
    logger.warning("ending mpiexec (pid %d), which would wait forever: %s", pid, why)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    started = proc_start_time(pid)
    # SIGTERM ends Hydra's mpiexec; PRRTE's waits on for the daemon it cannot reach, so
    # a process of its own (this one may be ended by mpiexec meanwhile) kills it after
    # LAUNCHER_GRACE_S.
    if os.fork() == 0:
        try:
            os.setsid()
            stop_process(pid, started=started, grace_s=LAUNCHER_GRACE_S)
        finally:
            os._exit(0)


LAUNCHER_GRACE_S = 1.0
