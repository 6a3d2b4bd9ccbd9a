"""``log1p``, ``log``, ``exp``, ``softplus`` and ``sigmoid`` in a rank's Numba graph as
loops the compiler vectorises.

PyTensor's Numba backend calls the C library once a row for each of them,
and a call into the C library keeps LLVM from vectorising the loop around it.
glibc 2.36's ``log1p`` takes 9-11 ns an element for arguments above about 0.3
(3.5 below), its ``exp`` and ``log`` about 4: a Student-t likelihood spends most
of its row in ``log1p`` (the gallery's robust regression at its draws' typical
position ran PyMC's call in 1374 us at 10^5 rows), a logistic regression in
``softplus`` and ``sigmoid``, a Poisson regression in ``exp``, a mixture in
``exp`` and ``log``.

So in a rank's graph compiled by Numba, each float64 elementwise op of
``SWAPS`` over rows (under PyTensor 2 ``log1p`` alone: ``SWAPS_PYTENSOR_2``) is
swapped, before PyTensor fuses the loops, for a subclass whose Numba code is
written out here (``SOURCES``), after fdlibm:

- ``log`` and ``log1p``: the argument's exponent and mantissa read from its bits
  (``_bitcasts``, no call), then fdlibm's polynomial in ``s = f / (2 + f)``;
  ``log1p`` takes ``f = x`` itself, exactly, where ``1 + x`` lies in
  [sqrt(1/2), sqrt(2)), elsewhere ``f`` from the rounded ``u = 1 + x`` with
  ``(x - (u - 1)) / u`` correcting the rounding;
- ``exp``: ``x = k ln2 + r``, fdlibm's rational approximation of ``exp(r)``, then
  ``2^k`` written into the exponent bits (in two factors, so that a subnormal
  result is rounded once);
- ``softplus(x)`` as ``max(x, 0) + log1p(exp(-|x|))`` (one ``exp`` a row, no branch),
  ``sigmoid`` as PyTensor's Numba code computes it, ``1 / (1 + exp(-x))``.

Two things keep the loops vectorised:

- each function is compiled without fast-math flags (reassociated,
  ``x - (u - 1)`` folds to zero) and inlined by LLVM into the loop
  (``forceinline``), where its instructions keep their own flags;
  divisions are ``np.true_divide`` (``/`` is checked for zero under Numba's
  Python error model, a branch);
- the ops stay out of PyTensor's elementwise fusion (``supports_c_code``):
  PyTensor's fused loop calls its composite once a row, and once the composite
  holds a polynomial and a gradient's terms it is too large for LLVM to
  inline, so nothing in it vectorises.  Each runs as a loop of its own, the
  terms around it fused as before.

Robust's graph on 50,000 rows (one-off probe, bench/HISTORY.md, 2026-12-07):
PyTensor 3.3 752 -> 179 us at the typical position, 344 -> 182 at the initial
point; PyTensor 2.38 944 -> 212.  A rank's graph on 10^5 rows at the initial point
(``bench/pymc_gallery.py --parts graphs``, PyMC 6.4): robust 599 -> 293 us, logistic
4012 -> 1967, negbin 10234 -> 6901.  Each is within 1 ulp of glibc's (``softplus`` 2,
``sigmoid`` 3 of SciPy's ``expit``) over the float64 range, and the same at 0, -0,
the ends of the range, inf and nan (``tests/extensions/test_pymc_scalars.py``).  An
op on scalars stays PyTensor's, fused with the scalars around it; every other
backend, and PyMC's own function, runs PyTensor's.
"""

import hashlib
import logging

import numpy as np
from pytensor.graph.rewriting.basic import GraphRewriter
from pytensor.scalar import basic as scalar_basic
from pytensor.scalar import math as scalar_math
from pytensor.tensor.elemwise import Elemwise

from ... import compat
from . import rowsums

logger = logging.getLogger(__name__)

VERSION = 1
"""Part of the Numba cache key: raise it where the Numba code below changes."""

POSITION = 48.9
"""Where the swap runs among PyTensor's rewrites: after those that write ``log1p`` and
``softplus`` (canonicalize, stabilize, specialize), before the elementwise fusion (49)."""


class _Unfused:
    """Never fused with other loops (see the module's docstring)."""

    def supports_c_code(self, inputs, outputs):
        # PyTensor fuses only ops that say they have C code.
        return False


class Log1p(_Unfused, scalar_basic.Log1p):
    """PyTensor's ``log1p``, in Numba as ``_LOG1P``."""


class Log(_Unfused, scalar_basic.Log):
    """PyTensor's ``log``, in Numba as ``_LOG``."""


