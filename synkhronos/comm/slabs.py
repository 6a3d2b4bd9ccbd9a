"""Slabs: one growing segment of POSIX shared memory per rank, and arrays packed in it.

A rank packs arrays into its own slab (a small int64 header, then the data)
and reads the others' slabs in place.  A slab that must grow is replaced by a
bigger one under a new name (generation); readers see the new generation in
the shared control block and attach it.  New slabs are faulted in at once:
fresh shared memory is otherwise written at ~1 GB/s the first time.
"""

import mmap
import struct

import numpy as np

from ..runtime.shmem import SharedArray

ALIGN = 64
PAGE_ALIGN_BYTES = 1 << 20  # arrays this big start on a page
INITIAL_SLAB = 1 << 20
SMALL_COPY = 4096  # below this, bytes() copies beat making a NumPy view
EPOCH, GEN, SIZE = 0, 1, 2  # per-rank slots in the control block
# A scalar contribution (ShmBackend.contribute): its command, value, weight, dtype code
# (in this order: comm/_reduce.c's put_scalar and combine_scalars read them so).
SCALAR_SEQ, SCALAR_VALUE, SCALAR_WEIGHT, SCALAR_CODE = 3, 4, 5, 6
EPOCH_WAITERS = 7  # ranks asleep until this rank's epoch moves (runtime/_block.c)
STRIDE = 8
HEAD = 32  # count, weight, flag (SPLIT or HOMES), spare
SPLIT, HOMES = 1, 2  # header flags: own part not packed; arrays live in homes
FIXED = 4  # header ints per array before its shape: dtype code, ndim, offset, nbytes
# Fault pages in with one call rather than one trap per page (Linux >= 5.14).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

HEAD_STRUCT = struct.Struct("<qdq8x")  # a slab's HEAD bytes: the spare zeroed, so equal ones compare equal
_FIXED = struct.Struct("<4q")
_STRUCTS = {}
_DTYPES = {}


def _ints(n):
    st = _STRUCTS.get(n)
    if st is None:
        st = _STRUCTS[n] = struct.Struct(f"<{n}q")
    return st


def dtype_of(code):
    dt = _DTYPES.get(code)
    if dt is None:
        dt = _DTYPES[code] = np.dtype(chr(code))
    return dt


def _align(n, to=ALIGN):
    return (n + to - 1) // to * to


def populate(seg, advice):
    try:
        seg.buffer.madvise(advice)
    except (OSError, ValueError, AttributeError):  # older kernel: pages fault in on use
        pass


class _Layout:
    """Where arrays of given shapes and dtypes go in a slab, and their header bytes."""

    __slots__ = ("ints", "hlen", "entries", "total", "views", "head")

    def __init__(self, ints, hlen, entries, total):
        self.ints = ints          # the per-array header ints, packed
        self.hlen = hlen          # header bytes, fixed part included
        self.entries = entries    # per array: dtype code, offset, shape
        self.total = total        # bytes the slab needs
        self.views = {}           # rank -> (slab generation, views)
        # The whole header of a contribution (weight 0: comm/_reduce.c's pack_one sets it).
        self.head = HEAD_STRUCT.pack(len(entries), 0.0, 0) + ints


