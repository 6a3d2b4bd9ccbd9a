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

import logging

import numpy as np

from ..errors import CommAborted
from ..runtime.liveness import wait_until
from ..runtime.shmem import SharedArray
from . import parts
from .base import SPLIT_BYTES, Backend
from .homes import Homes
from .shm_reduce import ShmReduce
from .slabs import (EPOCH, MADV_POPULATE_WRITE, SCALAR_CODE, SCALAR_SEQ, SCALAR_VALUE, SCALAR_WEIGHT,
                    STRIDE, Slabs, _dtype, populate)

# A contribution of one float scalar (a loss) travels in the control block.
SCALAR_CHARS = "efd"

logger = logging.getLogger(__name__)


class ShmBackend(ShmReduce, Backend):
    """Collectives through shared memory; the default between processes of one machine."""

    def __init__(self, wiring):
        super().__init__(wiring)
        n = self.n_parallel
        self.block = SharedArray(wiring.new_name("comm"), 8 * STRIDE * n)
        self.mv = memoryview(self.block.buffer).cast("q")
        self.fv = memoryview(self.block.buffer).cast("d")  # the same slots, as float64
        homes = Homes(wiring.prefix, lambda seg: populate(seg, MADV_POPULATE_WRITE))
        self.slabs = Slabs(self.ranks, self.mv, wiring.prefix + "slab", self.max_dim, homes)
        self.homes = homes
        self.k = 0
        self.fence = False
        self.small_plans = {}  # (variables, op) -> plan of ShmReduce.small_all_reduce

    def begin(self, seq):
        self.seq = seq
        self.k = 0
        self.fence = False

    def is_kept(self, key, array):
        return self.homes.holds(key, array)

    def barrier(self):
        self.k += 1
        self.fence = False
        target = (self.seq << 20) | self.k
        mv = self.mv
        rank = self.rank
        mv[rank * STRIDE + EPOCH] = target
        for q in range(self.n_parallel):
            if q != rank:
                slot = q * STRIDE + EPOCH
                if mv[slot] < target:
                    wait_until(lambda: mv[slot] >= target, self._arrival_check(slot, target),
                               self.spin_s)

    def _arrival_check(self, slot, target):
        """The abort check of a barrier wait, which an arrived rank overrides.

        A rank posts its epoch before it can fail on what it read, so if it
        aborted after arriving, this rank goes on and meets the same error
        itself (the abort flag is read first, then the epoch: stores are not
        reordered on x86, nor loads with loads).
        """
        check = self.check
        mv = self.mv

        def arrival_check():
            try:
                check()
            except CommAborted:
                if mv[slot] >= target:
                    return
                raise
        return arrival_check

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
            if type(a) is np.ndarray and a.ndim == 0 and a.dtype.char in SCALAR_CHARS:
                base = self.rank * STRIDE
                self.fv[base + SCALAR_VALUE] = float(a)
                self.fv[base + SCALAR_WEIGHT] = weight
                self.mv[base + SCALAR_CODE] = ord(a.dtype.char)
                self.mv[base + SCALAR_SEQ] = self.seq  # last: the root checks it first
                return
        self.slabs.pack(arrays, weight)

    def settle(self):
        if self.fence:
            self.barrier()  # nobody may still read the slabs the last collective used

    def scalar_parts(self, dtype):
        """Root, after the end barrier: ``[(value, weight)]`` over the ranks (None for this one)
        if every other rank contributed one float scalar of ``dtype``, else None."""
        if dtype.char not in SCALAR_CHARS:
            return None
        code = ord(dtype.char)
        mv, fv, seq, me = self.mv, self.fv, self.seq, self.rank
        out = []
        for q in range(self.n_parallel):
            if q == me:
                out.append(None)
                continue
            base = q * STRIDE
            if mv[base + SCALAR_SEQ] != seq or mv[base + SCALAR_CODE] != code:
                return None
            out.append((fv[base + SCALAR_VALUE], fv[base + SCALAR_WEIGHT]))
        return out

    def _contribution(self, q):
        base = q * STRIDE
        if self.mv[base + SCALAR_SEQ] == self.seq:
            value = np.array(self.fv[base + SCALAR_VALUE], _dtype(self.mv[base + SCALAR_CODE]))
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
        self.mv.release()
        self.block.close()
