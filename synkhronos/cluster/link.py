"""The link between machines: control messages, and the leaders' collectives (MPI's carrier).

``LinkBase`` holds what does not depend on the carrier (pickled messages
with out-of-band buffers, bounded waits, kept receive buffers); ``Link``
carries them over MPI, ``cluster.zlink.ZmqLink`` over ZeroMQ (clusters
whose machines come and go, cluster/elastic.py).

Commands, reports, aborts and Data writes travel as point-to-point messages
on the job's communicator, by tag; collectives between machines run on the
leaders' own communicator (``comm.mpi_leaders.MpiLeaders``), which an aborted
command makes every leader replace (``renew``).  Every wait here is a loop
over ``Improbe`` or ``Test`` that keeps calling a liveness check, so none
waits without a bound.  Messages are pickled with large buffers out of band
(sent as they are, not copied).
"""

import os
import pickle
import struct
import time
from abc import ABC, abstractmethod

from ..comm.leaders import pooled
from ..comm.mpi_leaders import MpiLeaders
from ..errors import MachineLostError, SynkError
from ..runtime.liveness import CHECK_EVERY_S, spin_until, wait_until
from . import recovery
from .launch import finalize

# Tags of the messages between the controller and node masters.
CMD, REPORT, ABORT, DATA, DONE = 1, 2, 3, 4, 5   # DONE: a report of nothing but success
OUTPUTS = 6  # a report of success with small contributions, packed (cluster/reports.py)
REPORTS = (DONE, OUTPUTS, REPORT)  # what a node master sends the controller, most frequent first
CMD_HEAD = struct.Struct("qq")  # a forwarded command opens with (its number, the leaders' generation)
INBAND_BYTES = 1 << 16   # smaller buffers travel inside the pickle
POOL_BYTES = 1 << 16     # received buffers this large are reused (Link._buffer)
YIELD_SPIN_S = 2e-3  # where cores are shared, how long a wait polls (yielding) before sleeping


