"""MPI's start and end under a launcher, and a node master's exit (and the launcher's with it).

Which launcher started the process, and where in its job: ``launchers``.
"""

import atexit
import ctypes
import logging
import os
import sys

from ..errors import SynkError
from ..runtime.liveness import proc_start_time, proc_stat, stop_process
from ..runtime.process_setup import fork_quietly
from .launchers import SRUN_PMI, SRUN_PMIX
from .slurm import cancel_step, slurm_step

logger = logging.getLogger(__name__)


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


def init_mpi(launch=None):
    """Initialise MPI (after the local fork) and return the module; finalised by ``finalize``.

    With this process's ``launch``: first refuse an MPI that cannot work under its
    launcher, and choose MPICH's network module under srun (``prepare_mpi``); then
    refuse a job that MPI sees otherwise than the launcher's environment said.

    Raises:
        SynkError: what was seen, and how to launch instead.
    """
    import mpi4py
    mpi4py.rc.initialize = False  # prepare_mpi reads the library first
    mpi4py.rc.finalize = False  # synkhronos finalises at close; never a blocking atexit
    mpi4py.rc.thread_level = "single"
    from mpi4py import MPI
    if launch is not None:
        prepare_mpi(MPI.Get_library_version(), launch)
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_SINGLE)
    world = MPI.COMM_WORLD
    if launch is not None and (world.Get_size(), world.Get_rank()) != (launch.size, launch.rank):
        raise SynkError(
            f"fork: MPI started this program as process {world.Get_rank()} of "
            f"{world.Get_size()}, but {launch.route} said process {launch.rank} of "
            f"{launch.size} ({launch.seen}): the MPI library ({_library(MPI.Get_library_version())}) "
            f"did not join the launcher's job, and each process would run alone. "
            f"{_ADVICE}")
    return MPI


_ADVICE = ("Launch MPICH with its mpiexec or `srun --mpi=pmi2`, Open MPI with its mpirun or "
           "`srun --mpi=pmix` (docs/slurm.md).")


def _library(version):
    """The MPI library's name and version, from ``MPI.Get_library_version()``."""
    first = version.strip().splitlines()[0].split(",")[0] if version.strip() else "unknown MPI"
    return " ".join(first.split())


def prepare_mpi(version, launch, env=None):
    """Before MPI_Init: refuse an MPI library that cannot join ``launch``'s launcher; under
    ``srun --mpi=pmi2`` make MPICH use its OFI network module unless one was chosen.

    ``version``: ``MPI.Get_library_version()``.  MPICH's PMI-1 client sends
    Slurm's pmi2 plugin lines longer than its 1024-byte limit when it passes
    UCX's long addresses (``mpi/pmi2: value not properly terminated``, then
    ``UCX ERROR failed to unpack address``: one process dies, the others hang),
    depending on memory contents; OFI's addresses are short, and with them every
    run passed (docs/slurm.md).

    Raises:
        SynkError: MPICH without PMIx under ``srun --mpi=pmix``; Open MPI 5 (PMIx
            only) under ``srun --mpi=pmi2``.
    """
    env = os.environ if env is None else env
    name = _library(version)
    if launch.route == SRUN_PMIX and "MPICH" in version and "pmix" not in version.lower():
        raise SynkError(f"fork: {SRUN_PMIX} started this program ({launch.seen}), but its MPI "
                        f"({name}) speaks PMI-1/PMI-2, not PMIx: each process would fail or "
                        f"run alone. Use `srun --mpi=pmi2`, or mpiexec inside the allocation.")
    major = version.split("Open MPI v", 1)[1][:1] if "Open MPI v" in version else ""
    if launch.route == SRUN_PMI and major.isdigit() and int(major) >= 5:
        raise SynkError(f"fork: {SRUN_PMI} started this program ({launch.seen}), but its MPI "
                        f"({name}) speaks PMIx only: each process would run as a job of its "
                        f"own. Use `srun --mpi=pmix`, or mpirun inside the allocation.")
    if launch.route == SRUN_PMI and "MPICH" in version:
        device = next((line for line in version.splitlines() if "Device:" in line), "")
        chosen = env.get("MPIR_CVAR_CH4_NETMOD")
        say = logger.warning if launch.rank == 0 else logger.debug  # once, in the controller
        if not chosen and "ucx" in device and "ofi" in device:
            env["MPIR_CVAR_CH4_NETMOD"] = "ofi"
            say("%s with %s: MPICH uses its OFI network module (MPIR_CVAR_CH4_NETMOD=ofi), "
                "since its PMI-1 lines with UCX addresses can exceed Slurm's limit; set "
                "MPIR_CVAR_CH4_NETMOD yourself to choose", SRUN_PMI, name)
        elif (chosen or "ucx") == "ucx" and "ucx" in device:
            say("%s with %s over UCX: its PMI-1 lines can exceed Slurm's 1024-byte limit and "
                "hang the job; MPIR_CVAR_CH4_NETMOD=ofi or mpiexec avoid it", SRUN_PMI, name)


def placement_problem(launch, hosts, local):
    """Return what is wrong with where the launcher said the MPI processes are, or None.

    ``hosts``: each MPI process's host (MPI's processor name); ``local``: each
    one's ``(local_index, local_count)`` as read from its launcher.  Run once MPI
    runs, in every process alike, so that all refuse together: processes that
    read the wrong place on a host would take the same cores.
    """
    for i, (host, (index, count)) in enumerate(zip(hosts, local)):
        mates = [j for j, h in enumerate(hosts) if h == host]
        if (index, count) != (mates.index(i), len(mates)):
            return (f"fork: MPI process {i} read its place on {host} as {index} of {count} "
                    f"from {launch.route} ({launch.seen} here), but MPI runs {len(mates)} "
                    f"process(es) there (MPI processes {', '.join(map(str, mates))}): they "
                    f"would share cores wrongly. {_ADVICE}")
    return None


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
    stat = proc_stat(pid)
    return (None, None) if stat is None else (int(stat[1][1]), stat[0])


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

    Under Slurm the launcher to end is the srun step this process runs in
    (``srun`` itself, or the one that started Hydra's proxies), which would wait
    until Slurm takes the machine for down (``SlurmdTimeout``): it is cancelled.
    """
    pid = launcher_pid()
    if pid is not None:
        atexit.register(_end_launcher, pid, why)
    else:
        end_step_at_exit(why)


def end_step_at_exit(why):
    """When this process exits, cancel the srun step it runs in, if any (``end_launcher_at_exit``).

    Also for a machine that died: where its host went down with it, nothing
    tells srun until Slurm takes the host for down.
    """
    step = slurm_step(os.environ)
    if step is not None and launcher_pid() is None:
        atexit.register(cancel_step, step, why, LAUNCHER_GRACE_S)


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
    if fork_quietly() == 0:
        try:
            os.setsid()
            stop_process(pid, started=started, grace_s=LAUNCHER_GRACE_S)
        finally:
            os._exit(0)


LAUNCHER_GRACE_S = 1.0
