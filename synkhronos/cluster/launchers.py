"""Which launcher started this process, and its place in the job: one small class per launcher.

``launched()`` asks every ``Launcher`` in ``ROUTES`` (each registers itself when
defined) whether it started this process, and the first that did reads the
process's ``Launch`` from the environment, without initialising MPI.  Adding a
launcher is one class.
"""

import os
from typing import NamedTuple

from ..errors import SynkError
from .elastic.env import elastic_launch
from .slurm import slurm_task, warn_batch_step

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