class LinkBase(ABC):
    """The link between machines: pickled messages over a carrier's bytes, and bounded waits.

    A carrier (``Link`` over MPI, ``zlink.ZmqLink`` over ZeroMQ) implements the
    abstract methods below; ``layout``, ``node``, ``others``, ``seq``, ``spin_s``
    and ``leaders`` (its ``comm.leaders.Leaders``) are its attributes.
    """

    pool: dict

    @abstractmethod
    def send_bytes(self, dest, tag, buf):
        """Send ``buf`` to machine ``dest`` under ``tag`` (completed by ``complete_sends``)."""

    @abstractmethod
    def probe(self, src, tag):
        """``(message, size in bytes)`` of a message from ``src`` with ``tag`` that arrived, or None."""

    @abstractmethod
    def receive(self, message, buf, src):
        """Receive a probed ``message`` from ``src`` into ``buf`` (its size)."""

    @abstractmethod
    def complete_sends(self, check):
        """Return once every send so far has left this process (``check`` while waiting)."""

    @abstractmethod
    def retire_sends(self):
        """Forget the sends that completed."""

    @abstractmethod
    def begin(self, seq):
        """Command ``seq`` starts."""

    @abstractmethod
    def renew(self, gen):
        """Every leader leaves the leaders' collectives' current generation for ``gen``."""

    @abstractmethod
    def lost(self, exc, machine=None):
        """The error to raise for a carrier failure ``exc`` (a machine lost)."""

    @abstractmethod
    def survives(self):
        """Whether the carrier lets the run go on after a machine is lost."""

    @abstractmethod
    def shrink(self, done_seq, lost=None):
        """Go on with the machines left after a loss; ``done_seq``: the last command finished."""

    @abstractmethod
    def finish(self):
        """At the run's end: release the carrier."""

    def send(self, dest, tag, obj):
        """Send ``obj`` (pickled; large buffers out of band, not copied) to machine ``dest``."""
        bufs = []
        head = pickle.dumps(obj, protocol=5, buffer_callback=lambda b: _inband(b, bufs))
        self.send_bytes(dest, tag, struct.pack("q", len(bufs)) + head)
        for b in bufs:
            self.send_bytes(dest, tag, b.raw())

    def probe_any(self, src, tags):
        """Return (message, size in bytes, tag) of the first message from ``src`` with one of ``tags``.

        None if none has arrived.  ``tags`` must name every tag ``src`` may send
        this process (a carrier may match any message from it).
        """
        for tag in tags:
            got = self.probe(src, tag)
            if got is not None:
                return got[0], got[1], tag
        return None

    def _wait_probe(self, src, tag, check, doorbell=None):
        box = []

        def arrived():
            got = self.probe(src, tag)
            if got is None:
                return False
            box.append(got)
            return True
        self.wait(arrived, check, doorbell)
        return box[0]

    def wait(self, pred, check, doorbell=None):
        """Return once ``pred()`` is true, calling ``check`` (``wait_for`` at this link's spin)."""
        wait_for(pred, check, self.spin_s, doorbell)

    def recv_bytes(self, src, tag, check, slot=None, doorbell=None):
        """Receive one message's bytes (into a kept buffer when ``slot`` is given).

        ``doorbell``: what the wait blocks on once it has spun (``wait``).
        """
        m, n = self._wait_probe(src, tag, check, doorbell)
        buf = self._buffer(src, slot, n)
        self.receive(m, buf, src)
        return buf

    def _buffer(self, src, slot, n):
        """A receive buffer: large ones are kept per (sender, place in message, size).

        Fresh memory costs a page fault per 4 KiB at every call (about as much
        as the transfer itself); what was received is only valid until the
        next collective (the backend contract), so the buffer can be reused.
        """
        if slot is None or n < POOL_BYTES:
            return bytearray(n)
        return pooled(self.pool, (src, slot), n)

    def recv_into(self, src, tag, buf, check):
        """Receive raw bytes from machine ``src`` into ``buf`` (a writable buffer of their size)."""
        m, n = self._wait_probe(src, tag, check)
        if n != len(buf):
            raise SynkError(f"expected {len(buf)} bytes from machine {src}, got {n}")
        self.receive(m, buf, src)

    def rest(self, src, tag, head, check, pooled):
        """Unpickle a message from its head, receiving its out-of-band buffers.

        ``pooled``: receive them into kept buffers (results valid until the
        next collective), not for what must outlive the command.
        """
        n_bufs = struct.unpack_from("q", head)[0]
        bufs = [self.recv_bytes(src, tag, check, slot=i if pooled else None)
                for i in range(n_bufs)]
        return pickle.loads(memoryview(head)[8:], buffers=bufs)


class Link(LinkBase):
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


def _inband(buf, out):
    if buf.raw().nbytes < INBAND_BYTES:
        return True
    out.append(buf)
    return False


def wait_for(pred, check, spin_s, doorbell=None):
    """Return once ``pred()`` is true, calling ``check``: every link's wait for a message.

    Where cores are shared (``spin_s`` 0) a wait sleeps between polls, and
    each sleep delays the peer's next message by as much: first poll for
    a while, yielding the core to whoever runs beside this process.  With
    a ``doorbell`` (doorbell.Doorbell, a node master between commands), a
    wait that spun in vain blocks on it instead of sleeping: the
    controller rings it before the message comes.
    """
    spin = pred
    if spin_s == 0:
        def spin():
            os.sched_yield()
            return pred()
        if spin_until(spin, check, YIELD_SPIN_S):
            return
    if doorbell is None:
        wait_until(pred, check, spin_s)
        return
    if spin_until(pred, check, spin_s):
        return
    next_check = time.perf_counter() + CHECK_EVERY_S
    while True:
        if doorbell.wait(CHECK_EVERY_S):
            # Rung: the message follows within microseconds.
            if spin_until(spin, check, YIELD_SPIN_S):
                return
        elif pred():
            return
        now = time.perf_counter()
        if now > next_check:
            check()
            next_check = now + CHECK_EVERY_S
