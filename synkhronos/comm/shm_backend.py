"""Shared-memory backend: collectives over per-rank slabs of POSIX shared memory.

Each rank owns one slab.  A collective packs this rank's arrays into its slab
(a small int64 header, then the data), meets the other ranks at a barrier, and
reads what it needs straight out of the others' slabs: no pickling and no
socket on the data path.  Barriers spin on per-rank epoch counters in a
shared control block.  The reductions are in ``shm_reduce`` (``ShmReduce``,
mixed in here); broadcast, gather, scatter and the results of calls are here.

A slab is reused from one collective to the next.  Instead of a barrier at
the end of every collective (so nobody overwrites a slab still being read),
the next collective of the same command starts with one; the command's own
end barrier covers the last.
"""

import functools
import logging

import numpy as np

from ..runtime._block import GE, Block
from ..runtime.liveness import wait_slots
from ..runtime.shmem import SharedArray
from . import parts
from ._reduce import (SMALL_CODES, combine_outputs, combine_scalar_array, combine_scalars, pack_one,
                      put_scalar, put_scalar_array)
from .base import SPLIT_BYTES, Backend
from .homes import Homes
from .reduce_ops import OP_CODES
from .shm_reduce import ShmReduce
from .slabs import (EPOCH, EPOCH_WAITERS, GEN, MADV_POPULATE_WRITE, SCALAR_CODE, SCALAR_SEQ,
                    SCALAR_VALUE, SCALAR_WEIGHT, STRIDE, Slabs, dtype_of, populate)

# A contribution of one float scalar (a loss) travels in the control block.
SCALAR_CHARS = "efd"
# One small output array (a gradient of a few parameters) is packed and combined in C.
SMALL_OUTPUT_BYTES = 1 << 14

logger = logging.getLogger(__name__)


