"""In-graph collectives in JAX mode (ordered host callbacks), in a forked child (tests/helpers/child.py)."""

import importlib.util

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from helpers import child
from synkhronos import ingraph
from synkhronos.extensions.batchnorm import SyncBatchNorm

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                       reason="needs jax (pip install synkhronos[jax])"),
    pytest.mark.timeout(110),
]


def _case_psum_and_batchnorm(n):
    child.enable_jax()
    synk.fork(n, use_gpu=False)
    x = pt.dmatrix("x")
    bn = SyncBatchNorm(3)
    y = bn(pt.cast(x, bn.gamma.dtype))
    objective = pt.sqr(y).sum() / ingraph.psum(pt.cast(x.shape[0], "float64")) + y[:, 0].sum()
    outs = [(ingraph.psum(x.sum(axis=0)), "max"), (ingraph.pmax(x.max(axis=0)), "max"),
            (y, "gather"), (pytensor.grad(objective, bn.gamma), "sum")]
    f = synk.function([x], outs, mode="JAX")
    serial = pytensor.function([x], [o for o, _ in outs], mode="JAX")
    synk.distribute()
    x_data = np.random.default_rng(0).normal(size=(7, 3))
    got = f(x_data)
    np.testing.assert_allclose(got[0], x_data.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(got[1], x_data.max(axis=0), rtol=1e-12)
    want = serial(x_data)  # collectives are the identity outside a call
    for g, w in zip(got[2:], want[2:]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_psum_and_batchnorm_on_jax(n):
    child.run(_case_psum_and_batchnorm, n)
