"""ShmBackend's reductions: reduce, all_reduce, split all-reduces into homes, the small fast path.

Large reductions are split so that every rank reduces its own part of the
arrays (reduce-scatter), then every rank copies the reduced parts out
(all-gather): the work runs in parallel on all cores, and a rank never packs
the part it reduces itself (it reads that from its own array).  Small
all-reduces of host shared variables run on a plan cached per (variables, op).

``ShmReduce`` is mixed into ``ShmBackend`` and uses its slabs, homes and
barriers (``barrier``, ``_start``, ``_done``).
"""

import numpy as np

from ..errors import CommAborted
from ..runtime.liveness import CHECK_NS
from . import reduce_ops
from . import parts
from ._reduce import SMALL_CODES, SmallReduce
from .base import SPLIT_BYTES, as_arrays
from .slabs import EPOCH, EPOCH_WAITERS, GEN, HEAD_STRUCT, HOMES, STRIDE


class ShmReduce:
    """The reductions of ``ShmBackend`` (mixed into it)."""

    def reduce(self, arrays, op, root, weight=None, out=None):
        return self._reduce(arrays, op, weight, root, out)[0]

    def all_reduce(self, arrays, op, weight=None, out=None, keys=None):
        return self._reduce(arrays, op, weight, None, out, keys)[0]

    def reduce_with_mass(self, arrays, op, root, weight=None, out=None):
        """``reduce``, and the mass behind the result: the sum of the contributors' weights.

        Each contributing rank weighs ``weight`` (1 when None).  Returns
        ``(results, mass)`` at the root, ``(None, None)`` elsewhere.  What a
        leader sends on to other machines: a machine's partial and its mass.
        """
        return self._reduce(arrays, op, weight, root, out, weigh=True)

    def _reduce(self, arrays, op, weight, root, out, keys=None, weigh=False):
        """Reduce; return ``(results, mass)`` where results are wanted, else ``(None, None)``.

        The mass is only counted when ``weigh`` (else None).
        """
        self._start()
        n = self.n_parallel
        me = self.rank
        wants = root is None or root == me
        arrays = as_arrays(arrays)
        if n == 1:
            return (self._one_rank(arrays, op, out),
                    0.0 if arrays is None else (1.0 if weight is None else float(weight)))
        ops = None if arrays is None else parts.op_list(op, len(arrays))
        plan = self._split_plan(arrays, ops, weight)
        if plan is not None and keys is not None:
            return self._all_reduce_homes(arrays, ops, keys, plan), float(n)
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
                return ([], 0.0) if wants else (None, None)
            flags = [self.slabs.flag(q) for q in ranks]
            parts.check_alike(got, ranks, flags)
        mass = float(sum(self.slabs.weight(q) for q in ranks)) if wants and weigh else None
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
                return None, None
            first = got[ranks[0]]
            ops = parts.op_list(op, len(first))
            w = None if weight is None else [self.slabs.weight(q) for q in ranks]
            return [parts.combine_whole(ops[i], [got[q][i] for q in ranks], w, parts.out_entry(out, i))
                    for i in range(len(first))], mass
        # Reduce-scatter: this rank reduces its part of every array into its slab,
        # reading its own contribution from its own array (never packed).
        for i, lo, hi in plan[me]:
            srcs = [arrays[i].reshape(-1)[lo:hi]]
            srcs += [got[q][i].reshape(-1)[lo:hi] for q in range(n) if q != me]
            parts.reduce_into(ops[i], srcs, got[me][i].reshape(-1)[lo:hi])
        self.barrier()
        self._done()
        if not wants:
            return None, None
        # All-gather: copy every rank's reduced part out, scaling averages on the way.
        result = [parts.result_buffer(a, parts.out_entry(out, i)) for i, a in enumerate(arrays)]
        flats = [r.reshape(-1) for r in result]
        for q in range(n):
            for i, lo, hi in plan[q]:
                parts.finish(ops[i], got[q][i].reshape(-1)[lo:hi], flats[i][lo:hi], n)
        return result, mass

    def small_all_reduce(self, keys, arrays, op):
        """All-reduce small host arrays in place on a cached plan; False if it cannot.

        The latency path of ``all_reduce`` for the values of shared variables
        (every rank calls it with the same ``keys``, which name the arrays, and
        ``op``; ``arrays`` are the variables' own host arrays, written in place).
        It writes exactly what ``_reduce`` would for these arrays (the same
        header and data in this rank's slab), so ranks where it declines,
        before touching anything, meet the others in the general path; every
        rank reduces the slabs in rank order, so all get the same bits.
        Declines for arrays that are not plain writeable host arrays, results
        of another dtype, or sizes worth splitting.
        """
        return self.small_plan(keys, op, arrays).run(arrays)

    def small_plan(self, keys, op, arrays):
        """The cached plan of ``small_all_reduce`` for ``keys`` and ``op`` (made for ``arrays``).

        A caller that reduces the same variables again and again keeps it and
        calls its ``run(arrays)``.
        """
        key = (tuple(keys), op)
        plan = self.small_plans.get(key)
        if plan is None:
            plan = _SmallPlan(self, arrays, op)
            if len(self.small_plans) > 64:
                self.small_plans.clear()
            self.small_plans[key] = plan
        return plan

    def _differ(self):
        """Raise the ValueError of ranks whose small all-reduce headers differ."""
        slabs = self.slabs
        n = self.n_parallel
        got = [slabs.unpack(r) for r in range(n)]
        parts.check_alike(got, range(n), [slabs.flag(r) for r in range(n)])
        raise ValueError("all_reduce: the ranks' values differ in shape or dtype")

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


