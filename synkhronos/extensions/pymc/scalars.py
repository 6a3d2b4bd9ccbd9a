"""``log1p`` in a rank's Numba graph as a loop the compiler vectorises.

PyTensor's Numba backend calls the C library's ``log1p`` once a row.  The
one glibc ships (2.36 here) takes 9-11 ns an element for arguments above
about 0.3 and 3.5 below, and a call into the C library keeps LLVM from
vectorising the loop around it.  A Student-t likelihood spends most of its
row there: the gallery's robust regression at its draws' typical position
(most rows' ``(z^2 / nu)`` near 1) ran PyMC's call in 1374 us at 10^5 rows,
606 us at the initial point, where the arguments are small.

So in a rank's graph compiled by Numba, each float64 ``Log1p`` is swapped,
before PyTensor fuses the loops, for ``Log1p`` below, whose Numba code
(``_LOG1P``) is fdlibm's ``log``: the argument's exponent and mantissa read
from its bits (``_bitcasts``, no call), then a polynomial in
``s = f / (2 + f)``.  Where ``1 + x`` lies in [sqrt(1/2), sqrt(2)) the
polynomial takes ``f = x`` itself, exactly; elsewhere ``f`` comes from the
rounded ``u = 1 + x`` and ``((x - (u - 1)) / u)`` corrects the rounding.  Two
things keep the loop vectorised:

- the function is compiled without fast-math flags (reassociated, ``x - (u - 1)``
  folds to zero) and inlined by LLVM into the loop (``forceinline``), where
  its instructions keep their own flags;
- the op stays out of PyTensor's elementwise fusion (``supports_c_code``):
  PyTensor's fused loop calls its composite once a row, and once the
  composite holds the polynomial and a gradient's terms it is too large for
  LLVM to inline, so nothing in it vectorises.  The ``log1p`` runs as a loop of
  its own, the terms around it fused as before.

Robust's graph on 50,000 rows (one-off probe, bench/HISTORY.md, 2026-12-07):
PyTensor 3.3 752 -> 179 us at the typical position, 344 -> 182 at the initial
point; PyTensor 2.38 944 -> 212.  The value is within 1 ulp of glibc's over
10^-300..10^300, (-1, 0) and (-1, 5) (``tests/extensions/test_pymc_scalars.py``),
and at 0, -0, -1, below -1, inf and nan it is glibc's.  Every other backend,
and PyMC's own function, runs PyTensor's ``log1p``.
"""

import hashlib
import logging

import numpy as np
from pytensor.graph.rewriting.basic import GraphRewriter
from pytensor.scalar import basic as scalar_basic
from pytensor.tensor.elemwise import Elemwise

from ... import compat

logger = logging.getLogger(__name__)

VERSION = 1
"""Part of the Numba cache key: raise it where the Numba code below changes."""

POSITION = 48.9
"""Where the swap runs among PyTensor's rewrites: after those that write ``log1p``
(canonicalize, stabilize, specialize), before the elementwise fusion (49)."""


class Log1p(scalar_basic.Log1p):
    """PyTensor's ``log1p``, in Numba as ``_LOG1P``; never fused with other loops."""

    def supports_c_code(self, inputs, outputs):
        # PyTensor fuses only ops that say they have C code (see the module's docstring).
        return False


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
    s = np.true_divide(f, 2.0 + f)
    z = s * s
    w = z * z
    t1 = w * (0.3999999999940941908 + w * (0.2222219843214978396 + w * 0.1531383769920937332))
    t2 = z * (0.6666666666666735130 + w * (0.2857142874366239149
                                          + w * (0.1818357216161805012 + w * 0.1479819860511658591)))
    hfsq = 0.5 * f * f
    dk = float(k)
    y = dk * 6.93147180369123816490e-01 - ((hfsq - (s * (hfsq + t1 + t2)
                                                    + (dk * 1.90821492927058770002e-10 + c))) - f)
    y = x if x == 0.0 else y
    sp = np.inf if u == np.inf else (-np.inf if u == 0.0 else np.nan)
    return y if (u > 0.0) & (u < np.inf) else sp
"""
# fdlibm's e_log.c: ln(2) split in two (hi, lo) and its Remez coefficients Lg1-Lg7;
# np.true_divide, not "/", so no zero check under Numba's Python error model.


class SwapLog1p(GraphRewriter):
    """Swaps each float64 elementwise ``log1p`` over an axis (the rows) for ``Log1p``; one
    on scalars stays PyTensor's, fused with the scalars around it."""

    def add_requirements(self, fgraph):
        from pytensor.graph.features import ReplaceValidate
        fgraph.attach_feature(ReplaceValidate())

    def apply(self, fgraph):
        if not _register_numba():    # here too: a process given the mode, not made it, compiles
            return
        pairs = []
        for node in fgraph.toposort():
            if (isinstance(node.op, Elemwise) and not node.op.inplace_pattern
                    and type(node.op.scalar_op) is scalar_basic.Log1p
                    and node.outputs[0].dtype == "float64" and node.outputs[0].ndim > 0):
                ours = Log1p(node.op.scalar_op.output_types_preference, name=node.op.scalar_op.name)
                pairs.append((node.outputs[0], Elemwise(ours)(*node.inputs)))
        if pairs:
            fgraph.replace_all_validate(pairs, reason="synkhronos_log1p")
            logger.debug("rank graph: %d log1p loop(s) vectorised", len(pairs))


def in_numba(mode):
    """``mode`` with ``SwapLog1p`` where it compiles with Numba, else ``mode`` unchanged."""
    if compat.linker_name(mode) != "numba" or not _register_numba():
        return mode
    return mode.register((SwapLog1p(), POSITION))


_REGISTERED = []


def _register_numba():
    """Teaches PyTensor's Numba backend ``Log1p`` (once); False where this PyTensor's
    Numba backend lacks the hooks (then nothing is swapped)."""
    if _REGISTERED:
        return _REGISTERED[0]
    try:
        from pytensor.link.numba.cache import compile_numba_function_src
        from pytensor.link.numba.dispatch import basic as numba_basic
        from pytensor.link.numba.dispatch.basic import register_funcify_and_cache_key
    except ImportError as exc:
        logger.debug("rank graph: log1p left to PyTensor (%s)", exc)
        _REGISTERED.append(False)
        return False

    as_int, as_float = _bitcasts()
    env = {"np": np, "as_int": as_int, "as_float": as_float}
    # No fast-math flags, inlined by LLVM into the loop (see the module's docstring).
    fn = numba_basic.numba_njit(compile_numba_function_src(_LOG1P, "log1p", env), fastmath=False,
                                forceinline=True)
    key = hashlib.sha256(str(("synkhronos.scalars", "Log1p", VERSION, _LOG1P)).encode()).hexdigest()

    @register_funcify_and_cache_key(Log1p)
    def _numba_log1p(op, node=None, **kwargs):
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
