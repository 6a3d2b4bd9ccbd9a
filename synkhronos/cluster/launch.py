"""How this process was launched (mpiexec or not), MPI's start and end, and a node master's exit."""

import atexit
import ctypes
import logging
import os
import sys
from typing import NamedTuple

from ..errors import SynkError
from ..runtime.liveness import proc_start_time, proc_stat, stop_process
from ..runtime.process_setup import fork_quietly
from .elastic.env import elastic_launch
from .slurm import cancel_step, slurm_step, slurm_task, warn_batch_step

logger = logging.getLogger(__name__)


# The launch routes launched() reads.
HYDRA = "mpiexec (MPICH's Hydra)"
PRRTE = "mpirun (Open MPI)"
SRUN_PMI = "srun --mpi=pmi2"
SRUN_PMIX = "srun --mpi=pmix"
PMI = "a PMI launcher"


class Launch(NamedTuple):
    """This process's place in an MPI job, read from its launcher's environment."""

    rank: int           # MPI rank (0: the controller)
    size: int           # MPI processes in the job (machines)
    local_index: int    # index among the MPI processes on this host
    local_count: int    # MPI processes on this host
    route: str = HYDRA  # the launcher it was read from (one of the routes above)
    seen: str = ""      # the variables read, for error messages


def launched(env=None):
    """Return this process's ``Launch``, or None; raise where the launch cannot be read.

    Read from the environment the launcher sets, without initialising MPI, by
    the first launcher in ``ROUTES`` present there: MPICH's Hydra
    (``mpiexec``, also inside a Slurm allocation), Open MPI's ``mpirun``, and
    ``srun --mpi=pmi2`` / ``--mpi=pmix`` (PMI's rank and Slurm's task
    variables: ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``, ...); or an
    ``elastic.env.Elastic`` where ``SYNK_LISTEN``/``SYNK_JOIN`` is set
    (machines that come and go).  None when not started by a launcher, when
    the job has one process, or when ``SYNK_CLUSTER=0``.

    Raises:
        SynkError: started as one of several processes that would each run
            alone (``srun`` without an MPI plugin; a PMIx rank with no job
            size): what was seen, and how to launch instead.
    """
    env = os.environ if env is None else env
    if env.get("SYNK_CLUSTER", "1") == "0":
        return None
    launcher = next((known for known in ROUTES if known.present(env)), None)
    if launcher is None:
        warn_batch_step(env)
        return None
    launch = launcher.read(env)
    return launch if launcher.spans(launch) else None


ROUTES = []  # every Launcher, in the order defined below: the first present reads the launch


class Launcher:
    """One launcher: whether it started this process, and where in its job.

    Defining a subclass adds it to ``ROUTES`` (as JAX's cluster environments
    register themselves), asked after the ones defined before it: a launcher
    whose variables another sets too comes after that one.  A launch that
    cannot be read is a launcher whose ``read`` refuses it.
    """

    route = ""  # what error messages call it (the constants above)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        ROUTES.append(cls())

    def present(self, env):
        """Whether this launcher started the process, by the variables in ``env``."""
        raise NotImplementedError

    def read(self, env):
        """This process's ``Launch`` from ``env`` (where ``present``); SynkError if it cannot be."""
        raise NotImplementedError

    def spans(self, launch):
        """Whether ``launch`` makes a cluster: a job of one process runs as one machine."""
        return launch.size >= 2


class ElasticLaunch(Launcher):
    """Machines that come and go: ``SYNK_LISTEN`` (the controller) or ``SYNK_JOIN`` (a node master)."""

    route = "SYNK_LISTEN / SYNK_JOIN"

    def present(self, env):
        return bool(env.get("SYNK_LISTEN") or env.get("SYNK_JOIN"))

    def read(self, env):
        return elastic_launch(env)

    def spans(self, launch):
        return True  # one machine so far: others may join it


