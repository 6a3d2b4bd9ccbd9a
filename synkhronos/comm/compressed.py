"""Reduced-precision all-reduce: send 16-bit floats, accumulate in float32.

Built on any backend's ``all_to_all`` and ``all_gather``, so every host
backend gets it.  The arrays' elements are split into one part per rank
(``parts.byte_parts``), then:

1. reduce-scatter: every rank casts its values down once and sends each
   other rank only that rank's part (``all_to_all``), 2 bytes a value, after
   its arrays' shapes, which every rank checks before it reads a part;
2. every rank sums its part over the ranks in float32, in rank order, and
   casts the sum down;
3. all-gather of the reduced parts, 2 bytes a value again; every rank casts
   them up (dividing by the rank count for "avg").

A rank that reduces E of the N values sends 2(N - E) bytes in step 1 and 2E
to each of the n - 1 others in step 3: 4N(n - 1)/n in all for equal parts,
half of what a float32 reduce-scatter and all-gather send.  Each value is
rounded twice (the addend, then the sum), so the result has the small type's
precision; every rank gets the same bits.  bfloat16 has float32's range and
travels unscaled.  float16 values are first scaled by a power of two, picked
by a tiny all-reduce of each array's largest magnitude: no overflow in the
sum, fewer underflows (the failure modes of Horovod #278).  16-bit values
travel as uint16 bit patterns, so backends need no knowledge of bfloat16;
the conversions are bit operations compiled with Numba (one pass each).
"""

import math

import numpy as np

from . import parts

DTYPES = ("bfloat16", "float16")

# The largest magnitude of a scaled float16 sum: far from float16's limit
# (65504), high enough to keep small gradients out of its subnormals.
_TARGET = 2.0 ** 13
# Scales stay within 2^-100..2^100, so the factor that undoes one stays a
# normal float32.
_MAX_EXP = 100
# Values per block of the float32 partial sum in the reduce kernel (in L1).
_BLOCK = 4096


def small_dtype(name):
    """Return the NumPy dtype for "bfloat16" (from ml_dtypes) or "float16"."""
    if name == "float16":
        return np.dtype(np.float16)
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def check_16bit(dtype, op, arrays_dtypes, where):
    """Raise ValueError or TypeError unless a compressed all-reduce can do this."""
    if dtype not in DTYPES:
        raise ValueError(f"{where}: dtype must be None, 'bfloat16' or 'float16'; got {dtype!r}")
    if op not in ("sum", "avg"):
        raise ValueError(f"{where}: dtype={dtype!r} needs op 'sum' or 'avg'; got {op!r}")
    for name, dt in arrays_dtypes:
        if np.dtype(dt).kind != "f":
            raise TypeError(f"{where}: dtype={dtype!r} compresses floats; {name} is {dt}")


def all_reduce_16bit(backend, arrays, op, dtype, out=None):
    """Sum (``op`` "sum") or average ("avg") ``arrays`` over the ranks in 16-bit transport.

    Every rank calls it, inside a command, with arrays of the same shapes.
    Returns arrays of the inputs' dtypes and shapes: the ``out`` entries that
    fit (one array or None per input; an input may be its own ``out``), else
    new ones.

    Raises:
        ValueError: the arrays' shapes differ across ranks (on every rank).
    """
    n, me = backend.n_parallel, backend.rank
    k = kernels(dtype)
    flats = [np.ascontiguousarray(a, dtype=np.float32).reshape(-1) for a in arrays]
    res = [parts.result_buffer(a, parts.out_entry(out, i)) for i, a in enumerate(arrays)]
    res_flats = [r.reshape(-1) for r in res]
    if n == 1:
        for i, (f, r) in enumerate(zip(flats, res_flats)):
            _up_into(k, k.down(f, np.float32(1.0), _buffer("sent", i, f.size)), 1.0, r)
        return res
    scales = _scales(backend, k, flats, dtype)
    sent = [k.down(f, np.float32(s), _buffer("sent", i, f.size))
            for i, (f, s) in enumerate(zip(flats, scales))]
    plan = parts.byte_parts(sent, n)
    # 1. Reduce-scatter: each rank gets only its part of every rank's values,
    # after the shapes they belong to (checked before any part is read).
    shapes = np.array([len(arrays)] + [d for a in arrays for d in (a.ndim, *a.shape)], np.int64)
    got = backend.all_to_all([[shapes] + [sent[i][lo:hi] for i, lo, hi in plan[q]]
                              for q in range(n)])
    if not all(_alike(entry, shapes, len(plan[me])) for entry in got):
        raise ValueError("cannot reduce arrays whose shapes differ across ranks")
    # 2. This rank's part, summed in float32 and cast down.
    mine = []
    for j, (i, lo, hi) in enumerate(plan[me]):
        srcs = tuple(_readonly(got[q][1 + j], hi - lo) for q in range(n))
        mine.append(k.reduce(srcs, _buffer("mine", j, hi - lo)))
    # 3. All-gather of the reduced parts, still 16-bit.  This rank's inputs
    # were read (cast down) above: they may be the outputs now.
    got = backend.all_gather(mine)
    for q in range(n):
        for (i, lo, hi), part in zip(plan[q], got[q]):
            factor = (1.0 / n if op == "avg" else 1.0) / scales[i]
            _up_into(k, _readonly(part, hi - lo), factor, res_flats[i][lo:hi])
    return res


