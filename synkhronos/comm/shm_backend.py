"""Shared-memory backend: collectives over per-rank slabs of POSIX shared memory.

Each rank owns one slab.  A collective packs this rank's arrays into its slab
(a small int64 header, then the data), meets the other ranks at a barrier, and
reads what it needs straight out of the others' slabs: no pickling and no
socket on the data path.  Large reductions are split so that every rank
reduces its own part of the arrays (reduce-scatter), then every rank copies
the reduced parts out (all-gather): the work runs in parallel on all cores,
and a rank never packs the part it reduces itself (it reads that from its own
array).  Barriers spin on per-rank epoch counters in a shared control block.

A slab is reused from one collective to the next.  Instead of a barrier at
the end of every collective (so nobody overwrites a slab still being read),
the next collective of the same command starts with one; the command's own
end barrier covers the last.
"""

import logging

import numpy as np

from .. import reducers
from ..errors import CommAborted
from ..liveness import wait_until
from ..shmem import SharedArray
from . import parts
from .base import SPLIT_BYTES, Backend, as_arrays
from .homes import Homes
from .slabs import (_HEAD, EPOCH, HOMES, MADV_POPULATE_WRITE, SCALAR_CODE, SCALAR_SEQ,
                    SCALAR_VALUE, SCALAR_WEIGHT, STRIDE, Slabs, _dtype, populate)

# A contribution of one float scalar (a loss) travels in the control block.
SCALAR_CHARS = "efd"

logger = logging.getLogger(__name__)


