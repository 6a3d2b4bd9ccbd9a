"""In-graph collectives in JAX mode (ordered host callbacks), in a forked child (tests/helpers/child.py).

Gradients of every collective are compared with the serial PyTensor
expectation of tests/test_ingraph.py, so each gradient passes through the
collective's JAX implementation in the backward pass.
"""

import importlib.util

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from helpers import child
from synkhronos import ingraph
from synkhronos.inputs import rank_rows
from synkhronos.extensions.batchnorm import SyncBatchNorm
from test_ingraph import COLLECTIVES, every_grad_function, grad_data, serial_grads

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                       reason="needs jax (pip install synkhronos[jax])"),
    pytest.mark.timeout(110),
]


def _case_psum_and_batchnorm(n, wrt_x=False):
    child.enable_jax()
    synk.fork(n, use_gpu=False)
    x = pt.dmatrix("x")
    bn = SyncBatchNorm(3)
    y = bn(pt.cast(x, bn.gamma.dtype))
    objective = pt.sqr(y).sum() / ingraph.psum(pt.cast(x.shape[0], "float64")) + y[:, 0].sum()
    outs = [(ingraph.psum(x.sum(axis=0)), "max"), (ingraph.pmax(x.max(axis=0)), "max"),
            (y, "gather"), (pytensor.grad(objective, bn.gamma), "sum")]
    if wrt_x:  # a backward pass through global_moments' psums
        outs.append((pytensor.grad(objective, x), "gather"))
    f = synk.function([x], outs, mode="JAX")
    serial = pytensor.function([x], [o for o, _ in outs], mode="JAX")
    synk.distribute()
    x_data = np.random.default_rng(0).normal(size=(7, 3))
    got = f(x_data)
    np.testing.assert_allclose(got[0], x_data.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(got[1], x_data.max(axis=0), rtol=1e-12)
    # Collectives are the identity outside a call, and the ranks' objectives
    # add up to the serial one: summed (gamma) and gathered (x) gradients
    # equal serial PyTensor's.
    want = serial(x_data)
    for g, w in zip(got[2:], want[2:]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_psum_and_batchnorm_on_jax(n):
    child.run(_case_psum_and_batchnorm, n)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="known: in JAX mode the gradient of global_moments' concatenate (a "
                   "Split) gets traced sizes, ConcretizationTypeError (extensions/batchnorm.py)")
def test_batchnorm_input_gradient_on_jax():
    child.run(_case_psum_and_batchnorm, 2, True)


def _case_every_gradient(n):
    child.enable_jax()
    synk.fork(n, use_gpu=False)
    reduce_grads = every_grad_function("JAX", COLLECTIVES[:4])
    gather_grad = every_grad_function("JAX", ["all_gather"])
    x = pt.dmatrix("x")
    gather = synk.function([x], [(ingraph.all_gather(2 * x), None)], mode="JAX")
    synk.distribute()
    expect = serial_grads(n)
    for rows in (7, 2 * n, 2):  # uneven, even, a rank without rows (n=3)
        x_data, c_data = grad_data(rows)
        want = expect(x_data, c_data)
        for name, g, w in zip(COLLECTIVES, reduce_grads(x_data, c_data), want):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"{name} {rows}")
    for rows in (2 * n, 3 * n):  # all_gather in JAX mode: the same rows on every rank
        x_data, c_data = grad_data(rows)
        np.testing.assert_allclose(gather_grad(x_data, c_data)[0], expect(x_data, c_data)[4],
                                   rtol=1e-10, atol=1e-12, err_msg=f"all_gather {rows}")
        for value in gather(x_data)[0]:
            np.testing.assert_array_equal(value, 2 * x_data)
    uneven = grad_data(2 * n + 1)[0]
    assert len({rank_rows.rank_range(len(uneven), n, r)[1] - rank_rows.rank_range(len(uneven), n, r)[0]
                for r in range(n)}) > 1
    with pytest.raises(Exception, match="every rank must hold the same number of rows"):
        gather(uneven)
    for value in gather(uneven[:n])[0]:  # still usable
        np.testing.assert_array_equal(value, 2 * uneven[:n])
    # Outside a call all_gather is the identity, but not in a trace made for a call.
    np.testing.assert_array_equal(gather.as_theano(uneven[:5])[0], 2 * uneven[:5])
    with pytest.raises(Exception, match=f"traced for {n} rank"):
        gather.as_theano(uneven[:1])  # the master's shape in the call above


@pytest.mark.parametrize("n", [2, 3])
def test_every_gradient_and_all_gather_on_jax(n):
    child.run(_case_every_gradient, n)
