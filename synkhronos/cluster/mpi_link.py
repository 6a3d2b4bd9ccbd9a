"""The MPI carrier of the link between machines (``link.LinkBase`` over MPI point-to-point).

Commands, reports, aborts and Data writes travel on the job's communicator,
by tag; the leaders' collectives run on their own communicator
(``comm.mpi_leaders.MpiLeaders``), which an aborted command makes every
leader replace (``renew``).  Every wait is a loop over ``Improbe`` or
``Test`` that keeps calling a liveness check.
"""

from ..comm.mpi_leaders import MpiLeaders
from ..errors import MachineLostError, SynkError
from ..runtime.liveness import wait_until
from . import recovery
from .launch import finalize
from .link import LinkBase


class MpiLink(LinkBase):
    """This process's MPI messages to and from the other machines' leaders.

    Args:
        mpi: the ``mpi4py.MPI`` module.
        comm: this job's communicator (a duplicate of COMM_WORLD).
        layout: the run's ``Layout``.
        spin_s: how long waits spin before sleeping.
    """

    def __init__(self, mpi, comm, layout, spin_s):
        self.MPI = mpi
        self.comm = comm
        self.node = comm.Get_rank()
        self.layout = layout
        self.spin_s = spin_s
        self.others = [m for m in range(layout.n_machines) if m != self.node]
        self.seq = 0           # the current command's number
        self.sends = []        # (request, buffer) not yet known complete
        self.orphans = []      # (request, buffer) of sends an aborted command left behind
        self.pool = {}         # reused receive buffers
        self.graveyard = []    # (communicator, sends) given up after a machine was lost
        self.leaders = MpiLeaders(mpi, comm, spin_s, self.lost)
        self.status = mpi.Status()  # reused by probes: a message's size and tag

    def begin(self, seq):
        """Start command ``seq`` (its reports carry the number)."""
        self.seq = seq

    def survives(self):
        """Whether the run goes on after losing a machine (ULFM, and not SYNK_ON_MACHINE_LOSS=end)."""
        return recovery.going_on(self.MPI)

    def shrink(self, done_seq, lost=None):
        """Go on with the machines left (``recovery.shrink``); return (survivors, each one's done_seq)."""
        return recovery.shrink(self, done_seq)

    def news(self):
        """Whether the controller regrouped the machines (never under MPI: ULFM tells)."""
        return False

    def finish(self):
        """At this process's end: finalise MPI (``launch.finalize``)."""
        finalize(self.MPI)

    def renew(self, gen):
        """Replace the leaders' communicator (generation ``gen``): a command aborted before.

        Every leader calls this at the same command boundary, so the fresh
        duplicate matches on every leader and nothing a failure left pending
        on the old one pairs with a later collective.
        """
        self.leaders.renew(self.comm, gen)

    def lost(self, exc, machine=None):
        """The MachineLostError for an MPI error: which machine was lost, from MPI (ULFM) or the caller.

        Under Open MPI with ULFM (``mpirun --with-ft ulfm``) a peer that died
        turns MPI calls that involve it into ``MPI_ERR_PROC_FAILED``, and a
        revoked communicator (another leader saw a failure first) every call
        into ``MPI_ERR_REVOKED``; no raw MPI exception reaches the user.
        """
        failed = []
        try:
            group = self.comm.Get_failed()
            failed = self.MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                    self.comm.Get_group())
        except Exception:  # noqa: BLE001 - no ULFM here: only the caller knows the peer
            pass
        machines = sorted({m for m in failed if m is not None and m >= 0} or
                          ({machine} if machine is not None else set()))
        what = exc.Get_error_string() if hasattr(exc, "Get_error_string") else str(exc)
        if not machines:
            return MachineLostError(f"MPI failed ({what})", self.layout.offsets[0])
        names = "; ".join(self.layout.describe(m) for m in machines)
        return MachineLostError(f"{names}: lost ({what}); its processes died or it was cut off",
                                self.layout.offsets[machines[0]], machines)

    def rebind(self, comm, layout):
        """Go on over ``comm`` (the survivors, after a machine was lost) with ``layout``.

        Requests on the old communicator are kept, never tested again: MPI may
        still own their buffers.
        """
        self.graveyard.append((self.comm, self.sends + self.orphans))
        self.comm = comm
        self.node = comm.Get_rank()
        self.layout = layout
        self.others = [m for m in range(layout.n_machines) if m != self.node]
        self.sends, self.orphans = [], []
        self.pool.clear()
        self.leaders.renew(comm, self.leaders.gen)

    def send_bytes(self, dest, tag, buf):
        """Send ``buf`` as it is (kept alive until the send completes)."""
        try:
            self.sends.append((self.comm.Isend(buf, dest, tag), buf))
        except self.MPI.Exception as exc:
            raise self.lost(exc, dest) from None

    def probe(self, src, tag):
        """Return (message, size in bytes) if one from ``src`` with ``tag`` has arrived, else None."""
        st = self.status
        try:
            m = self.comm.Improbe(src, tag, st)
        except self.MPI.Exception as exc:
            raise self.lost(exc, src) from None
        return None if m is None else (m, st.Get_count(self.MPI.BYTE))

    def probe_any(self, src, tags):
        """Return (message, size in bytes, tag) of the next message from ``src``, else None.

        One probe for any tag (the controller waits for one of three reports
        from each machine, and each probe is a pass of MPI's progress engine);
        a message with a tag outside ``tags`` breaks the protocol.
        """
        st = self.status
        try:
            m = self.comm.Improbe(src, self.MPI.ANY_TAG, st)
        except self.MPI.Exception as exc:
            raise self.lost(exc, src) from None
        if m is None:
            return None
        tag = st.Get_tag()
        if tag not in tags:
            raise SynkError(f"{self.layout.describe(src)} sent a message with tag {tag} where "
                            f"one of {tags} was expected")
        return m, st.Get_count(self.MPI.BYTE), tag

    def receive(self, message, buf, src):
        """Receive a probed ``message`` from machine ``src`` into ``buf``."""
        try:
            message.Recv(buf)
        except self.MPI.Exception as exc:
            raise self.lost(exc, src) from None

    def complete_sends(self, check):
        """Wait until every send so far has completed (its buffer may be reused)."""
        if not self.sends:
            return
        reqs = [r for r, _ in self.sends]
        try:
            wait_until(lambda: self.MPI.Request.Testall(reqs), check, self.spin_s)
        except self.MPI.Exception as exc:
            raise self.lost(exc) from None
        self.sends.clear()

    def retire_sends(self):
        """Stop waiting for sends a command left pending.

        Called when a command is over on this side: every message a peer still
        wanted has been received by then (its report says so), so a send still
        pending belongs to a collective that a failure abandoned, and the peer
        will never receive it (a large message waits for its receiver).  Its
        request and buffer are kept, tested again later, never waited for.
        """
        if self.sends or self.orphans:
            try:
                self.orphans = [(r, b) for r, b in self.orphans + self.sends if not r.Test()]
            except self.MPI.Exception as exc:
                raise self.lost(exc) from None
            self.sends = []