class Hydra(Launcher):
    """MPICH's mpiexec; inside an allocation its own variables win over the proxy's srun step."""

    route = HYDRA

    def present(self, env):
        return all(k in env for k in ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))

    def read(self, env):
        return Launch(int(env["PMI_RANK"]), int(env["PMI_SIZE"]), int(env["MPI_LOCALRANKID"]),
                      int(env.get("MPI_LOCALNRANKS", 1)), HYDRA,
                      _seen(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


class OpenMpi(Launcher):
    """Open MPI's mpirun (PRRTE): its rank as ``OMPI_COMM_WORLD_RANK`` or PMIx's."""

    route = PRRTE

    def present(self, env):
        return "OMPI_COMM_WORLD_SIZE" in env and ("OMPI_COMM_WORLD_RANK" in env
                                                  or "PMIX_RANK" in env)

    def read(self, env):
        return Launch(int(env.get("OMPI_COMM_WORLD_RANK", env.get("PMIX_RANK"))),
                      int(env["OMPI_COMM_WORLD_SIZE"]),
                      int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
                      int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1)), PRRTE,
                      _seen(env, "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"))


class SrunPmi(Launcher):
    """``srun --mpi=pmi2``: PMI's rank and size, and Slurm's task variables for the host mates."""

    route = SRUN_PMI

    def present(self, env):
        return _pmi(env) and _task(env, int(env["PMI_RANK"]), int(env["PMI_SIZE"])) is not None

    def read(self, env):
        return Launch(*slurm_task(env), SRUN_PMI, _srun_seen(env))


class Pmi(Launcher):
    """A PMI launcher that names no host mates: one process per host is assumed, and
    checked against MPI's own view once it runs (``placement_problem``)."""

    route = PMI

    def present(self, env):
        return _pmi(env)

    def read(self, env):
        return Launch(int(env["PMI_RANK"]), int(env["PMI_SIZE"]), 0, 1, PMI, _seen(env, *_PMI_KEYS))


class SrunPmix(Launcher):
    """``srun --mpi=pmix``: PMIx's rank only; the job's size and host mates from Slurm's tasks."""

    route = SRUN_PMIX

    def present(self, env):
        return "PMIX_RANK" in env and _task(env, int(env["PMIX_RANK"])) is not None

    def read(self, env):
        return Launch(*slurm_task(env), SRUN_PMIX, _srun_seen(env))


class PmixAlone(Launcher):
    """A PMIx rank and nothing that says the job's size or host mates: refused."""

    route = "a PMIx launcher"

    def present(self, env):
        return "PMIX_RANK" in env

    def read(self, env):
        raise SynkError(
            f"fork: a PMIx launcher started this program ({_seen(env, *_PMI_KEYS)}), but "
            "nothing says how many processes the job has or which share this host: neither "
            "Open MPI's mpirun (OMPI_COMM_WORLD_SIZE) nor srun (SLURM_PROCID, "
            "SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE) set them. Start "
            "it with mpirun, or `srun --mpi=pmix` inside a Slurm allocation; or set "
            "SYNK_CLUSTER=0 to run each process as a one-machine program on purpose.")


class SrunWithoutMpi(Launcher):
    """An srun step of several tasks without an MPI plugin: each would run alone; refused."""

    route = "srun"

    def present(self, env):
        task = slurm_task(env)
        return task is not None and task[1] > 1

    def read(self, env):
        rank, tasks = slurm_task(env)[:2]
        raise SynkError(
            f"fork: srun started this program as task {rank} of {tasks} "
            f"({_seen(env, *_SLURM_KEYS)}) without MPI: no PMI_RANK or PMIX_RANK is set, "
            "so each task would run as a one-machine program of its own. Start it with "
            "`srun --mpi=pmi2` (MPICH) or `srun --mpi=pmix` (Open MPI), or with mpiexec / "
            "mpirun inside the allocation; or set SYNK_CLUSTER=0 to run the tasks as "
            "separate programs on purpose.")


def _pmi(env):
    return "PMI_RANK" in env and "PMI_SIZE" in env


def _task(env, rank, size=None):
    """Slurm's task (``slurm_task``) if it is process ``rank`` of a job of ``size``, else None."""
    task = slurm_task(env)
    return task if task is not None and task[0] == rank and size in (None, task[1]) else None


def _srun_seen(env):
    return f"{_seen(env, *_PMI_KEYS)} {_seen(env, *_SLURM_KEYS)}"


_PMI_KEYS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK")
_SLURM_KEYS = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID",
               "SLURM_STEP_TASKS_PER_NODE")


def _seen(env, *keys):
    return " ".join(f"{k}={env[k]}" for k in keys if k in env)


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
