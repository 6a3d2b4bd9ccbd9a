"""Shared-memory backend: collectives over per-rank slabs of POSIX shared memory.

Each rank owns one slab.  A collective packs this rank's arrays into its slab
(a small int64 header, then the data), meets the other ranks at a barrier, and
reads what it needs straight out of the others' slabs: no pickling and no
socket on the data path.  Large reductions are split so that every rank
reduces its own chunk of every array in place (reduce-scatter), then the
chunks are copied out (all-gather): the work runs in parallel on all cores.
Barriers spin on per-rank epoch counters in a shared control block.
"""

import logging
import struct

import numpy as np

from .. import reducers
from ..control import wait_until
from ..shmem import SharedArray
from .base import Backend

logger = logging.getLogger(__name__)

ALIGN = 64
INITIAL_SLAB = 1 << 20
# Below this many bytes in all, splitting the work across ranks costs more
# (an extra barrier) than it saves.
SPLIT_BYTES = 1 << 18
SMALL_COPY = 4096  # below this, bytes() copies beat making a NumPy view
EPOCH, GEN, SIZE = 0, 1, 2
STRIDE = 8
FIXED = 4  # header ints per array before its shape: dtype code, ndim, offset, nbytes


_HEAD = struct.Struct("<qd")
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


def _align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
        self._check = None

    def _slab_name(self, rank, gen):
        return f"{self.prefix}{rank}_{gen}"

    # ---- synchronisation ---------------------------------------------
    def begin(self, seq):
        self.seq = seq
        self.k = 0
        self._check = None

    def _get_check(self):
        if self._check is None:
            from ..process import backend_check
            self._check = backend_check(self.rt, self.seq)
        return self._check

    def barrier(self):
        self.k += 1
        target = (self.seq << 20) | self.k
        mv = self.mv
        rank = self.rank
        mv[rank * STRIDE + EPOCH] = target
        check = self._get_check()
        for q in range(self.n_parallel):
            if q != rank:
                slot = q * STRIDE + EPOCH
                if mv[slot] < target:
                    wait_until(lambda: mv[slot] >= target, check, self.spin_s)

    # ---- slabs -------------------------------------------------------
    def _own(self, nbytes):
        entry = self.slabs[self.rank]
        seg = entry[1]
        if seg.nbytes < nbytes:
            gen = entry[0] + 1
            size = _align(max(nbytes, 2 * seg.nbytes))
            new = SharedArray(self._slab_name(self.rank, gen), size)
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
            entry[0] = gen
            self.views[q] = {}
        return entry[1]

    def _pack(self, arrays, weight=1.0):
        """Write ``arrays`` (or None: no contribution) and a weight into this rank's slab.

        Header: count (-1: no contribution), weight (float64), then per array
        dtype code, ndim, offset, nbytes and the shape.
        """
        if arrays is None:
            _HEAD.pack_into(self._own(16).buffer, 0, -1, 0.0)
            return
        arrays = [a if type(a) is np.ndarray else np.asarray(a) for a in arrays]
        header = []
        offset = _align(16 + 8 * sum(FIXED + a.ndim for a in arrays))
        for a in arrays:
            if a.ndim > self.max_dim:
                raise ValueError(f"an array of ndim {a.ndim} exceeds max_dim={self.max_dim} "
                                 "given to fork()")
            dt = a.dtype
            if dt.hasobject or dt.fields is not None:
                raise TypeError(f"cannot communicate arrays of dtype {dt}")
            header += (ord(dt.char), a.ndim, offset, a.nbytes)
            header += a.shape
            offset = _align(offset + a.nbytes)
        buf = self._own(offset).buffer
        _HEAD.pack_into(buf, 0, len(arrays), weight)
        _ints(len(header)).pack_into(buf, 16, *header)
        i = 0
        rank = self.rank
        for a in arrays:
            off = header[i + 2]
            if a.nbytes <= SMALL_COPY and a.flags.c_contiguous:
                buf[off:off + a.nbytes] = a.tobytes()
            else:
                np.copyto(self._view(rank, off, header[i], a.shape), a)
            i += FIXED + a.ndim

    def _weight(self, q):
        return _HEAD.unpack_from(self._slab(q).buffer, 0)[1]

    def _unpack(self, q):
        """Return views of rank ``q``'s packed arrays, or None if it gave none."""
        buf = self._slab(q).buffer
        n = _HEAD.unpack_from(buf, 0)[0]
        if n < 0:
            return None
        out = []
        pos = 16
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
            v = cache[key] = np.ndarray(shape, _dtype(code), buffer=self.slabs[q][1].buffer,
                                        offset=offset)
        return v

    # ---- collectives -------------------------------------------------
    def reduce(self, arrays, op, root, weight=None):
        return self._reduce(arrays, op, weight, root)

    def all_reduce(self, arrays, op, weight=None):
        return self._reduce(arrays, op, weight, None)

    def _reduce(self, arrays, op, weight, root):
        self._pack(arrays, 1.0 if weight is None else weight)
        self.barrier()
        parts = [self._unpack(q) for q in range(self.n_parallel)]
        ranks = [q for q in range(self.n_parallel) if parts[q] is not None]
        wants = root is None or root == self.rank
        if not ranks:
            self.barrier()
            return [] if wants else None
        _check_alike(parts, ranks)
        first = parts[ranks[0]]
        ops = [op] * len(first) if isinstance(op, str) else list(op)
        w = None if weight is None else [self._weight(q) for q in ranks]
        nbytes = sum(a.nbytes for a in first)
        split = (len(ranks) == self.n_parallel > 1 and nbytes >= SPLIT_BYTES
                 and all(reducers.result_dtype(o, a.dtype) == a.dtype for o, a in zip(ops, first)))
        if not split:
            result = None
            if wants:
                result = [reducers.combine(ops[i], [parts[q][i] for q in ranks], w)
                          for i in range(len(first))]
            self.barrier()
            return result
        # Reduce-scatter: rank r reduces chunk r of every array into its own slab.
        me = self.rank
        for i in range(len(first)):
            lo, hi = _chunk(first[i].size, self.n_parallel, me)
            if hi > lo:
                mine = parts[me][i].reshape(-1)[lo:hi]
                chunks = [parts[q][i].reshape(-1)[lo:hi] for q in ranks]
                _combine_into(ops[i], chunks, w, me, mine)
        self.barrier()
        result = None
        if wants:
            result = []
            for i, a in enumerate(first):
                out = np.empty(a.shape, a.dtype)
                flat = out.reshape(-1)
                for q in range(self.n_parallel):
                    lo, hi = _chunk(a.size, self.n_parallel, q)
                    flat[lo:hi] = parts[q][i].reshape(-1)[lo:hi]
                result.append(out)
        self.barrier()
        return result

    def contribute(self, arrays, weight=1.0):
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

    def broadcast(self, arrays, root):
        if self.rank == root:
            self._pack(arrays)
        self.barrier()
        if self.rank == root:
            result = list(arrays)
        else:
            result = [np.array(v) for v in self._unpack(root)]
        self.barrier()
        return result

    def gather(self, arrays, root):
        return self._gather(arrays, root)

    def all_gather(self, arrays):
        return self._gather(arrays, None)

    def _gather(self, arrays, root):
        self._pack(arrays)
        self.barrier()
        result = None
        if root is None or root == self.rank:
            result = []
            for q in range(self.n_parallel):
                if q == self.rank:
                    result.append(None if arrays is None else list(arrays))
                else:
                    got = self._unpack(q)
                    result.append(None if got is None else [np.array(v) for v in got])
        self.barrier()
        return result

    def scatter(self, per_rank, root):
        if self.rank == root:
            n = len(per_rank[0])
            if any(len(entry) != n for entry in per_rank):
                raise ValueError("scatter: every rank needs the same number of arrays")
            self._pack([a for entry in per_rank for a in entry])
        self.barrier()
        if self.rank == root:
            result = list(per_rank[root])
        else:
            views = self._unpack(root)
            n = len(views) // self.n_parallel
            result = [np.array(v) for v in views[self.rank * n:(self.rank + 1) * n]]
        self.barrier()
        return result

    def close(self):
        self.mv.release()
        self.block.close()
        for _, seg in self.slabs.values():
            seg.close()


