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
import mmap
import struct

import numpy as np

from .. import reducers
from ..control import wait_until
from ..errors import CommAborted
from ..shmem import SharedArray
from . import parts
from .base import Backend

logger = logging.getLogger(__name__)

ALIGN = 64
PAGE_ALIGN_BYTES = 1 << 20  # arrays this big start on a page
INITIAL_SLAB = 1 << 20
# Below this many bytes in all, splitting the work across ranks costs more
# (an extra barrier) than it saves.
SPLIT_BYTES = 1 << 18
SMALL_COPY = 4096  # below this, bytes() copies beat making a NumPy view
EPOCH, GEN, SIZE = 0, 1, 2
STRIDE = 8
HEAD = 32  # count, weight, split flag, spare
FIXED = 4  # header ints per array before its shape: dtype code, ndim, offset, nbytes
# Fault pages in with one call rather than one trap per page (Linux >= 5.14);
# fresh shared memory is otherwise written at ~1 GB/s the first time.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_HEAD = struct.Struct("<qdq")
_FIXED = struct.Struct("<4q")
_STRUCTS = {}
_DTYPES = {}


def _ints(n):
    st = _STRUCTS.get(n)
    if st is None:
        st = _STRUCTS[n] = struct.Struct(f"<{n}q")
    return st


def _dtype(code):
    dt = _DTYPES.get(code)
    if dt is None:
        dt = _DTYPES[code] = np.dtype(chr(code))
    return dt


def _align(n, to=ALIGN):
    return (n + to - 1) // to * to


def _populate(seg, advice):
    try:
        seg.buffer.madvise(advice)
    except (OSError, ValueError, AttributeError):  # older kernel: pages fault in on use
        pass