class Exp(_Unfused, scalar_basic.Exp):
    """PyTensor's ``exp``, in Numba as ``_EXP``."""


class Softplus(_Unfused, scalar_math.Softplus):
    """PyTensor's ``softplus``, in Numba as ``_SOFTPLUS``."""


class Sigmoid(_Unfused, scalar_math.Sigmoid):
    """PyTensor's ``sigmoid``, in Numba as ``_SIGMOID``."""


SWAPS = {scalar_basic.Log1p: Log1p, scalar_basic.Log: Log, scalar_basic.Exp: Exp,
         scalar_math.Softplus: Softplus, scalar_math.Sigmoid: Sigmoid}
"""PyTensor's op type (matched exactly) and its stand-in."""

SWAPS_PYTENSOR_2 = {scalar_basic.Log1p: Log1p}
"""What is swapped under PyTensor 2 (PyMC 5.27-5.28), whose rank graphs ``rowsums`` sums in
one pass: there ``exp``, ``log``, ``softplus`` and ``sigmoid`` as loops of their own made
the rank's graph at 10^5 rows slower (logistic 3458 -> 5642 us, negbin 6121 -> 8133;
``bench/pymc_gallery.py --parts graphs``, 2026-12-07), ``log1p`` faster (robust 944 -> 212
at 50,000 rows)."""

# fdlibm's e_log.c: ln(2) split in two (hi, lo) and its coefficients Lg1-Lg7.
_LOG_OF = """
def log_of(f, dk, c):
    s = np.true_divide(f, 2.0 + f)
    z = s * s
    w = z * z
    t1 = w * (0.3999999999940941908 + w * (0.2222219843214978396 + w * 0.1531383769920937332))
    t2 = z * (0.6666666666666735130 + w * (0.2857142874366239149
                                          + w * (0.1818357216161805012 + w * 0.1479819860511658591)))
    hfsq = 0.5 * f * f
    return dk * 6.93147180369123816490e-01 - ((hfsq - (s * (hfsq + t1 + t2)
                                                       + (dk * 1.90821492927058770002e-10 + c))) - f)
"""

_LOG1P = """
def log1p(x):
    u = 1.0 + x
    near = (x >= -0.2928932188134524) & (x < 0.41421356237309503)
    bits = as_int(u)
    k = ((bits >> 52) & 0x7ff) - 1023
    m = as_float((bits & 0x000fffffffffffff) | 0x3ff0000000000000)
    big = m > 1.4142135623730951
    m = m * 0.5 if big else m
    k = 0 if near else (k + 1 if big else k)
    f = x if near else m - 1.0
    c = 0.0 if near else np.true_divide(x - (u - 1.0), u)
    y = log_of(f, float(k), c)
    y = x if x == 0.0 else y
    sp = np.inf if u == np.inf else (-np.inf if u == 0.0 else np.nan)
    return y if (u > 0.0) & (u < np.inf) else sp
"""

_LOG = """
def log(x):
    tiny = x < 2.2250738585072014e-308
    bits = as_int(x * 18014398509481984.0 if tiny else x)
    k = ((bits >> 52) & 0x7ff) - (1077 if tiny else 1023)
    m = as_float((bits & 0x000fffffffffffff) | 0x3ff0000000000000)
    big = m > 1.4142135623730951
    m = m * 0.5 if big else m
    k = k + 1 if big else k
    y = log_of(m - 1.0, float(k), 0.0)
    sp = np.inf if x == np.inf else (-np.inf if x == 0.0 else np.nan)
    return y if (x > 0.0) & (x < np.inf) else sp
"""

# fdlibm's e_exp.c: ln(2) split in two, 1 / ln(2), its coefficients P1-P5 and thresholds.
_EXP = """
def exp(x):
    xc = min(max(x, -746.0), 710.0)
    kf = np.trunc(xc * 1.44269504088896338700 + (0.5 if xc >= 0.0 else -0.5))
    hi = xc - kf * 6.93147180369123816490e-01
    lo = kf * 1.90821492927058770002e-10
    r = hi - lo
    t = r * r
    c = r - t * (1.66666666666666019037e-01 + t * (-2.77777777770155933842e-03 + t * (
        6.61375632143793436117e-05 + t * (-1.65339022054652515390e-06
                                          + t * 4.13813679705723846039e-08))))
    y = 1.0 - ((lo - np.true_divide(r * c, 2.0 - c)) - hi)
    k = np.int64(kf)
    half = k >> 1
    y = y * as_float((half + 1023) << 52) * as_float((k - half + 1023) << 52)
    y = np.inf if x > 7.09782712893383973096e+02 else y
    y = 0.0 if x < -7.45133219101941108420e+02 else y
    return x if x != x else y
"""

