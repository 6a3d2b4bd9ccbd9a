"""The leaders' collectives over gloo (``torch.distributed``): the carrier that outlives a lost machine.

The same contract as ``mpi_leaders.MpiLeaders`` (``leaders.Leaders``), so the backend
(mpi_backend.py) and the reductions (mpi_reduce.py) run on either.  gloo's
collectives run on its own threads; every wait here polls the work and
calls the liveness check, so none is unbounded.  A pending collective whose
peer died fails by itself (``Connection closed by peer``) or is left behind
when the controller regroups the machines: every membership change, and
every command that aborted, makes every leader build a fresh process group
on ``PrefixStore(f"m{members}g{gen}")`` of the one store the controller
hosts.  The old group, its work and its buffers are kept, never used again.

torch is imported here only, when a cluster whose machines come and go
starts (``pip install "synkhronos[elastic]"``).
"""

import ctypes
import datetime
import os
import pickle
import struct
import threading
import time

import numpy as np

from ..errors import BackendUnavailableError, SynkError
from ..runtime.liveness import spin_until, wait_until
from .leaders import BROADCAST_HEAD, Leaders, c_order, dumps, loads, nbytes_of, pooled

GLOO_TIMEOUT_S = 60.0   # frees gloo's threads from a collective whose peer went silent
GROUP_TIMEOUT_S = 60.0  # every member builds the new group within this
SPIN_S = 1.0
GLOO_OPS = {"sum": "SUM", "avg": "SUM", "prod": "PRODUCT", "max": "MAX", "min": "MIN"}
# What gloo reduces exactly as NumPy does (float max/min go through the exchange, as under MPI).
GLOO_KINDS = {"sum": "iuf", "avg": "iuf", "prod": "iuf", "max": "iu", "min": "iu"}