class ShmBackend(Backend):
    """Collectives through shared memory; the default between processes of one machine."""

    def __init__(self, rt, spin_s):
        super().__init__(rt, spin_s)
        self.spin_s = spin_s
        self.prefix = f"/synk_{rt.master_pid}_slab"
        self.block = SharedArray(rt.segment_name("comm"), 8 * STRIDE * rt.n_parallel)
        self.mv = memoryview(self.block.buffer).cast("q")
        self.slabs = {}
        self.views = {r: {} for r in range(rt.n_parallel)}
        for r in range(rt.n_parallel):
            self.slabs[r] = [0, SharedArray(self._slab_name(r, 0), INITIAL_SLAB)]
            self.mv[r * STRIDE + SIZE] = INITIAL_SLAB
        self.seq = 0
        self.k = 0
        self.fence = False
        self._check = None
        self._make_check = None

    def _slab_name(self, rank, gen):
        return f"{self.prefix}{rank}_{gen}"

    # ---- synchronisation ---------------------------------------------
    def begin(self, seq):
        self.seq = seq
        self.k = 0
        self.fence = False
        self._check = None

    def _get_check(self):
        if self._check is None:
            if self._make_check is None:
                from ..process import backend_check
                self._make_check = backend_check
            self._check = self._make_check(self.rt, self.seq)
        return self._check

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
        check = self._get_check()
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

    # ---- slabs -------------------------------------------------------
    def _own(self, nbytes):
        entry = self.slabs[self.rank]
        seg = entry[1]
        if seg.nbytes < nbytes:
            gen = entry[0] + 1
            size = _align(max(nbytes, 2 * seg.nbytes), 1 << 12)
            new = SharedArray(self._slab_name(self.rank, gen), size)
            _populate(new, MADV_POPULATE_WRITE)
            seg.unlink()
            seg.close()
            entry[0], entry[1] = gen, new
            self.views[self.rank] = {}
            base = self.rank * STRIDE
            self.mv[base + SIZE] = size
            self.mv[base + GEN] = gen
            seg = new
        return seg

    def _slab(self, q):
        if q == self.rank:
            return self.slabs[q][1]
        entry = self.slabs[q]
        gen = self.mv[q * STRIDE + GEN]
        if entry[0] != gen:
            entry[1].close()
            entry[1] = SharedArray.attach(self._slab_name(q, gen), self.mv[q * STRIDE + SIZE])
            _populate(entry[1], MADV_POPULATE_READ)
            entry[0] = gen
            self.views[q] = {}
        return entry[1]

    def _pack(self, arrays, weight=1.0, skip=None):
        """Write ``arrays`` (or None: no contribution) and a weight into this rank's slab.

        Header: count (-1: no contribution), weight (float64), split flag,
        then per array dtype code, ndim, offset, nbytes and the shape.
        ``skip``, if given, lists per array an element range [lo, hi) whose
        bytes are not copied (the part this rank reduces from its own array).
        """
        if arrays is None:
            _HEAD.pack_into(self._own(HEAD).buffer, 0, -1, 0.0, 0)
            return
        arrays = [a if type(a) is np.ndarray else np.asarray(a) for a in arrays]
        header = []
        offset = _align(HEAD + 8 * sum(FIXED + a.ndim for a in arrays))
        for a in arrays:
            if a.ndim > self.max_dim:
                raise ValueError(f"an array of ndim {a.ndim} exceeds max_dim={self.max_dim} "
                                 "given to fork()")
            dt = a.dtype
            if dt.hasobject or dt.fields is not None:
                raise TypeError(f"cannot communicate arrays of dtype {dt}")
            if a.nbytes >= PAGE_ALIGN_BYTES:
                offset = _align(offset, 1 << 12)
            header += (ord(dt.char), a.ndim, offset, a.nbytes)
            header += a.shape
            offset = _align(offset + a.nbytes)
        buf = self._own(offset).buffer
        _HEAD.pack_into(buf, 0, len(arrays), weight, skip is not None)
        _ints(len(header)).pack_into(buf, HEAD, *header)
        i = 0
        rank = self.rank
        for j, a in enumerate(arrays):
            off = header[i + 2]
            if skip is not None:
                lo, hi = skip[j]
                dst = self._view(rank, off, header[i], a.shape).reshape(-1)
                src = a.reshape(-1)
                if lo > 0:
                    np.copyto(dst[:lo], src[:lo])
                if hi < a.size:
                    np.copyto(dst[hi:], src[hi:])
            elif a.nbytes <= SMALL_COPY and a.flags.c_contiguous:
                buf[off:off + a.nbytes] = a.tobytes()
            else:
                np.copyto(self._view(rank, off, header[i], a.shape), a)
            i += FIXED + a.ndim

    def _weight(self, q):
        return _HEAD.unpack_from(self._slab(q).buffer, 0)[1]

    def _split_flag(self, q):
        return _HEAD.unpack_from(self._slab(q).buffer, 0)[2]

    def _unpack(self, q):
        """Return views of rank ``q``'s packed arrays, or None if it gave none."""
        buf = self._slab(q).buffer
        n = _HEAD.unpack_from(buf, 0)[0]
        if n < 0:
            return None
        out = []
        pos = HEAD
        for _ in range(n):
            code, ndim, offset, _ = _FIXED.unpack_from(buf, pos)
            shape = _ints(ndim).unpack_from(buf, pos + 32) if ndim else ()
            pos += 8 * (FIXED + ndim)
            out.append(self._view(q, offset, code, shape))
        return out

    def _view(self, q, offset, code, shape):
        """Return a (cached) NumPy view into rank ``q``'s slab."""
        cache = self.views[q]
        key = (offset, code, shape)
        v = cache.get(key)
        if v is None:
            if len(cache) > 256:
                cache.clear()
            # frombuffer holds a buffer export: a slab replaced while a view
            # lives stays mapped until the view goes.
            count = 1
            for d in shape:
                count *= d
            v = cache[key] = np.frombuffer(self.slabs[q][1].buffer, _dtype(code), count,
                                           offset).reshape(shape)
        return v

    # ---- reductions --------------------------------------------------
    def reduce(self, arrays, op, root, weight=None, out=None):
        return self._reduce(arrays, op, weight, root, out)

    def all_reduce(self, arrays, op, weight=None, out=None):
        return self._reduce(arrays, op, weight, None, out)

    def _reduce(self, arrays, op, weight, root, out):
        self._start()
        n = self.n_parallel
        me = self.rank
        wants = root is None or root == me
        ops = None
        if arrays is not None:
            arrays = [a if type(a) is np.ndarray else np.asarray(a) for a in arrays]
            ops = parts.op_list(op, len(arrays))
        if n == 1:
            return [] if arrays is None else [
                parts.local_result(o, a, parts.out_entry(out, i))
                for i, (o, a) in enumerate(zip(ops, arrays))]
        plan = None
        if (arrays is not None and weight is None
                and sum(a.nbytes for a in arrays) >= SPLIT_BYTES
                and all(reducers.result_dtype(o, a.dtype) == a.dtype for o, a in zip(ops, arrays))):
            plan = parts.plan(arrays, n)
        skip = None if plan is None else parts.skips(plan[me], len(arrays))
        self._pack(arrays, 1.0 if weight is None else weight, skip)
        self.barrier()
        got = [self._unpack(q) for q in range(n)]
        ranks = [q for q in range(n) if got[q] is not None]
        self._done()
        if not ranks:
            return [] if wants else None
        flags = [self._split_flag(q) for q in ranks]
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
            w = None if weight is None else [self._weight(q) for q in ranks]
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

    # ---- function-call results -----------------------------------------
    def contribute(self, arrays, weight=1.0):
        """Leave ``arrays`` for the root; only as the one backend call of a command."""
        self._pack(arrays, weight)

    def collect(self):
        out = []
        for q in range(self.n_parallel):
            if q == self.rank:
                out.append(None)
                continue
            arrays = self._unpack(q)
            out.append(None if arrays is None else (arrays, self._weight(q)))
        return out

    # ---- data movement -----------------------------------------------
    def broadcast(self, arrays, root, out=None):
        self._start()
        if self.rank == root:
            self._pack(arrays)
        self.barrier()
        self._done()
        if self.rank == root:
            return list(arrays)
        result = []
        for i, v in enumerate(self._unpack(root)):
            o = parts.out_entry(out, i)
            if o is not None and o.shape == v.shape and o.dtype == v.dtype:
                np.copyto(o, v)
                v = o
            result.append(v)
        return result

    def gather(self, arrays, root):
        return self._gather(arrays, root)

    def all_gather(self, arrays):
        return self._gather(arrays, None)

    def _gather(self, arrays, root):
        self._start()
        self._pack(arrays)
        self.barrier()
        self._done()
        if root is not None and root != self.rank:
            return None
        return [(None if arrays is None else list(arrays)) if q == self.rank else self._unpack(q)
                for q in range(self.n_parallel)]

    def scatter(self, per_rank, root):
        self._start()
        if self.rank == root:
            n = len(per_rank[0])
            if len(per_rank) != self.n_parallel or any(len(e) != n for e in per_rank):
                raise ValueError("scatter: give one list per rank, all of the same length")
            self._pack([a for entry in per_rank for a in entry])
        self.barrier()
        self._done()
        if self.rank == root:
            return list(per_rank[root])
        views = self._unpack(root)
        n = len(views) // self.n_parallel
        return views[self.rank * n:(self.rank + 1) * n]

    def close(self):
        self.mv.release()
        self.block.close()
        for _, seg in self.slabs.values():
            seg.close()