class _SmallPlan:
    """What ``small_all_reduce`` needs for one (arrays, op), checked once.

    ``lay`` is None where the fast path never applies (more bytes than
    ``SPLIT_BYTES``, or arrays it does not take).
    """

    __slots__ = ("be", "checked", "sig", "op", "lay", "header", "spans", "others",
                 "ufunc", "scale", "gens", "per_array", "codes", "offsets", "opcode", "me",
                 "compiled", "mapped")

    def __init__(self, be, arrays, op):
        self.be = be
        self.checked = list(arrays)
        self.sig = [(a.shape, a.dtype) if type(a) is np.ndarray else (None, None) for a in arrays]
        self.op = op
        self.lay = self.header = self.spans = self.codes = self.offsets = None
        if be.n_parallel > 1 and self.takes(arrays):
            self.lay = be.slabs.layout(arrays)
            self.header = HEAD_STRUCT.pack(len(arrays), 1.0, 0) + self.lay.ints
            self.spans = [(off, off + a.nbytes) for a, (_, off, _) in zip(arrays, self.lay.entries)]
            self.offsets = tuple(off for _, off, _ in self.lay.entries)
            chars = "".join(a.dtype.char for a in arrays)
            if all(c in SMALL_CODES for c in chars):
                self.codes = chars.encode()  # compiled (comm/_reduce.c); float16, bool: NumPy
        self.opcode = reduce_ops.OP_CODES[op]
        self.me = be.rank  # fixed: a plan is made in the process that uses it, after fork
        self.compiled = None  # the SmallReduce, made at the first run
        self.mapped = None    # (this rank's slab, every rank's slab buffer, their generations)
        self.others = [q for q in range(be.n_parallel) if q != be.rank]
        self.ufunc = reduce_ops.UFUNCS[op]
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

    def run(self, arrays):
        """All-reduce ``arrays`` in place (see ``ShmReduce.small_all_reduce``); False if it cannot."""
        checked = self.checked
        if len(arrays) != 1 or arrays[0] is not checked[0]:
            for a, b in zip(arrays, checked):
                if a is not b:
                    # Not the arrays the plan was checked on (an update replaced them).
                    if not self.takes(arrays):
                        return False
                    checked[:] = arrays  # held, so their ids stay theirs
                    break
        lay = self.lay
        if lay is None:
            return False
        be = self.be
        if be.fence:
            be.barrier()  # nobody may still read the slabs this command's last collective used
        if self.codes is not None:
            return self._run_compiled(be, tuple(arrays))
        slabs = be.slabs
        buf = slabs.own(lay.total).buffer
        header = self.header
        hlen = len(header)
        buf[:hlen] = header
        for a, (lo, hi) in zip(arrays, self.spans):
            buf[lo:hi] = a.tobytes()
        be.barrier()
        be.fence = True
        for q in self.others:
            if slabs.slab(q).buffer[:hlen] != header:
                be._differ()
        gens = [entry[0] for entry in slabs.slabs.values()]
        if gens != self.gens:
            # A slab grew since: views of the new ones, per array over the ranks.
            by_rank = [slabs.views_of(q, lay) for q in range(be.n_parallel)]
            self.per_array = [[v[i] for v in by_rank] for i in range(len(arrays))]
            self.gens = gens
        ufunc, scale = self.ufunc, self.scale
        for a, views in zip(arrays, self.per_array):
            ufunc(views[0], views[1], out=a)
            for v in views[2:]:
                ufunc(a, v, out=a)
            if scale is not None:
                a *= scale
        return True

    def _run_compiled(self, be, arrays):
        """``run`` in compiled code (comm/_reduce.c): pack, meet, reduce in rank order."""
        c = self.compiled
        if c is None:
            c = self.compiled = SmallReduce(be.fast, self.me, be.n_parallel, STRIDE, EPOCH,
                                            EPOCH_WAITERS, GEN, self.header, self.offsets,
                                            self.codes, self.opcode, self.scale)
        mapped = self.mapped
        # Any slab replaced or attached anew since (a collective grew one): map them again.
        if mapped is None or mapped[3] != be.slabs.remaps:
            mapped = self._map(be)
        be.k += 1
        target = (be.seq << 20) | be.k
        spin = be.spin_ns if be.spin_ns < CHECK_NS else CHECK_NS
        status = c.run(target, arrays, mapped[1], mapped[2], spin, CHECK_NS, 0)
        while status <= 0:
            if status == 0:
                try:
                    be.check()
                except CommAborted:
                    # An abort after every rank arrived does not count (see barrier()).
                    status = c.run(target, arrays, mapped[1], mapped[2], 0, 0, 1)
                    if status == 0:
                        raise
                    continue
                status = c.run(target, arrays, mapped[1], mapped[2], 0, CHECK_NS, 1)
            elif status == -2:
                # Another rank's slab grew: map its new generation, then read it.
                mapped = self._map(be)
                status = c.run(target, arrays, mapped[1], mapped[2], 0, 0, 2)
            else:
                be.fence = True
                be._differ()
        be.fence = True
        return True

    def _map(self, be):
        """Every rank's slab buffer and generation as mapped now, and the slabs' remap count."""
        slabs = be.slabs
        me = self.me
        own = slabs.own(self.lay.total)
        bufs = tuple([own.buffer if q == me else slabs.slab(q).buffer for q in range(be.n_parallel)])
        gens = tuple([slabs.slabs[q][0] for q in range(be.n_parallel)])
        self.mapped = (own, bufs, gens, slabs.remaps)
        return self.mapped
