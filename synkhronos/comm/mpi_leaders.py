"""The leaders' communicator: MPI's own non-blocking collectives between machines, and its reset.

Between machines only the leaders (the controller and the node masters) talk.
They reduce, broadcast, gather and scatter through the MPI library's
non-blocking collectives (``Iallreduce``, ``Ibcast``, ``Iallgatherv``, ...),
whose algorithms (ring, recursive halving) scale with the number of machines
as a hand-written exchange cannot.  Every wait polls the request and calls
the liveness check, so none is unbounded.

An MPI collective cannot be cancelled: when a failure abandons one (a rank
raised, the controller ordered ABORT), the leaders that entered it leave it
pending, and the next collective on the same communicator would pair with
it.  So the collectives run on a duplicate of the job's communicator, and a
command that ended aborted anywhere makes every leader swap in a fresh
duplicate at the start of the next command (the controller counts
generations and sends the number with every command, cluster/controller.py);
``Idup`` is itself a collective on the point-to-point communicator, called
by every leader at that same command boundary, so it matches nothing else.
The old communicator, its requests and every buffer they name are kept,
never freed: MPI may still read or write them.  For the same reason results
arrive in buffers kept here and are copied out, never into the caller's
arrays directly.
"""

import os
import pickle
import struct

import numpy as np

from ..errors import SynkError
from ..runtime.liveness import deadline_check, spin_until, wait_until
from .leaders import BROADCAST_HEAD, Leaders, c_order, dumps, loads, nbytes_of, pooled

