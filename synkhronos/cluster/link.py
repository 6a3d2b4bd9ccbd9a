"""The MPI link between machines: tags, sends, receives, and sends that a failure left behind.

Every wait here is a loop over ``Improbe`` or ``Test`` that keeps calling a
liveness check, so none waits without a bound.  Messages are pickled with
large buffers out of band (sent as they are, not copied); a reduction's small
partial travels in a compact form that unpickles fast.
"""

import pickle
import struct

import numpy as np

from ..errors import MachineLostError, SynkError
from ..liveness import wait_until

# Tags of the messages between the controller and node masters.
CMD, REPORT, ABORT, DATA, DONE = 1, 2, 3, 4, 5   # DONE: a report of nothing but success
TAG_BASE = 64            # collectives: TAG_BASE + (seq * PER_CMD + k) % tag_span
PER_CMD = 256
INBAND_BYTES = 1 << 16   # smaller buffers travel inside the pickle
POOL_BYTES = 1 << 16     # received buffers this large are reused (Link._buffer)
POOL_MAX = 64
PACKED = -1  # first word of a compact partial (a pickled message starts with its buffer count)
_PACKED_HEAD = struct.pack("q", PACKED)


class Link:
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
        self.seq = 0           # the current command's number: tags of its messages
        self.k = 0             # the collective within the command
        self.sends = []        # (request, buffer) not yet known complete
        self.orphans = []      # (request, buffer) of sends an aborted command left behind
        self.pool = {}         # reused receive buffers
        self.graveyard = []    # (communicator, sends) given up after a machine was lost
        span = int(mpi.COMM_WORLD.Get_attr(mpi.TAG_UB)) - TAG_BASE
        self.tag_span = max(PER_CMD, span - span % PER_CMD)

    def begin(self, seq):
        """Start command ``seq``: its collectives' tags count from here."""
        self.seq = seq
        self.k = 0

    def next_tag(self):
        """A fresh tag for one collective of the current command (the same on every machine)."""
        self.k += 1
        return TAG_BASE + (self.seq * PER_CMD + self.k) % self.tag_span

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

    def send_bytes(self, dest, tag, buf):
        """Send ``buf`` as it is (kept alive until the send completes)."""
        try:
            self.sends.append((self.comm.Isend(buf, dest, tag), buf))
        except self.MPI.Exception as exc:
            raise self.lost(exc, dest) from None

    def send(self, dest, tag, obj):
        """Send ``obj`` (pickled; large buffers out of band, not copied) to machine ``dest``.

        A reduction's partial, ``(list of small arrays, float)``, travels in a
        compact form instead: pickling arrays costs several microseconds each way.
        """
        packed = _pack_partial(obj)
        if packed is not None:
            self.send_bytes(dest, tag, packed)
            return
        bufs = []
        head = pickle.dumps(obj, protocol=5, buffer_callback=lambda b: _inband(b, bufs))
        self.send_bytes(dest, tag, struct.pack("q", len(bufs)) + head)
        for b in bufs:
            self.send_bytes(dest, tag, b.raw())

    def probe(self, src, tag):
        """Return (message, size in bytes) if one from ``src`` with ``tag`` has arrived, else None."""
        st = self.MPI.Status()
        try:
            m = self.comm.Improbe(src, tag, st)
        except self.MPI.Exception as exc:
            raise self.lost(exc, src) from None
        return None if m is None else (m, st.Get_count(self.MPI.BYTE))

    def _wait_probe(self, src, tag, check):
        box = []

        def arrived():
            got = self.probe(src, tag)
            if got is None:
                return False
            box.append(got)
            return True
        wait_until(arrived, check, self.spin_s)
        return box[0]

    def recv_bytes(self, src, tag, check, slot=None):
        """Receive one message's bytes (into a kept buffer when ``slot`` is given)."""
        m, n = self._wait_probe(src, tag, check)
        buf = self._buffer(src, slot, n)
        self.receive(m, buf, src)
        return buf

    def receive(self, message, buf, src):
        """Receive a probed ``message`` from machine ``src`` into ``buf``."""
        try:
            message.Recv(buf)
        except self.MPI.Exception as exc:
            raise self.lost(exc, src) from None

    def _buffer(self, src, slot, n):
        """A receive buffer: large ones are kept per (sender, place in message, size).

        Fresh memory costs a page fault per 4 KiB at every call (about as much
        as the transfer itself); what was received is only valid until the
        next collective (the backend contract), so the buffer can be reused.
        """
        if slot is None or n < POOL_BYTES:
            return bytearray(n)
        key = (src, slot, n)
        buf = self.pool.get(key)
        if buf is None:
            if len(self.pool) >= POOL_MAX:
                self.pool.clear()
            buf = self.pool[key] = bytearray(n)
        return buf

    def recv_into(self, src, tag, buf, check):
        """Receive raw bytes from machine ``src`` into ``buf`` (a writable buffer of their size)."""
        m, n = self._wait_probe(src, tag, check)
        if n != len(buf):
            raise SynkError(f"expected {len(buf)} bytes from machine {src}, got {n}")
        self.receive(m, buf, src)

    def recv(self, src, tag, check):
        """Receive what ``send`` sent from machine ``src`` with ``tag``."""
        return self.rest(src, tag, self.recv_bytes(src, tag, check), check, pooled=True)

    def rest(self, src, tag, head, check, pooled):
        """Unpickle a message from its head, receiving its out-of-band buffers.

        ``pooled``: receive them into kept buffers (results valid until the
        next collective), not for what must outlive the command.
        """
        n_bufs = struct.unpack_from("q", head)[0]
        if n_bufs == PACKED:
            return _unpack_partial(head)
        bufs = [self.recv_bytes(src, tag, check, slot=i if pooled else None)
                for i in range(n_bufs)]
        return pickle.loads(memoryview(head)[8:], buffers=bufs)

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


def _pack_partial(obj):
    """``(arrays, mass)`` with small plain arrays, as bytes that unpickle fast; else None.

    Arrays as (dtype, shape, bytes) tuples pickle and unpickle in ~3 us, where
    pickling the arrays themselves costs ~12 us.
    """
    if type(obj) is not tuple or len(obj) != 2 or type(obj[0]) is not list \
            or not isinstance(obj[1], float):
        return None
    items = []
    total = 0
    for a in obj[0]:
        if type(a) is not np.ndarray or a.dtype.hasobject:
            return None
        total += a.nbytes
        if total > INBAND_BYTES:
            return None
        items.append((a.dtype.str, a.shape, a.tobytes()))
    return _PACKED_HEAD + pickle.dumps((items, obj[1]), protocol=5)


def _unpack_partial(buf):
    items, mass = pickle.loads(memoryview(buf)[8:])
    return [np.frombuffer(raw, d).reshape(shape) for d, shape, raw in items], mass