def _scales(backend, k, flats, dtype):
    """All ranks: each array's scale, a power of two (1 for bfloat16).

    bfloat16 has float32's range: its sum overflows only where a float32
    sum would, so its values travel unscaled, with no extra round trip.
    float16's scale comes from the largest magnitude over the ranks.
    """
    if dtype == "bfloat16":
        return [1.0] * len(flats)
    peaks = backend.all_reduce([np.array([_peak(k, f) for f in flats], np.float64)], "max")[0]
    return [_scale(float(p), backend.n_parallel) for p in peaks]


def _alike(entry, shapes, n_parts):
    """Whether a rank's ``all_to_all`` entry starts with these shapes, then ``n_parts`` parts."""
    if len(entry) != 1 + n_parts:
        return False
    head = entry[0]
    return head.dtype == shapes.dtype and np.array_equal(head, shapes)


def _peak(k, flat):
    """The largest magnitude in a float32 array (NaN if it holds a NaN); 0 if empty."""
    bits = np.array([k.peak(flat.view(np.uint32))], np.uint32)
    return float(bits.view(np.float32)[0])


def _scale(peak, n):
    """A power of two putting the sum of n scaled float16 values at most at the target."""
    if not math.isfinite(peak) or peak == 0.0:
        return 1.0
    e = math.floor(math.log2(_TARGET / (n * peak)))
    return 2.0 ** min(max(e, -_MAX_EXP), _MAX_EXP)


def _up_into(k, bits, factor, dst):
    """Cast ``bits`` up into ``dst``, times ``factor`` (through float32 for other dtypes)."""
    if dst.dtype == np.float32:
        k.up(bits, np.float32(factor), dst)
        return
    tmp = np.empty(bits.size, np.float32)
    k.up(bits, np.float32(factor), tmp)
    np.copyto(dst, tmp, casting="unsafe")


def _readonly(part, size):
    """A read-only view of a received part, after checking its length.

    Read-only, so that parts from message buffers and from this rank's own
    arrays have one Numba type (one compiled kernel for any backend).
    """
    if part.dtype != np.uint16 or part.shape != (size,):
        raise ValueError("cannot reduce arrays whose shapes differ across ranks")
    v = part.view()
    v.flags.writeable = False
    return v


_buffers = {}


def _buffer(role, i, size):
    """A uint16 buffer kept per process, role and index: fresh pages are slow to first touch.

    Safe to rewrite in the next call: a rank gets there only after every
    other rank has received what this one sent from it (each sends its
    reduced parts after receiving all of its own, and returns after
    receiving everyone's).
    """
    buf = _buffers.get((role, i))
    if buf is None or buf.size != size:
        buf = _buffers[(role, i)] = np.empty(size, np.uint16)
    return buf


class _Kernels:
    """The compiled conversions for one 16-bit type (``f16``: float16, else bfloat16)."""

    def __init__(self, f16):
        if not _compiled:
            _build()
        self.f16 = f16

    def peak(self, bits):
        return _compiled["peak"](bits)

    def down(self, src, scale, dst):
        _compiled["down"](src, scale, dst, self.f16)
        return dst

    def up(self, bits, factor, dst):
        _compiled["up"](bits, factor, dst, self.f16)

    def reduce(self, srcs, dst):
        _compiled["reduce"](srcs, dst, self.f16)
        return dst


_compiled = {}


def kernels(dtype):
    """The kernels for ``dtype`` ("bfloat16" or "float16"), compiled once per process."""
    return _Kernels(dtype == "float16")