def _chunk(size, n, q):
    """Return the [lo, hi) element range of chunk ``q`` when splitting ``size`` n ways."""
    base, extra = divmod(size, n)
    lo = q * base + min(q, extra)
    return lo, lo + base + (1 if q < extra else 0)


def _combine_into(op, chunks, weights, mine_index, out):
    """Reduce ``chunks`` into ``out`` (which is ``chunks[mine_index]``) in place."""
    if op == "avg":
        n = len(chunks)
        w = [1.0] * n if weights is None else [float(x) for x in weights]
        total = sum(w)
        out *= w[mine_index] / total
        tmp = np.empty_like(out)
        for j, c in enumerate(chunks):
            if j != mine_index:
                np.multiply(c, w[j] / total, out=tmp, casting="unsafe")
                out += tmp
        return out
    ufunc = reducers.UFUNCS[op]
    for j, c in enumerate(chunks):
        if j != mine_index:
            ufunc(out, c, out=out)
    return out


def _check_alike(parts, ranks):
    first = parts[ranks[0]]
    for q in ranks[1:]:
        other = parts[q]
        if len(other) != len(first) or any(
                a.shape != b.shape or a.dtype != b.dtype for a, b in zip(first, other)):
            desc = "; ".join(
                f"rank {r}: " + ", ".join(f"{a.dtype}{list(a.shape)}" for a in parts[r])
                for r in ranks)
            raise ValueError(f"cannot reduce arrays whose shapes or dtypes differ across ranks ({desc})")