def import_torch():
    """torch and its ``torch.distributed``; ``BackendUnavailableError`` naming the extra if missing."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise BackendUnavailableError(
            "machines that come and go (SYNK_LISTEN / SYNK_JOIN) need torch's gloo: pip install "
            f"'synkhronos[elastic]' (the CPU-only torch wheel is enough) ({exc})") from None
    if not dist.is_available() or not dist.is_gloo_available():
        raise BackendUnavailableError("this torch was built without torch.distributed's gloo")
    torch.set_num_threads(1)
    return torch, dist


class GlooLeaders(Leaders):
    """This leader's collectives with the other machines' leaders, over a gloo process group.

    Args:
        store: the run's ``torch.distributed`` store (hosted by the controller).
        host: this machine's address, which the other leaders connect to.
        spin_s: how long waits spin before sleeping.
        lost: ``lost(exc)`` returns the error to raise for a failed collective.
    """

    def __init__(self, store, host, spin_s, lost):
        self.torch, dist = import_torch()
        self.dist = dist
        self.store = store
        self.host = host
        self.spin_s = spin_s
        self.lost = lost
        self.gen = 0          # one more per aborted command (the controller counts)
        self.members = 0      # one more per membership change (the controller counts)
        self.epoch = 0        # groups made so far: buffers given to one are never reused
        self.rank, self.size = 0, 1
        self.pg = None
        self.pending = []
        self.pool = {}
        self.graveyard = []

    # -- the group ------------------------------------------------------------------------
    def regroup(self, rank, size, members, gen, check):
        """Build the group of ``size`` leaders (this one ``rank``) for membership ``members``.

        Every member calls this at the same command boundary; the group is
        built on a thread so that the wait keeps calling ``check``.
        """
        if self.pending:
            _outlive_exit(self.pg, self.pending)
        self.graveyard.append((self.pg, self.pending, self.pool))
        self.pending, self.pool = [], {}
        self.rank, self.size, self.members, self.gen = rank, size, members, gen
        self.epoch += 1
        dist = self.dist
        prefix = f"m{members}g{gen}"
        box = []

        def build():
            try:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
                box.append(dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), rank,
                                                 size, opts))
            except Exception as exc:  # noqa: BLE001 - raised in the waiting thread
                box.append(exc)
        t0 = time.monotonic()
        thread = threading.Thread(target=build, name="synk-gloo-group", daemon=True)
        thread.start()

        def late():
            check()
            if time.monotonic() - t0 > GROUP_TIMEOUT_S:
                raise SynkError(f"the {size} machines did not build their gloo group within "
                                f"{GROUP_TIMEOUT_S:g} s")
        wait_until(lambda: bool(box), late, 0.0, poll_max_s=2e-3)
        if isinstance(box[0], Exception):
            raise self.lost(box[0])
        self.pg = box[0]

    def renew(self, comm, gen):
        """After an aborted command: a fresh group of the same leaders (generation ``gen``)."""
        self.regroup(self.rank, self.size, self.members, gen, _no_check)

    def close(self):
        """At this process's end: work still pending must not hold the exit (``_outlive_exit``)."""
        if self.pending:
            _outlive_exit(self.pg, self.pending)

    def revoke(self):
        """Nothing to revoke: the controller tells every leader to leave (cluster/elastic/door.py)."""

    @staticmethod
    def reduces(op, dtype):
        """Whether gloo's reduction gives NumPy's result (else: exchange partials, combine here)."""
        dtype = np.dtype(dtype)
        if not dtype.isnative or dtype.kind not in GLOO_KINDS[op]:
            return False
        if dtype.kind == "f":
            return dtype.itemsize in (4, 8)
        return dtype.itemsize in ((1,) if dtype.kind == "u" else (1, 4, 8))

    # -- waiting --------------------------------------------------------------------------
    def buffer(self, slot, nbytes):
        """A kept byte buffer for ``slot``: reused while no collective was abandoned."""
        return pooled(self.pool, slot, nbytes)

    def _run(self, check, start):
        """Start the work ``start(pg)`` returns as (works, buffers); wait for every one."""
        if self.pending:
            raise SynkError("a collective between machines was abandoned and the leaders' "
                            "group was not renewed")
        if self.pg is None:
            raise SynkError("the machines' gloo group is not built yet")
        try:
            works, keep = start(self.pg)
        except RuntimeError as exc:
            raise self.lost(exc) from None
        entry = (works, keep)
        self.pending.append(entry)

        def done():
            # gloo's own threads move the bytes: a poll that never yields takes their
            # core wherever a machine has fewer cores than busy threads (one core each:
            # a 1 MB all_reduce ran 3.99 ms spinning, 2.5x bare gloo's).
            os.sched_yield()
            return all(w.is_completed() for w in works)
        if not spin_until(done, check, max(self.spin_s, SPIN_S)):
            wait_until(done, check, 0.0)
        try:
            for w in works:
                w.wait()  # raises what failed it (a peer gone: "Connection closed by peer")
        except RuntimeError as exc:
            raise self.lost(exc) from None
        self.pending.remove(entry)

    def _t(self, a):
        return self.torch.from_numpy(a)

    # -- collectives ------------------------------------------------------------------------
    def barrier(self, check):
        one = np.zeros(1, np.uint8)
        self._run(check, lambda pg: ([pg.allreduce([self._t(one)])], [one]))

    def all_reduce_kept(self, sends, check):
        """Reduce each ``(buffer, op)`` in place across leaders (``Leaders.all_reduce_kept``)."""
        dist = self.dist

        def start(pg):
            works = []
            for buf, op in sends:
                opts = dist.AllreduceOptions()
                opts.reduceOp = getattr(dist.ReduceOp, GLOO_OPS[op])
                works.append(pg.allreduce([self._t(buf)], opts))
            return works, sends
        self._run(check, start)

    def all_reduce(self, sends, check):
        """Reduce each ``(array, op, into)`` across leaders; per array the buffer holding the result."""
        dist = self.dist
        recvs = []

        def start(pg):
            works = []
            for i, (a, op, into) in enumerate(sends):
                buf = into.reshape(-1) if into is not None else \
                    self.buffer(("r", i), a.nbytes).view(a.dtype)
                if not np.may_share_memory(buf, a):
                    np.copyto(buf, a.reshape(-1))
                opts = dist.AllreduceOptions()
                opts.reduceOp = getattr(dist.ReduceOp, GLOO_OPS[op])
                works.append(pg.allreduce([self._t(buf)], opts))
                recvs.append(buf.view(np.uint8) if into is None else buf)
            return works, [s[0] for s in sends] + recvs
        self._run(check, start)
        return recvs

    def all_gather_fixed(self, mine, check):
        """Every leader's ``mine`` (uint8, the same length everywhere), machine-major."""
        got = self.buffer("g", mine.nbytes * self.size).reshape(self.size, mine.nbytes)
        outs = [self._t(got[i]) for i in range(self.size)]
        self._run(check, lambda pg: ([pg.allgather([outs], [self._t(mine)])], [mine, got]))
        return got

    def _bcast(self, buf, root, check):
        opts = self.dist.BroadcastOptions()
        opts.rootRank = root
        self._run(check, lambda pg: ([pg.broadcast([self._t(buf)], opts)], [buf]))

    def broadcast(self, arrays, root, check):
        """The ``root`` machine's arrays on every leader (views of kept buffers off the root)."""
        head = self.buffer("bh", BROADCAST_HEAD)
        if self.rank == root:
            arrays = [c_order(a) for a in arrays]
            meta = pickle.dumps([(a.dtype.str, a.shape) for a in arrays], protocol=5)
            blob = np.frombuffer(meta, np.uint8)
            struct.pack_into("q", head, 0, len(meta))
            fits = 8 + len(meta) <= BROADCAST_HEAD
            if fits:
                head[8:8 + len(meta)] = blob
            self._bcast(head, root, check)
            if not fits:
                self._bcast(blob.copy(), root, check)
            for a in arrays:
                if a.nbytes:
                    raw = a.reshape(-1).view(np.uint8)
                    self._bcast(raw if raw.flags.writeable else raw.copy(), root, check)
            return arrays
        self._bcast(head, root, check)
        n_meta = struct.unpack_from("q", head)[0]
        if 8 + n_meta <= BROADCAST_HEAD:
            meta = bytes(head[8:8 + n_meta])
        else:
            buf = self.buffer("bm", n_meta)
            self._bcast(buf, root, check)
            meta = bytes(buf)
        out = []
        for i, (d, s) in enumerate(pickle.loads(meta)):
            b = self.buffer(("b", i), nbytes_of(d, s))
            if b.nbytes:
                self._bcast(b, root, check)
            out.append(b.view(np.dtype(d)).reshape(s))
        return out

    def all_gather(self, obj, check):
        """Every leader's ``obj`` (arrays, lists, None...), in machine order."""
        mine = dumps(obj)
        sizes = self.all_gather_fixed(np.array([mine.nbytes], np.int64).view(np.uint8), check)
        counts = [int(c) for c in sizes.copy().view(np.int64).reshape(-1)]
        padded = np.zeros(max(counts), np.uint8)
        padded[:mine.nbytes] = mine
        every = self.all_gather_fixed(padded, check)
        return [loads(every[m, :c]) for m, c in enumerate(counts)]

    def gather(self, obj, root, check):
        """Every leader's ``obj`` at the ``root`` machine (None elsewhere); gloo's all-gather."""
        every = self.all_gather(obj, check)
        return every if self.rank == root else None

    def scatter(self, objs, root, check):
        """Machine m's entry of the root's ``objs`` (one per machine), on every leader."""
        got = self.broadcast([dumps(objs)] if self.rank == root else None, root, check)
        return loads(got[0])[self.rank]


def _no_check():
    pass


def _outlive_exit(pg, pending):
    """Keep a group with abandoned work (and the work, and its buffers) alive for good.

    Its destructor joins gloo's threads, which wait up to ``GLOO_TIMEOUT_S``
    for a peer that went silent (a cut cable): at the interpreter's end that
    held the controller's exit for a minute.  With one more reference the
    destructor never runs; the process ends with those threads (measured: 60 s
    at exit without this, under 1 s with it; ``pg.abort()`` does not free them).
    """
    for obj in (pg, *[w for works, _ in pending for w in works],
                *[b for _, keep in pending for b in keep]):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