class ShmBackend(Backend):
    """Collectives through shared memory; the default between processes of one machine."""

    def __init__(self, rt, spin_s):
        super().__init__(rt, spin_s)
        self.block = SharedArray(rt.segment_name("comm"), 8 * STRIDE * rt.n_parallel)
        self.mv = memoryview(self.block.buffer).cast("q")
        self.fv = memoryview(self.block.buffer).cast("d")  # the same slots, as float64
        homes = Homes(rt.prefix, lambda seg: populate(seg, MADV_POPULATE_WRITE))
        self.slabs = Slabs(rt, self.mv, rt.prefix + "slab", self.max_dim, homes)
        self.homes = homes
        self.k = 0
        self.fence = False
        self.small_plans = {}

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

    def reduce(self, arrays, op, root, weight=None, out=None):
        return self._reduce(arrays, op, weight, root, out)

    def all_reduce(self, arrays, op, weight=None, out=None, keys=None):
        return self._reduce(arrays, op, weight, None, out, keys)

    def _reduce(self, arrays, op, weight, root, out, keys=None):
        self._start()
        n = self.n_parallel
        me = self.rank
        wants = root is None or root == me
        arrays = as_arrays(arrays)
        if n == 1:
            return self._one_rank(arrays, op, out)
        ops = None if arrays is None else parts.op_list(op, len(arrays))
        plan = self._split_plan(arrays, ops, weight)
        if plan is not None and keys is not None:
            return self._all_reduce_homes(arrays, ops, keys, plan)
        skip = None if plan is None else parts.skips(plan[me], len(arrays))
        lay = self.slabs.pack(arrays, 1.0 if weight is None else weight, skip)
        self.barrier()
        self._done()
        if self.slabs.alike(lay):
            # Every rank packed the same header: same shapes, one split flag.
            got = [self.slabs.views_of(q, lay) for q in range(n)]
            ranks = range(n)
            flags = [plan is not None]
        else:
            got = [self.slabs.unpack(q) for q in range(n)]
            ranks = [q for q in range(n) if got[q] is not None]
            if not ranks:
                return [] if wants else None
            flags = [self.slabs.flag(q) for q in ranks]
            parts.check_alike(got, ranks, flags)
        if flags[0] and len(ranks) < n:
            # A rank gave nothing, so nobody reduces its part: contributors fill
            # in the part they skipped and everyone reduces whole arrays.
            if plan is not None:
                for i, lo, hi in plan[me]:
                    np.copyto(got[me][i].reshape(-1)[lo:hi], arrays[i].reshape(-1)[lo:hi])
            self.barrier()
            self._done()
            plan = None
        if plan is None:
            if not wants:
                return None
            first = got[ranks[0]]
            ops = parts.op_list(op, len(first))
            w = None if weight is None else [self.slabs.weight(q) for q in ranks]
            return [parts.combine(ops[i], [got[q][i] for q in ranks], w, parts.out_entry(out, i))
                    for i in range(len(first))]
        # Reduce-scatter: this rank reduces its part of every array into its slab,
        # reading its own contribution from its own array (never packed).
        for i, lo, hi in plan[me]:
            srcs = [arrays[i].reshape(-1)[lo:hi]]
            srcs += [got[q][i].reshape(-1)[lo:hi] for q in range(n) if q != me]
            parts.reduce_into(ops[i], srcs, got[me][i].reshape(-1)[lo:hi])
        self.barrier()
        self._done()
        if not wants:
            return None
        # All-gather: copy every rank's reduced part out, scaling averages on the way.
        result = [parts.result_buffer(a, parts.out_entry(out, i)) for i, a in enumerate(arrays)]
        flats = [r.reshape(-1) for r in result]
        for q in range(n):
            for i, lo, hi in plan[q]:
                parts.finish(ops[i], got[q][i].reshape(-1)[lo:hi], flats[i][lo:hi], n)
        return result

    def small_all_reduce(self, keys, op):
        """All-reduce small host shared variables in place on a cached plan; False if it cannot.

        The latency path of ``all_reduce`` (every rank calls it with the same
        ``keys``, indices into ``rt.shareds``, and ``op``).  It writes exactly
        what ``_reduce`` would for these arrays (the same header and data in
        this rank's slab), so ranks where it declines, before touching
        anything, meet the others in the general path; every rank reduces
        the slabs in rank order, so all get the same bits.  Declines for
        arrays that are not plain writeable host arrays, results of another
        dtype, or sizes worth splitting.
        """
        key = (tuple(keys), op)
        plan = self.small_plans.get(key)
        if plan is None:
            plan = _SmallPlan(self, keys, op)
            if len(self.small_plans) > 64:
                self.small_plans.clear()
            self.small_plans[key] = plan
        arrays = [c.storage[0] for c in plan.containers]
        checked = plan.checked
        for a, b in zip(arrays, checked):
            if a is not b:
                # Not the arrays the plan was checked on (an update replaced them).
                if not plan.takes(arrays):
                    return False
                checked[:] = arrays  # held, so their ids stay theirs
                break
        lay = plan.lay
        if lay is None:
            return False
        self._start()
        slabs = self.slabs
        buf = slabs.own(lay.total).buffer
        header = plan.header
        hlen = len(header)
        buf[:hlen] = header
        for a, (lo, hi) in zip(arrays, plan.spans):
            buf[lo:hi] = a.tobytes()
        self.barrier()
        self._done()
        for q in plan.others:
            if slabs.slab(q).buffer[:hlen] != header:
                n = self.n_parallel
                got = [slabs.unpack(r) for r in range(n)]
                parts.check_alike(got, range(n), [slabs.flag(r) for r in range(n)])
                raise ValueError("all_reduce: the ranks' values differ in shape or dtype")
        gens = [entry[0] for entry in slabs.slabs.values()]
        if gens != plan.gens:
            # A slab grew since: views of the new ones, per array over the ranks.
            by_rank = [slabs.views_of(q, lay) for q in range(self.n_parallel)]
            plan.per_array = [[v[i] for v in by_rank] for i in range(len(arrays))]
            plan.gens = gens
        ufunc, scale = plan.ufunc, plan.scale
        for a, views in zip(arrays, plan.per_array):
            ufunc(views[0], views[1], out=a)
            for v in views[2:]:
                ufunc(a, v, out=a)
            if scale is not None:
                a *= scale
        return True

    def _all_reduce_homes(self, arrays, ops, keys, plan):
        """Split all_reduce whose results land in (and stay in) every rank's homes.

        Arrays already in their homes are read in place by the other ranks:
        nothing is packed.  Others are copied in, all but the part this rank
        reduces itself.  Each rank reduces its part (scaling averages) and
        writes it into every rank's home, over the inputs it has read; after
        the second barrier every home holds the whole result.
        """
        n, me = self.n_parallel, self.rank
        homes = self.homes
        refs, dsts = [], []
        for k, a, (lo, hi) in zip(keys, arrays, parts.skips(plan[me], len(arrays))):
            ref, dst = homes.get(me, k, a.shape, a.dtype)
            refs.append(ref)
            dsts.append(dst)
            if a is not dst and not homes.holds(k, a):
                src, flat = a.reshape(-1), dst.reshape(-1)
                if lo > 0:
                    np.copyto(flat[:lo], src[:lo])
                if hi < a.size:
                    np.copyto(flat[hi:], src[hi:])
        self.slabs.pack_refs(arrays, refs)
        self.barrier()
        self._done()
        got = [dsts if q == me else self.slabs.unpack(q) for q in range(n)]
        if any(g is None for g in got):
            raise ValueError("all_reduce with keys needs arrays from every rank")
        parts.check_alike(got, range(n), [HOMES if q == me else self.slabs.flag(q)
                                          for q in range(n)])
        # Each rank reduces its part and writes the result into every rank's
        # home at once: no rank copies the others' parts afterwards, so every
        # byte is read once and written once per rank.
        for i, lo, hi in plan[me]:
            peers = [got[q][i].reshape(-1)[lo:hi] for q in range(n) if q != me]
            parts.reduce_to_all(ops[i], [arrays[i].reshape(-1)[lo:hi]] + peers,
                                [dsts[i].reshape(-1)[lo:hi]] + peers,
                                1.0 / n if ops[i] == "avg" else None)
        self.barrier()
        self._done()
        return dsts

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


