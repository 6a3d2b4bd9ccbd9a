"""synkhronos.extensions.ops (convolution, pooling, batch norm) vs. NumPy direct loops and finite differences.

Every case runs on the default mode (Numba kernels), the Python linker (the
Ops' ``perform``) and JAX on the CPU.  JAX cases run in a forked child of the
pytest process (tests/helpers/child.py), which never starts JAX itself.  On
the default mode, Numba falling back to an Op's ``perform`` in object mode
is an error: every Op has a Numba implementation.
"""

import contextlib
import importlib.util
import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.op import Op

from helpers import child
from synkhronos.extensions import ops
from synkhronos.extensions.ops import batch_norm, conv, pool

MODES = [None, "FAST_COMPILE", "JAX"]
HAS_JAX = importlib.util.find_spec("jax") is not None


# ---- independent references: direct loops ------------------------------------------

def ref_conv(x, w, s, p, d, g):
    """NCHW cross-correlation, one output element at a time."""
    n, _, h, wd = x.shape
    f, cg, fh, fw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    oh = (h + 2 * p - d * (fh - 1) - 1) // s + 1
    ow = (wd + 2 * p - d * (fw - 1) - 1) // s + 1
    out = np.zeros((n, f, oh, ow))
    fg = f // g
    for b, o, y, xx in np.ndindex(n, f, oh, ow):
        grp = o // fg
        acc = 0.0
        for ci, i, j in np.ndindex(cg, fh, fw):
            acc += xp[b, grp * cg + ci, y * s + i * d, xx * s + j * d] * w[o, ci, i, j]
        out[b, o, y, xx] = acc
    return out


def ref_pool(x, size, s, p, kind):
    """NCHW max or average (padding counted as zeros) pooling by loops."""
    n, c, h, w = x.shape
    oh, ow = (h + 2 * p - size) // s + 1, (w + 2 * p - size) // s + 1
    out = np.zeros((n, c, oh, ow))
    for b, k, y, xx in np.ndindex(n, c, oh, ow):
        vals = [x[b, k, y * s + i - p, xx * s + j - p] for i, j in np.ndindex(size, size)
                if 0 <= y * s + i - p < h and 0 <= xx * s + j - p < w]
        out[b, k, y, xx] = max(vals) if kind == "max" else sum(vals) / size ** 2
    return out


def ref_bn(x, gamma, beta, eps, groups):
    """Features-last batch norm over row groups, with the groups' mean statistics."""
    rows = x.reshape(-1, x.shape[-1])
    m = len(rows) // groups
    out, means, varis = np.empty_like(rows), [], []
    for grp in range(groups):
        r = rows[grp * m:(grp + 1) * m]
        mean = r.sum(axis=0) / m
        var = ((r - mean) ** 2).sum(axis=0) / m
        out[grp * m:(grp + 1) * m] = (r - mean) / np.sqrt(var + eps) * gamma + beta
        means.append(mean)
        varis.append(var)
    return out.reshape(x.shape), np.mean(means, axis=0), np.mean(varis, axis=0)


def numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    for k in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[k] += eps
        xm[k] -= eps
        g[k] = (f(xp) - f(xm)) / (2 * eps)
    return g


def to_layout(a, layout, weights=False):
    """An NCHW array (or OIHW weights) in ``layout``."""
    if layout == "NCHW":
        return a
    return a.transpose(2, 3, 1, 0) if weights else a.transpose(0, 2, 3, 1)


def from_layout(a, layout, weights=False):
    if layout == "NCHW":
        return a
    return a.transpose(3, 2, 0, 1) if weights else a.transpose(0, 3, 1, 2)