class ShmBackend(ShmReduce, Backend):
    """Collectives through shared memory; the default between processes of one machine."""

    def __init__(self, wiring):
        super().__init__(wiring)
        n = self.n_parallel
        self.block = SharedArray(wiring.new_name("comm"), 8 * STRIDE * n)
        self.mv = memoryview(self.block.buffer).cast("q")
        self.fv = memoryview(self.block.buffer).cast("d")  # the same slots, as float64
        self.fast = Block(self.block.buffer)  # its waits, wake-ups and scalar slots, in C
        homes = Homes(wiring.prefix, lambda seg: populate(seg, MADV_POPULATE_WRITE))
        self.slabs = Slabs(self.ranks, self.mv, wiring.prefix + "slab", self.max_dim, homes)
        self.homes = homes
        self.k = 0
        self.fence = False
        self.small_plans = {}  # (variables, op) -> plan of ShmReduce.small_all_reduce
        self.spin_ns = int(self.spin_s * 1e9)
        self._me = None        # (rank, its epoch slot, its waiters slot, the others' epoch slots)
        self._mapped = None    # every rank's slab buffer and generation, and Slabs.remaps then

    def begin(self, seq):
        self.seq = seq
        self.k = 0
        self.fence = False

    restartable = True

    def bind_check(self, check):
        super().bind_check(check)
        self._me = None  # called in every process after fork: its rank is known now
        self.slabs.adopt()  # a worker forked again takes up its rank's slab where it is

    def _slots(self):
        """This rank's slots: (rank, epoch, its waiters, the others' epochs, its scalar seq).

        Looked up once per process: a rank's index among this backend's ranks is
        fixed from fork() (``bind_check``) on.
        """
        me = self._me
        if me is None:
            rank = self.rank
            me = self._me = (rank, rank * STRIDE + EPOCH, rank * STRIDE + EPOCH_WAITERS,
                             tuple(q * STRIDE + EPOCH for q in range(self.n_parallel) if q != rank),
                             rank * STRIDE + SCALAR_SEQ)
        return me

    def is_kept(self, key, array):
        return self.homes.holds(key, array)

    def barrier(self):
        """Every rank of this machine meets here (epochs: the command's seq, a counter).

        A rank publishes its epoch before it can fail on what it read, so if it
        aborted after arriving, the others go on and meet the same error
        themselves (``wait_slots`` lets an abort pass once the slots arrived).
        """
        self.k += 1
        self.fence = False
        target = (self.seq << 20) | self.k
        _, mine, waiters, others, _ = self._slots()
        fast = self.fast
        fast.publish(mine, target, waiters)
        wait_slots(fast, others, GE, target, EPOCH_WAITERS - EPOCH, self.check, self.spin_ns)

    def _start(self):
        """Open a collective: wait until nobody still reads this command's slabs."""
        if self.fence:
            self.barrier()

    def _done(self):
        self.fence = True

    def contribute(self, arrays, weight=1.0):
        """Leave ``arrays`` for the root; after other collectives, only once ``settle()`` ran.

        One float scalar (a function's loss, say) goes into this rank's slots
        of the control block as a float64, which holds float16, float32 and
        float64 values exactly: writing and reading a slab header costs
        several times more.
        """
        if arrays is not None and len(arrays) == 1:
            a = arrays[0]
            # float32 and float64 in C, float16 here; the seq last: the root checks it first.
            if put_scalar_array(self.fast, self._slots()[4], self.seq, a, weight):
                return
            if type(a) is np.ndarray:
                if a.ndim == 0 and a.dtype.char in SCALAR_CHARS:
                    put_scalar(self.fast, self._slots()[4], self.seq, float(a), float(weight),
                               ord(a.dtype.char))
                    return
                if (a.nbytes <= SMALL_OUTPUT_BYTES and a.dtype.char in SMALL_CODES
                        and a.flags.c_contiguous):
                    # The same bytes as slabs.pack, packed in C.
                    lay = self.slabs.layout_of(a)
                    pack_one(self.slabs.own(lay.total).buffer, lay.head, float(weight), a,
                             lay.entries[0][1])
                    return
        self.slabs.pack(arrays, weight)

    def settle(self):
        if self.fence:
            self.barrier()  # nobody may still read the slabs the last collective used

    def mapped_slabs(self, refresh=False):
        """Every rank's slab buffer and generation as this process maps them, cached.

        Mapped again whenever a slab was replaced or attached anew since
        (``Slabs.remaps``), or with ``refresh`` (another rank's slab grew:
        ``slab(q)`` attaches its newer generation).
        """
        slabs = self.slabs
        n = self.n_parallel
        if refresh:
            for q in range(n):
                slabs.slab(q)
        m = self._mapped
        if m is None or m[2] != slabs.remaps:
            bufs = tuple([slabs.slab(q).buffer for q in range(n)])
            gens = tuple([slabs.slabs[q][0] for q in range(n)])
            m = self._mapped = (bufs, gens, slabs.remaps)
        return m

    def output_combiner(self, op):
        opcode = OP_CODES[op]
        averaged = op == "avg"
        layout_of = self.slabs.layout_of
        scalars = functools.partial(combine_scalar_array, self.fast, SCALAR_SEQ, STRIDE,
                                    self.n_parallel)
        ndarray, array = np.ndarray, np.array

        def combine(value, weight):
            if type(value) is not ndarray:
                return None
            if value.ndim == 0:
                # float32 and float64 scalars in C; float16 through scalar_result.
                got = scalars(self._slots()[0], self.seq, opcode, value, weight)
                if got is not None:
                    return array(got, value.dtype)
                return self.scalar_result(op, value, weight)
            char = value.dtype.char
            if (value.nbytes > SMALL_OUTPUT_BYTES or char not in SMALL_CODES
                    or (averaged and char not in "fd") or not value.flags.c_contiguous):
                return None
            lay = layout_of(value)
            out = np.empty(value.shape, value.dtype)
            me = self._slots()[0]
            bufs, gens, _ = self.mapped_slabs()
            status = combine_outputs(self.fast, STRIDE, GEN, gens, bufs, me, lay.head, value,
                                     float(weight), lay.entries[0][1], opcode, out)
            if status == -2:
                bufs, gens, _ = self.mapped_slabs(refresh=True)
                status = combine_outputs(self.fast, STRIDE, GEN, gens, bufs, me, lay.head, value,
                                         float(weight), lay.entries[0][1], opcode, out)
            return out if status == 1 else None
        return combine

    def scalar_combiner(self, op):
        got = functools.partial(combine_scalar_array, self.fast, SCALAR_SEQ, STRIDE,
                                self.n_parallel)
        opcode = OP_CODES[op]
        array = np.array

        def combine(value, weight):
            out = got(self._slots()[0], self.seq, opcode, value, weight)
            if out is not None:
                return array(out, value.dtype)
            return self.scalar_result(op, value, weight)
        return combine

    def scalar_result(self, op, value, weight):
        """Root, after the end barrier: every rank's float scalar combined by ``op``, or None.

        ``value`` (a 0-d array) and ``weight`` are the root's own; None unless
        every other rank contributed one float scalar of its dtype.  Combined
        in rank order as ``reduce_ops.combine_floats`` does.
        """
        got = combine_scalar_array(self.fast, SCALAR_SEQ, STRIDE, self.n_parallel,
                                   self._slots()[0], self.seq, OP_CODES[op], value, weight)
        if got is not None:
            return np.array(got, value.dtype)  # float32 or float64, combined in C
        dtype = value.dtype
        if dtype.char not in SCALAR_CHARS:
            return None
        got = combine_scalars(self.fast, SCALAR_SEQ, STRIDE, self.n_parallel, self.rank, self.seq,
                              ord(dtype.char), OP_CODES[op], float(value), float(weight))
        return None if got is None else np.array(got, dtype)

    def _contribution(self, q):
        base = q * STRIDE
        if self.mv[base + SCALAR_SEQ] == self.seq:
            value = np.array(self.fv[base + SCALAR_VALUE], dtype_of(self.mv[base + SCALAR_CODE]))
            return [value], self.fv[base + SCALAR_WEIGHT]
        arrays = self.slabs.unpack(q)
        return arrays, (None if arrays is None else self.slabs.weight(q))

    def broadcast(self, arrays, root, out=None, keys=None):
        self._start()
        me = self.rank
        if me == root:
            if keys is not None and sum(a.nbytes for a in arrays) >= SPLIT_BYTES:
                # Large: the others read the root's homes in place.
                arrays = list(arrays)
                refs = []
                for i, (k, a) in enumerate(zip(keys, arrays)):
                    ref, dst = self.homes.get(me, k, a.shape, a.dtype)
                    if a is not dst and not self.homes.holds(k, a):
                        np.copyto(dst, a)
                    refs.append(ref)
                    arrays[i] = dst
                self.slabs.pack_refs(arrays, refs)
            else:
                self.slabs.pack(arrays)
        self.barrier()
        self._done()
        if me == root:
            return list(arrays)
        result = []
        for i, v in enumerate(self.slabs.unpack(root)):
            dst = parts.out_entry(out, i)
            if keys is not None and v.nbytes >= SPLIT_BYTES:
                dst = self.homes.get(me, keys[i], v.shape, v.dtype)[1]
            if dst is not None and dst.shape == v.shape and dst.dtype == v.dtype:
                np.copyto(dst, v)
                v = dst
            elif keys is not None:
                v = np.array(v)
            result.append(v)
        return result

    def gather(self, arrays, root, keys=None):
        return self._gather(arrays, root, keys)

    def all_gather(self, arrays):
        return self._gather(arrays, None)

    def _gather(self, arrays, root, keys=None):
        self._start()
        me = self.rank
        lay = None
        kept = None
        if root == me:
            lay = self.slabs.pack(arrays, header_only=True)
        elif keys is not None and arrays is not None \
                and sum(np.asarray(a).nbytes for a in arrays) >= SPLIT_BYTES:
            # Large: the root reads this rank's homes in place; the caller keeps
            # them as its arrays, so the next gather copies nothing here.
            kept, refs = [], []
            for k, a in zip(keys, arrays):
                a = np.asarray(a)
                ref, dst = self.homes.get(me, k, a.shape, a.dtype)
                if a is not dst and not self.homes.holds(k, a):
                    np.copyto(dst, a)
                kept.append(dst)
                refs.append(ref)
            self.slabs.pack_refs(kept, refs)
        else:
            lay = self.slabs.pack(arrays)
        self.barrier()
        self._done()
        if root is not None and root != me:
            return kept if kept is not None else (list(arrays) if keys is not None else None)
        alike = self.slabs.alike(lay)
        return [(None if arrays is None else list(arrays)) if q == me
                else self.slabs.views_of(q, lay) if alike else self.slabs.unpack(q)
                for q in range(self.n_parallel)]

    def scatter(self, per_rank, root):
        self._start()
        if self.rank == root:
            self._check_scatter(per_rank)
            self.slabs.pack([a for entry in per_rank for a in entry])
        self.barrier()
        self._done()
        if self.rank == root:
            return list(per_rank[root])
        views = self.slabs.unpack(root)
        n = len(views) // self.n_parallel
        return views[self.rank * n:(self.rank + 1) * n]

    def close(self):
        self.slabs.close()
        self.fast.release()
        self.mv.release()
        self.block.close()