START_TIMEOUT_S = 60.0
MPI_SPIN_S = 1.0    # how long a leader polls a collective without sleeping
# Dtype kinds MPI reduces exactly as NumPy does, per op.  Float max/min are left to
# the exchange: MPI's C comparison keeps whichever operand came first for NaN and
# for +0/-0, so leaders could disagree on a bit where np.maximum does not.
MPI_KINDS = {"sum": "iuf", "avg": "iuf", "prod": "iuf", "max": "iu", "min": "iu"}
MPI_OPS = {"sum": "SUM", "avg": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN"}


def mpi_reduces(op, dtype):
    """Whether MPI's own reduction gives NumPy's result (else: exchange partials, combine here)."""
    dtype = np.dtype(dtype)
    return (dtype.kind in MPI_KINDS[op] and dtype.isnative
            and dtype.itemsize in ((4, 8) if dtype.kind == "f" else (1, 2, 4, 8)))



class MpiLeaders(Leaders):
    """This leader's collectives with the other machines' leaders.

    Args:
        mpi: the ``mpi4py.MPI`` module.
        comm: the job's point-to-point communicator (every leader, machine order).
        spin_s: how long waits spin before sleeping.
        lost: ``lost(exc)`` returns the error to raise for an MPI failure.
    """

    def __init__(self, mpi, comm, spin_s, lost):
        self.MPI = mpi
        self.spin_s = spin_s
        self.lost = lost
        self.gen = 0          # the communicator's generation: one more per aborted command
        self.comm = None
        self.dup_req = None   # the Idup that makes ``comm``, until it completes
        self.pending = []     # (requests, buffers) started and not seen complete
        self.pool = {}
        self.graveyard = []   # what abandoned communicators' requests may still touch
        self.epoch = 0        # renewals so far: buffers given to MPI before one are never reused
        self._dup(comm)
        # Made at once, while every process of the job meets: a duplicate still pending
        # would hold back the next collective on ``comm`` behind a peer that makes no
        # MPI call meanwhile (the controller waits for its sentinels' connections).
        self.wait([self.dup_req], [], deadline_check(
            START_TIMEOUT_S, f"the leaders' communicator was not made within {START_TIMEOUT_S:g} s"))
        self.dup_req = None

    def _dup(self, comm):
        try:
            self.comm, self.dup_req = comm.Idup()
        except self.MPI.Exception as exc:
            raise self.lost(exc) from None
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    reduces = staticmethod(mpi_reduces)

    def renew(self, comm, gen):
        """Abandon the current communicator for a fresh duplicate of ``comm``; every leader at once.

        Called by every leader at the same command boundary (generation
        ``gen``), or after the survivors of a lost machine shrank ``comm``.
        """
        self.graveyard.append((self.comm, self.dup_req, self.pending, self.pool))
        self.pending, self.pool = [], {}
        self.gen = gen
        self.epoch += 1
        self._dup(comm)

    def revoke(self):
        """Under ULFM: make every leader's pending collective fail (a machine was lost)."""
        try:
            self.comm.Revoke()
        except Exception:  # noqa: BLE001 - revoked already, or an MPI without ULFM: nothing to end
            pass

    # -- waiting -------------------------------------------------------------------------
    def _ready(self, check):
        """The communicator, once made; raises if a collective was left behind without a reset."""
        if self.pending:
            raise SynkError("a collective between machines was abandoned and the leaders' "
                            "communicator was not renewed")
        if self.dup_req is not None:
            self.wait([self.dup_req], [], check)
            self.dup_req = None
        return self.comm

    def wait(self, reqs, keep, check):
        """Wait for ``reqs``, calling ``check``; ``keep``: the buffers they use."""
        MPI = self.MPI
        entry = (reqs, keep)
        self.pending.append(entry)
        shared_cores = self.spin_s == 0

        def done():
            if shared_cores:
                os.sched_yield()  # let the process this one waits for run
            return MPI.Request.Testall(reqs)
        try:
            # MPI moves a collective's later rounds only while its processes call into
            # it: a waiter that sleeps between polls stretches every round (bare MPI
            # spins throughout).  So spin, longer than other waits do, then sleep.
            if not spin_until(done, check, max(self.spin_s, MPI_SPIN_S)):
                wait_until(done, check, 0.0)
        except MPI.Exception as exc:
            raise self.lost(exc) from None
        self.pending.remove(entry)

    def buffer(self, slot, nbytes):
        """A kept byte buffer for ``slot``: reused while no collective was abandoned."""
        return pooled(self.pool, slot, nbytes)

    def _run(self, check, start):
        """Start the requests ``start(comm)`` returns as (requests, buffers); wait for them."""
        comm = self._ready(check)
        try:
            reqs, keep = start(comm)
        except self.MPI.Exception as exc:
            raise self.lost(exc) from None
        self.wait(reqs, keep, check)

    # -- collectives ---------------------------------------------------------------------
    def barrier(self, check):
        self._run(check, lambda comm: ([comm.Ibarrier()], []))

    def all_reduce(self, sends, check):
        """Reduce each ``(array, op, into)`` (MPI-reducible, alike on every leader) across leaders.

        ``into``: where the result goes, a buffer MPI may own until this
        communicator is renewed (None: one kept here).  Returns per array the
        buffer holding the reduced bytes (the same bytes on every leader).
        """
        MPI = self.MPI
        recvs = []

        def start(comm):
            reqs = []
            for i, (a, op, into) in enumerate(sends):
                mpi_op = getattr(MPI, MPI_OPS[op])
                if into is not None:
                    buf = into.reshape(-1)
                    reqs.append(comm.Iallreduce(a.reshape(-1), buf, mpi_op))
                else:
                    buf = self.buffer(("r", i), a.nbytes)
                    if _owned(a, buf):
                        reqs.append(comm.Iallreduce(MPI.IN_PLACE, buf.view(a.dtype), mpi_op))
                    else:
                        reqs.append(comm.Iallreduce(a.reshape(-1), buf.view(a.dtype), mpi_op))
                recvs.append(buf)
            return reqs, [s[0] for s in sends] + recvs
        self._run(check, start)
        return recvs

    def all_reduce_kept(self, sends, check):
        """Reduce each ``(buffer, op)`` in place across leaders: buffers the caller keeps.

        The latency path's collective (comm/mpi_small.py): the same
        ``Iallreduce`` calls as ``all_reduce`` makes for packed buffers, without
        its look-ups.  The caller must not give a buffer again after the
        communicator was renewed (``epoch``): an abandoned collective may still
        write it.
        """
        MPI = self.MPI
        comm = self._ready(check)
        try:
            reqs = [comm.Iallreduce(MPI.IN_PLACE, buf, getattr(MPI, MPI_OPS[op]))
                    for buf, op in sends]
        except MPI.Exception as exc:
            raise self.lost(exc) from None
        self.wait(reqs, sends, check)

    def all_gather_fixed(self, mine, check):
        """Every leader's ``mine`` (uint8, the same length everywhere), machine-major."""
        got = self.buffer("g", mine.nbytes * self.size)
        self._run(check, lambda comm: ([comm.Iallgather(mine, got)], [mine, got]))
        return got.reshape(self.size, mine.nbytes)

    def broadcast(self, arrays, root, check):
        """The ``root`` machine's arrays on every leader (views of kept buffers off the root)."""
        head = self.buffer("bh", BROADCAST_HEAD)
        me = self.rank
        if me == root:
            arrays = [c_order(a) for a in arrays]
            meta = pickle.dumps([(a.dtype.str, a.shape) for a in arrays], protocol=5)
            total = sum(a.nbytes for a in arrays)
            inline = 16 + len(meta) + total <= BROADCAST_HEAD
            struct.pack_into("qq", head, 0, len(meta), inline)
            if 16 + len(meta) <= BROADCAST_HEAD:
                head[16:16 + len(meta)] = np.frombuffer(meta, np.uint8)
            if inline:
                _pack_into(head, 16 + len(meta), arrays)

            def start(comm):
                reqs = [comm.Ibcast(head, root)]
                if 16 + len(meta) > BROADCAST_HEAD:
                    reqs.append(comm.Ibcast(np.frombuffer(meta, np.uint8), root))
                if not inline:
                    reqs += [comm.Ibcast(a.reshape(-1).view(np.uint8), root)
                             for a in arrays if a.nbytes]
                return reqs, [head, meta, arrays]
            self._run(check, start)
            return arrays
        self._run(check, lambda comm: ([comm.Ibcast(head, root)], [head]))
        n_meta, inline = struct.unpack_from("qq", head)
        if 16 + n_meta <= BROADCAST_HEAD:
            meta = bytes(head[16:16 + n_meta])
        else:
            buf = self.buffer("bm", n_meta)
            self._run(check, lambda comm: ([comm.Ibcast(buf, root)], [buf]))
            meta = bytes(buf)
        layout = pickle.loads(meta)
        if inline:
            return _unpack(head, 16 + n_meta, layout)
        bufs = [self.buffer(("b", i), nbytes_of(d, s)) for i, (d, s) in enumerate(layout)]
        self._run(check, lambda comm: (
            [comm.Ibcast(b, root) for b in bufs if b.nbytes], bufs))
        return [b.view(np.dtype(d)).reshape(s) for b, (d, s) in zip(bufs, layout)]

    def all_gather(self, obj, check):
        """Every leader's ``obj`` (arrays, lists, None...), in machine order."""
        mine = dumps(obj)
        sizes = self.buffer("as", 8 * self.size).view(np.int64)
        self._run(check, lambda comm: (
            [comm.Iallgather(np.array([mine.nbytes], np.int64), sizes)], [sizes]))
        counts = [int(c) for c in sizes]
        got = self.buffer("ag", sum(counts))
        displs = np.cumsum([0] + counts[:-1]).tolist()
        self._run(check, lambda comm: (
            [comm.Iallgatherv(mine, [got, counts, displs, self.MPI.BYTE])], [mine, got]))
        return [loads(got[d:d + c]) for d, c in zip(displs, counts)]

    def gather(self, obj, root, check):
        """Every leader's ``obj`` at the ``root`` machine (None elsewhere)."""
        MPI = self.MPI
        mine = dumps(obj)
        me_root = self.rank == root
        sizes = self.buffer("gs", 8 * self.size).view(np.int64)
        self._run(check, lambda comm: (
            [comm.Igather(np.array([mine.nbytes], np.int64), sizes if me_root else None, root)],
            [sizes]))
        if not me_root:
            self._run(check, lambda comm: ([comm.Igatherv(mine, None, root)], [mine]))
            return None
        counts = [int(c) for c in sizes]
        got = self.buffer("gg", sum(counts))
        displs = np.cumsum([0] + counts[:-1]).tolist()
        self._run(check, lambda comm: (
            [comm.Igatherv(mine, [got, counts, displs, MPI.BYTE], root)], [mine, got]))
        return [loads(got[d:d + c]) for d, c in zip(displs, counts)]

    def scatter(self, objs, root, check):
        """Machine m's entry of the root's ``objs`` (one per machine), on every leader."""
        MPI = self.MPI
        me_root = self.rank == root
        size = self.buffer("ss", 8).view(np.int64)
        if me_root:
            msgs = [dumps(o) for o in objs]
            counts = [m.nbytes for m in msgs]
            whole = np.concatenate(msgs) if msgs else np.empty(0, np.uint8)
            displs = np.cumsum([0] + counts[:-1]).tolist()
            sizes = np.array(counts, np.int64)
            self._run(check, lambda comm: ([comm.Iscatter(sizes, size, root)], [sizes, size]))
        else:
            self._run(check, lambda comm: ([comm.Iscatter(None, size, root)], [size]))
        got = self.buffer("sg", int(size[0]))
        if me_root:
            self._run(check, lambda comm: (
                [comm.Iscatterv([whole, counts, displs, MPI.BYTE], got, root)], [whole, got]))
        else:
            self._run(check, lambda comm: ([comm.Iscatterv(None, got, root)], [got]))
        return loads(got)


def _owned(a, buf):
    """Whether ``a`` is ``buf``'s memory (then it is reduced in place)."""
    return a.base is buf or (a.nbytes > 0 and a.ctypes.data == buf.ctypes.data
                             and a.nbytes == buf.nbytes)


def _pack_into(buf, at, arrays):
    for a in arrays:
        buf[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)
        at += a.nbytes


def _unpack(buf, at, layout):
    out = []
    for d, s in layout:
        n = nbytes_of(d, s)
        out.append(buf[at:at + n].view(np.dtype(d)).reshape(s))
        at += n
    return out