@contextlib.contextmanager
def no_object_mode():
    """Make the Numba backend's fallback to an Op's ``perform`` (object mode) an error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Numba will use object mode", category=UserWarning)
        yield


def in_mode(mode, fn, *args):
    """Run ``fn(mode, *args)`` here, or for JAX in a forked child with float64 enabled.

    On the default mode (None, Numba) an object-mode fallback raises.
    """
    if mode is None:
        with no_object_mode():
            return fn(mode, *args)
    if mode != "JAX":
        return fn(mode, *args)
    if not HAS_JAX:
        pytest.skip("needs jax")

    def body():
        child.enable_jax()
        fn(mode, *args)
    child.run(body)


# ---- convolution ----------------------------------------------------------------------

CONV_CASES = [  # (x shape NCHW, filters, kernel, stride, pad, dilation, groups, layout)
    ((2, 4, 7, 6), 6, (3, 2), 2, 1, 2, 2, "NCHW"),
    ((2, 3, 5, 5), 4, (1, 1), 1, 0, 1, 1, "NHWC"),
    ((1, 2, 6, 5), 3, (3, 3), 1, 1, 1, 1, "NHWC"),
    ((2, 2, 5, 7), 4, (1, 1), 2, 0, 1, 1, "NCHW"),
]


def _check_conv(mode, case):
    shape, f, (fh, fw), s, p, d, g, layout = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((f, shape[1] // g, fh, fw))
    y_ref = ref_conv(x, w, s, p, d, g)
    c = rng.standard_normal(y_ref.shape)
    xs = to_layout(x, layout)
    ws = to_layout(w, layout, weights=True)
    xt = pt.tensor("x", dtype="float64", shape=(None,) + xs.shape[1:])
    wt = pt.tensor("w", dtype="float64", shape=ws.shape)
    y = ops.conv2d(xt, wt, s, p, d, g, layout)
    assert y.type.shape[1:] == to_layout(y_ref, layout).shape[1:]   # static, from make_node
    obj = (y * to_layout(c, layout)).sum()
    fn = pytensor.function([xt, wt], [y, *pytensor.grad(obj, [xt, wt])], mode=mode)
    yv, gx, gw = (np.asarray(v) for v in fn(xs, ws))
    np.testing.assert_allclose(from_layout(yv, layout), y_ref, rtol=1e-10, atol=1e-12)

    def loss(xv, wv):
        return (ref_conv(xv, wv, s, p, d, g) * c).sum()
    np.testing.assert_allclose(from_layout(gx, layout), numeric_grad(lambda v: loss(v, w), x),
                               rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(from_layout(gw, layout, weights=True),
                               numeric_grad(lambda v: loss(x, v), w), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c[7]}-k{c[2][0]}{c[2][1]}-s{c[3]}"
                         f"-p{c[4]}-d{c[5]}-g{c[6]}")
def test_conv2d_matches_loops(mode, case):
    in_mode(mode, _check_conv, case)


# ---- pooling ------------------------------------------------------------------------------

POOL_CASES = [("max", 3, 2, 1, "NHWC"), ("max", 2, 2, 0, "NCHW"), ("avg", 3, 2, 1, "NCHW"),
              ("avg", 2, 1, 1, "NHWC")]


def _check_pool(mode, case):
    kind, size, s, p, layout = case
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 7, 6))
    y_ref = ref_pool(x, size, s, p, kind)
    c = rng.standard_normal(y_ref.shape)
    xs = to_layout(x, layout)
    xt = pt.tensor("x", dtype="float64", shape=(None,) + xs.shape[1:])
    y = (ops.max_pool2d if kind == "max" else ops.avg_pool2d)(xt, size, s, p, layout)
    assert y.type.shape[1:] == to_layout(y_ref, layout).shape[1:]
    obj = (y * to_layout(c, layout)).sum()
    fn = pytensor.function([xt], [y, pytensor.grad(obj, xt)], mode=mode)
    yv, gx = (np.asarray(v) for v in fn(xs))
    np.testing.assert_allclose(from_layout(yv, layout), y_ref, rtol=1e-12, atol=1e-12)
    num = numeric_grad(lambda v: (ref_pool(v, size, s, p, kind) * c).sum(), x)
    np.testing.assert_allclose(from_layout(gx, layout), num, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"{c[0]}{c[1]}-s{c[2]}-p{c[3]}-{c[4]}")
def test_pool2d_matches_loops(mode, case):
    in_mode(mode, _check_pool, case)


# ---- batch norm ---------------------------------------------------------------------------

def _check_bn(mode, groups, nchw):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 5, 3))          # features last
    gamma, beta = rng.standard_normal(3), rng.standard_normal(3)
    y_ref, m_ref, v_ref = ref_bn(x, gamma, beta, 1e-3, groups)
    c = rng.standard_normal(x.shape)
    xs = x.transpose(0, 3, 1, 2) if nchw else x
    xt = pt.tensor("x", dtype="float64", shape=(None,) + xs.shape[1:])
    gt, bt = pt.dvector("gamma"), pt.dvector("beta")
    y, mean, var = ops.batch_norm_train(xt, gt, bt, 1 if nchw else -1, 1e-3, groups)
    obj = (y * (c.transpose(0, 3, 1, 2) if nchw else c)).sum()
    fn = pytensor.function([xt, gt, bt], [y, mean, var, *pytensor.grad(obj, [xt, gt, bt])],
                           mode=mode)
    yv, mv, vv, gx, gg, gb = (np.asarray(v) for v in fn(xs, gamma, beta))
    if nchw:
        yv, gx = yv.transpose(0, 2, 3, 1), gx.transpose(0, 2, 3, 1)
    np.testing.assert_allclose(yv, y_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(mv, m_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(vv, v_ref, rtol=1e-10, atol=1e-12)

    def loss(xv, gv, bv):
        return (ref_bn(xv, gv, bv, 1e-3, groups)[0] * c).sum()
    np.testing.assert_allclose(gx, numeric_grad(lambda v: loss(v, gamma, beta), x),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gg, numeric_grad(lambda v: loss(x, v, beta), gamma), rtol=1e-6)
    np.testing.assert_allclose(gb, numeric_grad(lambda v: loss(x, gamma, v), beta), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("groups,nchw", [(1, False), (2, True)])
def test_batch_norm_matches_loops(mode, groups, nchw):
    in_mode(mode, _check_bn, groups, nchw)


# ---- shapes and misuse -------------------------------------------------------------------

def test_static_shapes_and_errors():
    x = pt.tensor4("x", shape=(8, 3, 32, 32))
    w = pt.tensor4("w", shape=(16, 3, 7, 7))
    y = ops.conv2d(x, w, stride=2, padding=3)
    assert y.type.shape == (8, 16, 16, 16)
    assert ops.max_pool2d(y, 3, 2, 1).type.shape == (8, 16, 8, 8)
    assert ops.avg_pool2d(y, 2).type.shape == (8, 16, 8, 8)
    xn = pt.tensor4("xn", shape=(None, 32, 32, 3))
    wn = pt.tensor4("wn", shape=(3, 3, 3, 4))
    assert ops.conv2d(xn, wn, padding=1, layout="NHWC").type.shape == (None, 32, 32, 4)
    with pytest.raises(ValueError, match="layout"):
        ops.conv2d(x, w, layout="CHWN")
    with pytest.raises(ValueError, match="channels"):
        ops.conv2d(x, pt.tensor4("w2", shape=(16, 2, 3, 3)))
    with pytest.raises(ValueError, match="does not fit"):
        ops.conv2d(pt.tensor4("s", shape=(1, 3, 2, 2)), w)
    with pytest.raises(ValueError, match="padding"):
        ops.max_pool2d(x, 2, padding=2)
    with pytest.raises(ValueError, match="static"):
        pytensor.grad(ops.conv2d(pt.tensor4("d"), w).sum(), w)


# ---- no object mode -------------------------------------------------------------------------

def _op_classes():
    """Every Op class the conv, pool and batch-norm modules define (their bases excluded)."""
    return {cls for m in (conv, pool, batch_norm) for name, cls in vars(m).items()
            if isinstance(cls, type) and issubclass(cls, Op) and cls.__module__ == m.__name__
            and not name.startswith("_")}


def test_default_mode_never_falls_back_to_object_mode():
    x = pt.tensor("x", dtype="float64", shape=(None, 3, 8, 8))
    w = pt.tensor("w", dtype="float64", shape=(4, 3, 3, 3))
    g4, g8 = pt.dvector("g4"), pt.dvector("g8")
    y = ops.conv2d(x, w, padding=1)
    objective = (ops.max_pool2d(y, 2).sum() + ops.avg_pool2d(y, 3, 1, 1).sum()
                 + (ops.batch_norm_train(y, g4, g4 / 2, 1)[0] ** 2).sum()    # channels first
                 + (ops.batch_norm_train(x, g8, g8 / 2, -1)[0] ** 2).sum())  # features last
    outs = [objective, *pytensor.grad(objective, [x, w, g4, g8])]
    with no_object_mode():
        fn = pytensor.function([x, w, g4, g8], outs)
        rng = np.random.default_rng(3)
        got = fn(rng.standard_normal((2, 3, 8, 8)), rng.standard_normal((4, 3, 3, 3)),
                 rng.standard_normal(4), rng.standard_normal(8))
    assert type(fn.maker.linker).__name__ == "NumbaLinker"
    # Every Op of these modules was compiled here, so none has a fallback left untried.
    assert _op_classes() <= {type(node.op) for node in fn.maker.fgraph.apply_nodes}
    assert len(_op_classes()) == 9
    assert all(np.all(np.isfinite(v)) for v in got)
