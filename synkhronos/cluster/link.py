"""The link between machines: the contract every carrier keeps, and what they share.

``LinkBase`` holds what does not depend on the carrier (pickled messages
with out-of-band buffers, bounded waits, kept receive buffers) and names
what a carrier must do; ``mpi_link.MpiLink`` carries it over MPI,
``elastic.zmq_link.ZmqLink`` over ZeroMQ (clusters whose machines come and
go, cluster/elastic/).  tests/cluster/test_link.py runs every carrier
against the same expectations.

Commands, reports, aborts and Data writes travel as point-to-point messages
by tag (below); collectives between machines run on the leaders' own
``comm.leaders.Leaders``, which an aborted command makes every leader replace
(``renew``).  Every wait here is a loop that keeps calling a liveness check,
so none waits without a bound.  Messages are pickled with large buffers out
of band (sent as they are, not copied).
"""

import os
import pickle
import struct
import time
from abc import ABC, abstractmethod

from ..comm.leaders import pooled
from ..errors import SynkError
from ..runtime.liveness import CHECK_EVERY_S, spin_until, wait_until

# Tags of the messages between the controller and node masters.
CMD, REPORT, ABORT, DATA, DONE = 1, 2, 3, 4, 5   # DONE: a report of nothing but success
OUTPUTS = 6  # a report of success with small contributions, packed (cluster/reports.py)
REPORTS = (DONE, OUTPUTS, REPORT)  # what a node master sends the controller, most frequent first
CMD_HEAD = struct.Struct("qq")  # a forwarded command opens with (its number, the leaders' generation)
INBAND_BYTES = 1 << 16   # smaller buffers travel inside the pickle
POOL_BYTES = 1 << 16     # received buffers this large are reused (LinkBase._buffer)
YIELD_SPIN_S = 2e-3  # where cores are shared, how long a wait polls (yielding) before sleeping


class LinkBase(ABC):
    """The link between machines: pickled messages over a carrier's bytes, and bounded waits.

    A carrier (``MpiLink`` over MPI, ``ZmqLink`` over ZeroMQ) implements the
    abstract methods below; ``layout``, ``node``, ``others``, ``seq``, ``spin_s``
    and ``leaders`` (its ``comm.leaders.Leaders``) are its attributes.

    What every carrier promises (tests/cluster/test_link.py runs each one
    against it): messages from one machine under one tag arrive in the order
    sent, and apart from those under other tags; a probe returns at once, and
    what it found is for ``receive`` (MPI's matched probe takes it); a buffer
    sent may be reused once ``complete_sends`` returned; a retired send is
    never waited for, and still arrives; a carrier's failure becomes a
    ``MachineLostError`` naming the machine (``lost``).
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
    def news(self):
        """Node master: whether the controller regrouped the machines (a change to follow)."""

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
