"""Going on with the machines left after one is lost (Open MPI with ULFM).

Under ``mpirun --with-ft ulfm`` a dead process turns the MPI calls that
involve it into errors instead of ending the job.  Whoever sees such an error
first (the controller, from a heartbeat or an MPI call; a node master, from an
MPI call) revokes the job's communicator, so every other leader's next MPI
call fails too, wherever it waits; each leader then settles its own ranks'
command and shrinks the communicator to the survivors.  The survivors keep
their order, so the controller stays machine 0, and each machine renumbers
its ranks from the new layout.  Data needs nothing: every machine holds every
row.

``SYNK_ON_MACHINE_LOSS=end`` ends the run instead (for a restart from a
checkpoint); under MPICH, whose ch4 device has no fault tolerance, the
launcher ends the job on a crash regardless.
"""

import logging
import os
import time

import numpy as np

from ..runtime.commands import Command
from ..runtime.run import run_command
from ..errors import SynkError
from ..runtime.liveness import wait_until
from .launch import lost_a_process
from .layout import Layout, LayoutMsg, set_layout
from .settings import ends_on_machine_loss

logger = logging.getLogger(__name__)

SHRINK_TIMEOUT_S = 60.0  # MPI's own failure detector names a dead peer within seconds


def ulfm_enabled(mpi):
    """Whether MPI reports a dead peer as an error and the job lives on (Open MPI's ULFM)."""
    return (os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes")
            and hasattr(mpi.Comm, "Ishrink"))


def going_on(mpi):
    """Whether this run goes on after losing a machine (ULFM, and not SYNK_ON_MACHINE_LOSS=end)."""
    return not ends_on_machine_loss() and ulfm_enabled(mpi)


def shrink(link, done_seq):
    """Revoke the job's communicator and go on with the leaders left.

    Collective over every surviving leader (each calls it after its MPI calls
    failed), each giving the last command its machine finished
    (``done_seq``).  Rebinds ``link`` to the new communicator and layout (and
    the leaders' collectives to a duplicate of it).
    Returns (the survivors' old machine indices, each one's ``done_seq``).

    Raises:
        SynkError: the survivors did not agree within ``SHRINK_TIMEOUT_S`` (the run is over).
    """
    mpi, comm = link.MPI, link.comm
    t0 = time.monotonic()
    lost_a_process()
    try:
        comm.Revoke()
    except mpi.Exception:
        pass  # revoked already, by the leader that saw the failure first
    # A leader inside a collective with the lost machine leaves it now, not when MPI's
    # failure detector names the peer; ``rebind`` duplicates a fresh one from the survivors.
    link.leaders.revoke()
    try:
        # Blocking: MPI_Comm_shrink completes despite failures (it is ULFM's agreement);
        # Open MPI 5.0's Ishrink failed its schedule (error 77, revoked) in our tries.
        new = comm.Shrink()
        me = np.array([link.node, done_seq], dtype=np.int64)
        got = np.empty((new.Get_size(), 2), dtype=np.int64)
        _wait(new.Iallgather(me, got), "exchange the machines left")
    except mpi.Exception as exc:
        raise SynkError(f"could not go on after losing a machine: MPI failed again ({exc})") from None
    survivors = [int(m) for m in got[:, 0]]
    before = link.layout
    link.rebind(new, Layout([before.n_local[m] for m in survivors],
                            [before.hosts[m] for m in survivors]))
    logger.info("cluster: going on with machines %s of %d (%.2f s to agree)", survivors,
                before.n_machines, time.monotonic() - t0)
    return survivors, [int(q) for q in got[:, 1]]


def _wait(req, what):
    deadline = time.monotonic() + SHRINK_TIMEOUT_S

    def late():
        if time.monotonic() > deadline:
            raise SynkError(f"the machines left did not {what} within {SHRINK_TIMEOUT_S:g} s")
    wait_until(lambda: req.Test(), late, 0.0, poll_max_s=1e-3)


def relayout(rt, layout, node):
    """Renumber this machine's ranks in the new ``layout`` (this process is machine ``node``)."""
    offset = layout.offsets[node]
    run_command(rt, Command.LAYOUT, LayoutMsg(offset, layout.n_parallel),
                local=lambda seq: set_layout(rt, offset, layout.n_parallel))


def settle_local(rt, seq, leader_ok):
    """Abort this machine's ranks' command ``seq``, wait until each has left it; return if all made it.

    ``leader_ok``: whether this process's own share finished.  Checks only
    this machine's processes: MPI is revoked by now.
    """
    control = rt.control
    control.abort(seq)
    control.wait_done(rt, seq, rt.processes.monitor)
    return leader_ok and control.all_ok()