_SOFTPLUS = """
def softplus(x):
    return max(x, 0.0) + log1p(exp(-abs(x)))
"""

_SIGMOID = """
def sigmoid(x):
    return np.true_divide(1.0, 1.0 + exp(-x))
"""

SOURCES = {Log1p: ("log1p", _LOG1P), Log: ("log", _LOG), Exp: ("exp", _EXP),
           Softplus: ("softplus", _SOFTPLUS), Sigmoid: ("sigmoid", _SIGMOID)}


class SwapScalars(GraphRewriter):
    """Swaps each float64 elementwise op of ``SWAPS`` over an axis (the rows) for its
    stand-in; one on scalars stays PyTensor's, fused with the scalars around it."""

    def add_requirements(self, fgraph):
        from pytensor.graph.features import ReplaceValidate
        fgraph.attach_feature(ReplaceValidate())

    def apply(self, fgraph):
        if not _register_numba():    # here too: a process given the mode, not made it, compiles
            return
        swaps = SWAPS if rowsums.fuses_itself() else SWAPS_PYTENSOR_2
        pairs = []
        for node in fgraph.toposort():
            if not isinstance(node.op, Elemwise) or node.op.inplace_pattern:
                continue
            ours = swaps.get(type(node.op.scalar_op))
            out = node.outputs[0]
            if (ours is not None and out.dtype == "float64" and out.ndim > 0
                    and all(i.dtype == "float64" for i in node.inputs)):
                scalar_op = ours(node.op.scalar_op.output_types_preference,
                                 name=node.op.scalar_op.name)
                pairs.append((out, Elemwise(scalar_op)(*node.inputs)))
        if pairs:
            fgraph.replace_all_validate(pairs, reason="synkhronos_scalars")
            logger.debug("rank graph: %d loop(s) of log1p, log, exp, softplus or sigmoid "
                         "vectorised", len(pairs))


def in_numba(mode):
    """``mode`` with ``SwapScalars`` where it compiles with Numba, else ``mode`` unchanged."""
    if compat.linker_name(mode) != "numba" or not _register_numba():
        return mode
    return mode.register((SwapScalars(), POSITION))


_REGISTERED = []


def _register_numba():
    """Teaches PyTensor's Numba backend the stand-ins (once); False where this PyTensor's
    Numba backend lacks the hooks (then nothing is swapped)."""
    if _REGISTERED:
        return _REGISTERED[0]
    try:
        from pytensor.link.numba.cache import compile_numba_function_src
        from pytensor.link.numba.dispatch import basic as numba_basic
        from pytensor.link.numba.dispatch.basic import register_funcify_and_cache_key
    except ImportError as exc:
        logger.debug("rank graph: log1p, log, exp, softplus and sigmoid left to PyTensor "
                     "(%s)", exc)
        _REGISTERED.append(False)
        return False

    as_int, as_float = _bitcasts()
    env = {"np": np, "as_int": as_int, "as_float": as_float}

    def strict(name, src):
        # No fast-math flags, inlined by LLVM into the loop (see the module's docstring).
        fn = numba_basic.numba_njit(compile_numba_function_src(src, name, dict(env)),
                                    fastmath=False, forceinline=True)
        env[name] = fn
        return fn

    strict("log_of", _LOG_OF)
    compiled = {}
    for op_type in (Log1p, Log, Exp, Softplus, Sigmoid):   # softplus and sigmoid read those
        name, src = SOURCES[op_type]
        compiled[op_type] = strict(name, src)
    every = (_LOG_OF,) + tuple(src for _, src in SOURCES.values())
    for op_type, fn in compiled.items():
        key = hashlib.sha256(str(("synkhronos.scalars", op_type.__name__, VERSION,
                                  every)).encode()).hexdigest()

        @register_funcify_and_cache_key(op_type)
        def _numba(op, node=None, fn=fn, key=key, **kwargs):
            return fn, key

    _REGISTERED.append(True)
    return True


def _bitcasts():
    """Numba intrinsics reading a float64's bits as an int64 and back: unlike
    ``math.frexp`` (a call into the C library), they leave a loop vectorisable."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    def bitcast(source, target, llvm_target):
        def typer(typingctx, x):
            return target(source), lambda context, builder, sig, args: builder.bitcast(
                args[0], llvm_target)
        return intrinsic(typer)

    return (bitcast(types.float64, types.int64, ir.IntType(64)),
            bitcast(types.int64, types.float64, ir.DoubleType()))