class _SmallPlan:
    """What ``small_all_reduce`` needs for one (variables, op), checked once.

    ``lay`` is None where the fast path never applies (device variables,
    more bytes than ``SPLIT_BYTES``, or arrays it does not take).
    """

    __slots__ = ("containers", "checked", "sig", "op", "lay", "header", "spans", "others",
                 "ufunc", "scale", "gens", "per_array")

    def __init__(self, be, keys, op):
        rt = be.rt
        shareds = [rt.shareds[k] for k in keys]
        self.containers = [v.container for v in shareds]
        arrays = [c.storage[0] for c in self.containers]
        self.checked = list(arrays)
        self.sig = [(a.shape, a.dtype) if type(a) is np.ndarray else (None, None) for a in arrays]
        self.op = op
        self.lay = self.header = self.spans = None
        if (be.n_parallel > 1 and not any(id(v) in rt.device_shareds for v in shareds)
                and self.takes(arrays)):
            self.lay = be.slabs.layout(arrays)
            self.header = _HEAD.pack(len(arrays), 1.0, 0) + self.lay.ints
            self.spans = [(off, off + a.nbytes) for a, (_, off, _) in zip(arrays, self.lay.entries)]
        self.others = [q for q in range(be.n_parallel) if q != be.rank]
        self.ufunc = reducers.UFUNCS[op]
        self.scale = 1.0 / be.n_parallel if op == "avg" else None
        self.gens = None
        self.per_array = None

    def takes(self, arrays):
        """Whether these arrays have the plan's shapes and dtypes, are plain and writeable."""
        total = 0
        for a, (shape, dtype) in zip(arrays, self.sig):
            if (type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype
                    or not a.flags.c_contiguous or not a.flags.writeable
                    or (self.op == "avg" and a.dtype.kind not in "fc")):
                return False
            total += a.nbytes
        return total < SPLIT_BYTES