def _build():
    """Compile the bit conversions (round to nearest even, as ml_dtypes and NumPy do).

    The scalar helpers become module globals, so that the kernels capture
    nothing: Numba's cache key holds a kernel's closure variables, and a
    captured Numba function pickles differently in every process, so each
    new process would compile again.  The kernels take ``f16`` (float16,
    else bfloat16) and test it outside their loops; the helpers are
    branch-free, so the loops vectorize.
    """
    global _bits_of, _float_of, _bf16_down, _bf16_up, _f16_down, _f16_up, _block_sum
    import numba
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _bits_of(typingctx, x):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(types.float32), codegen

    @intrinsic
    def _float_of(typingctx, b):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.uint32), codegen

    @numba.njit(inline="always")
    def _bf16_down(x):
        u32 = np.uint32
        b = _bits_of(x)
        r = (b + u32(0x7FFF) + ((b >> u32(16)) & u32(1))) >> u32(16)
        nan = (b & u32(0x7FFFFFFF)) > u32(0x7F800000)
        return np.uint16((b >> u32(16)) | u32(0x40) if nan else r)  # NaN stays a quiet NaN

    @numba.njit(inline="always")
    def _bf16_up(h):
        return _float_of(np.uint32(h) << np.uint32(16))

    @numba.njit(inline="always")
    def _f16_down(x):
        u32 = np.uint32
        b = _bits_of(x)
        sign = (b >> u32(16)) & u32(0x8000)
        a = b & u32(0x7FFFFFFF)
        # Normal: rebias the exponent (-112 << 23), round the 13 dropped bits.
        normal = (a + u32(0xC8000FFF) + ((a >> u32(13)) & u32(1))) >> u32(13)
        # Below 2^-14: adding 0.5 rounds to float16's subnormal step, 2^-24.
        sub = _bits_of(_float_of(a) + np.float32(0.5)) - u32(0x3F000000)
        big = u32(0x7E00) if a > u32(0x7F800000) else u32(0x7C00)  # NaN, else inf
        r = sub if a < u32(0x38800000) else normal
        r = big if a >= u32(0x47800000) else r
        return np.uint16(r | sign)

    @numba.njit(inline="always")
    def _f16_up(h):
        u32 = np.uint32
        h = u32(h)
        o = (h & u32(0x7FFF)) << u32(13)
        e = o & u32(0x0F800000)
        o += u32(112 << 23)
        o = o + u32(112 << 23) if e == u32(0x0F800000) else o  # inf, NaN
        sub = _bits_of(_float_of(o + u32(1 << 23)) - _float_of(u32(113 << 23)))
        o = sub if e == u32(0) else o
        return _float_of(o | ((h & u32(0x8000)) << u32(16)))

    @numba.njit(nogil=True, cache=True)
    def peak(bits):
        # Magnitudes compare as their bit patterns; a NaN's is above inf's.
        m = np.uint32(0)
        for i in range(bits.size):
            m = max(m, bits[i] & np.uint32(0x7FFFFFFF))
        return m

    @numba.njit(nogil=True, cache=True)
    def down(src, scale, dst, f16):
        if f16:
            for i in range(src.size):
                dst[i] = _f16_down(src[i] * scale)
        else:
            for i in range(src.size):
                dst[i] = _bf16_down(src[i] * scale)

    @numba.njit(nogil=True, cache=True)
    def up(bits, factor, dst, f16):
        if f16:
            for i in range(dst.size):
                dst[i] = _f16_up(bits[i]) * factor
        else:
            for i in range(dst.size):
                dst[i] = _bf16_up(bits[i]) * factor

    @numba.njit(inline="always")
    def _block_sum(srcs, lo, hi, acc, dst, up_one, down_one):
        m = hi - lo
        first = srcs[0][lo:hi]
        for i in range(m):
            acc[i] = up_one(first[i])
        for s in srcs[1:]:
            part = s[lo:hi]
            for i in range(m):
                acc[i] += up_one(part[i])
        out = dst[lo:hi]
        for i in range(m):
            out[i] = down_one(acc[i])

    @numba.njit(nogil=True, cache=True)
    def reduce(srcs, dst, f16):
        # The sum over the ranks in rank order, in float32, a block at a time.
        acc = np.empty(_BLOCK, np.float32)
        for lo in range(0, dst.size, _BLOCK):
            hi = min(lo + _BLOCK, dst.size)
            if f16:
                _block_sum(srcs, lo, hi, acc, dst, _f16_up, _f16_down)
            else:
                _block_sum(srcs, lo, hi, acc, dst, _bf16_up, _bf16_down)

    _compiled.update(peak=peak, down=down, up=up, reduce=reduce)
