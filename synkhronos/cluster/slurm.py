"""Slurm: this process's place as a task of an srun step, read from Slurm's variables.

Without initialising MPI: srun sets PMI's rank and size (``--mpi=pmi2``) or
PMIx's rank (``--mpi=pmix``) only; where the task's host mates are, Slurm's
own task variables say (``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``,
``SLURM_NODEID``, which counts the step's nodes).
"""

import logging
import os
import socket
import subprocess
import time

from ..runtime.process_setup import fork_quietly

logger = logging.getLogger(__name__)


def slurm_task(env):
    """This process's place as a task of an srun step: (rank, tasks, local index, tasks on
    this node), from Slurm's task variables; None outside an srun step (the batch script
    itself has no ``SLURM_STEP_ID``) or where they do not parse."""
    if "SLURM_STEP_ID" not in env:
        return None
    try:
        per_node = tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])
        return (int(env["SLURM_PROCID"]),
                int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]),
                int(env["SLURM_LOCALID"]), per_node[int(env["SLURM_NODEID"])])
    except (KeyError, ValueError, IndexError):
        return None


def tasks_per_node(spec):
    """Expand Slurm's tasks-per-node list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        out += [int(count)] * (int(times.rstrip(")")) if times else 1)
    return out


def warn_batch_step(env):
    """Log a warning where the batch script of a Slurm job of several nodes started this
    program itself (no srun, no mpiexec): it runs on the first node only."""
    try:
        nodes = int(env.get("SLURM_JOB_NUM_NODES", 1))
    except ValueError:
        return
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env and nodes > 1:
        logger.warning("fork: this Slurm job has %d nodes, but the batch script started this "
                       "program itself: it runs on one machine (%s). Start it with srun or "
                       "mpiexec to use every node.", nodes, socket.gethostname())


def slurm_step(env):
    """``"JOB.STEP"``: the srun step this process runs in, or None (no step: the batch
    script, or no Slurm)."""
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
    return f"{job}.{step}" if job and step and step.isdigit() else None


def cancel_step(step, why, grace_s):
    """Cancel Slurm step ``step`` (``scancel``) after ``grace_s``, from a process of its own.

    For the controller's exit after a machine stopped answering: srun waits
    for that machine's tasks, whose end cannot reach it.  The grace lets this
    process finish exiting first (cancelling the step ends it too).
    """
    logger.warning("cancelling Slurm step %s, whose srun would wait for a machine it cannot "
                   "reach: %s", step, why)
    if fork_quietly() == 0:
        try:
            os.setsid()
            time.sleep(grace_s)
            subprocess.run(["scancel", "--quiet", step], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass
        finally:
            os._exit(0)