class Slabs:
    """Every rank's slab as seen from this process.  Created in the master before fork.

    ``mv`` is the shared control block (int64 slots, ``STRIDE`` per rank),
    where each rank publishes its slab's generation and size.
    """

    def __init__(self, ranks, mv, prefix, max_dim, homes):
        self.ranks = ranks  # read live: a worker learns its rank after fork
        self.homes = homes
        self.mv = mv
        self.prefix = prefix
        self.max_dim = max_dim
        self.n_parallel = n = ranks.n_parallel
        self.slabs = {}
        self.views = {r: {} for r in range(n)}
        for r in range(n):
            self.slabs[r] = [0, SharedArray(self._name(r, 0), INITIAL_SLAB)]
            mv[r * STRIDE + SIZE] = INITIAL_SLAB
        self.layouts = {}
        self.last = None  # (shape, dtype, layout) of the last layout_of
        self.remaps = 0  # slabs replaced or attached anew here (views of old ones are stale)

    @property
    def rank(self):
        return self.ranks.rank

    def _name(self, rank, gen):
        return f"{self.prefix}{rank}_{gen}"

    def own(self, nbytes):
        entry = self.slabs[self.rank]
        seg = entry[1]
        if seg.nbytes < nbytes:
            gen = entry[0] + 1
            size = _align(max(nbytes, 2 * seg.nbytes), 1 << 12)
            new = SharedArray(self._name(self.rank, gen), size)
            populate(new, MADV_POPULATE_WRITE)
            seg.unlink()
            seg.close()
            entry[0], entry[1] = gen, new
            self.remaps += 1
            self.views[self.rank] = {}
            base = self.rank * STRIDE
            self.mv[base + SIZE] = size
            self.mv[base + GEN] = gen
            seg = new
        return seg

    def adopt(self):
        """Map this rank's own slab of the generation the control block names.

        A no-op after the first fork; a worker forked from the leader later
        (``Backend.restartable``) inherits the leader's view of its rank's slab,
        which the rank's earlier process may have replaced since.
        """
        rank = self.rank
        entry = self.slabs[rank]
        gen = self.mv[rank * STRIDE + GEN]
        if entry[0] != gen:
            entry[1].close()
            entry[1] = SharedArray.attach(self._name(rank, gen), self.mv[rank * STRIDE + SIZE])
            entry[0] = gen
            self.remaps += 1
            self.views[rank] = {}

    def slab(self, q):
        if q == self.rank:
            return self.slabs[q][1]
        entry = self.slabs[q]
        gen = self.mv[q * STRIDE + GEN]
        if entry[0] != gen:
            entry[1].close()
            entry[1] = SharedArray.attach(self._name(q, gen), self.mv[q * STRIDE + SIZE])
            populate(entry[1], MADV_POPULATE_READ)
            entry[0] = gen
            self.remaps += 1
            self.views[q] = {}
        return entry[1]

    def layout_of(self, a):
        """``layout([a])``: one array's, with the last one's kept at hand (a loop's output)."""
        last = self.last
        if last is not None and a.shape == last[0] and a.dtype == last[1]:
            return last[2]
        lay = self.layout([a])
        self.last = (a.shape, a.dtype, lay)
        return lay

    def layout(self, arrays):
        """Return the cached header and offsets for arrays of these shapes and dtypes."""
        key = tuple([(a.shape, a.dtype) for a in arrays])
        lay = self.layouts.get(key)
        if lay is not None:
            return lay
        header = []
        entries = []
        offset = _align(HEAD + 8 * sum(FIXED + a.ndim for a in arrays))
        for a in arrays:
            if a.ndim > self.max_dim:
                raise ValueError(f"an array of ndim {a.ndim} exceeds max_dim={self.max_dim} "
                                 "given to fork()")
            dt = a.dtype
            if dt.hasobject or dt.fields is not None or not dt.isnative:
                raise TypeError(f"cannot communicate arrays of dtype {dt}")
            if a.nbytes >= PAGE_ALIGN_BYTES:
                offset = _align(offset, 1 << 12)
            header += (ord(dt.char), a.ndim, offset, a.nbytes)
            header += a.shape
            entries.append((ord(dt.char), offset, a.shape))
            offset = _align(offset + a.nbytes)
        ints = _ints(len(header)).pack(*header)
        if len(self.layouts) > 64:
            self.layouts.clear()
        lay = self.layouts[key] = _Layout(ints, HEAD + len(ints), entries, offset)
        return lay

    def pack(self, arrays, weight=1.0, skip=None, header_only=False):
        """Write ``arrays`` (or None: no contribution) and a weight into this rank's slab.

        Header: count (-1: no contribution), weight (float64), split flag,
        then per array dtype code, ndim, offset, nbytes and the shape.
        ``skip``, if given, lists per array an element range [lo, hi) whose
        bytes are not copied (the part this rank reduces from its own array).
        ``header_only`` writes no data (the root of a gather reads its own
        arrays).  Returns the layout, or None.
        """
        if arrays is None:
            HEAD_STRUCT.pack_into(self.own(HEAD).buffer, 0, -1, 0.0, 0)
            return None
        arrays = [a if type(a) is np.ndarray else np.asarray(a) for a in arrays]
        lay = self.layout(arrays)
        buf = self.own(lay.hlen if header_only else lay.total).buffer
        HEAD_STRUCT.pack_into(buf, 0, len(arrays), weight, SPLIT if skip is not None else 0)
        buf[HEAD:lay.hlen] = lay.ints
        if header_only:
            return lay
        rank = self.rank
        for j, (a, (code, off, shape)) in enumerate(zip(arrays, lay.entries)):
            if skip is not None:
                lo, hi = skip[j]
                dst = self.view(rank, off, code, shape).reshape(-1)
                src = a.reshape(-1)
                if lo > 0:
                    np.copyto(dst[:lo], src[:lo])
                if hi < a.size:
                    np.copyto(dst[hi:], src[hi:])
            elif a.nbytes <= SMALL_COPY and a.flags.c_contiguous:
                buf[off:off + a.nbytes] = a.tobytes()
            else:
                np.copyto(self.view(rank, off, code, shape), a)
        return lay

    def pack_refs(self, arrays, refs):
        """Write a header for arrays that live in this rank's homes (no data)."""
        header = []
        for a, ref in zip(arrays, refs):
            header += (ord(a.dtype.char), a.ndim, ref, a.nbytes)
            header += a.shape
        buf = self.own(HEAD + 8 * len(header)).buffer
        HEAD_STRUCT.pack_into(buf, 0, len(arrays), 1.0, HOMES)
        _ints(len(header)).pack_into(buf, HEAD, *header)

    def alike(self, lay):
        """Whether every rank packed this very header (so the same views fit all slabs)."""
        if lay is None:
            return False
        n = lay.hlen
        mine = self.slabs[self.rank][1].buffer[:n]
        for q in range(self.n_parallel):
            if q != self.rank and self.slab(q).buffer[:n] != mine:
                return False
        return True

    def views_of(self, q, lay):
        """Views of rank ``q``'s arrays packed with layout ``lay`` (cached per slab)."""
        gen = self.slabs[q][0]
        hit = lay.views.get(q)
        if hit is None or hit[0] != gen:
            hit = lay.views[q] = (gen, [self.view(q, off, code, shape)
                                        for code, off, shape in lay.entries])
        return hit[1]

    def weight(self, q):
        return HEAD_STRUCT.unpack_from(self.slab(q).buffer, 0)[1]

    def flag(self, q):
        return HEAD_STRUCT.unpack_from(self.slab(q).buffer, 0)[2]

    def unpack(self, q):
        """Return views of rank ``q``'s packed arrays, or None if it gave none."""
        buf = self.slab(q).buffer
        n, _, flag = HEAD_STRUCT.unpack_from(buf, 0)
        if n < 0:
            return None
        out = []
        pos = HEAD
        for _ in range(n):
            code, ndim, offset, _ = _FIXED.unpack_from(buf, pos)
            shape = _ints(ndim).unpack_from(buf, pos + 32) if ndim else ()
            pos += 8 * (FIXED + ndim)
            if flag == HOMES:
                out.append(self.homes.peer(q, offset, shape, dtype_of(code)))
            else:
                out.append(self.view(q, offset, code, shape))
        return out

    def view(self, q, offset, code, shape):
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
            v = cache[key] = np.frombuffer(self.slabs[q][1].buffer, dtype_of(code), count,
                                           offset).reshape(shape)
        return v

    def close(self):
        for _, seg in self.slabs.values():
            seg.close()
        self.homes.close()
