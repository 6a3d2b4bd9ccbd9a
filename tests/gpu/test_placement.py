"""Device placement in GPU mode (GPU machines only): JAX functions, values in GPU memory.

Bodies run in forked children (tests/helpers/child.py).
"""

import os

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from helpers import child, gpu_env
from helpers.gpu_env import N_GPUS, needs_gpu
from synkhronos.runtime import devices

pytestmark = needs_gpu


def _on_gpu(rt, names):
    """Every rank: the named variables hold JAX arrays in its GPU's memory."""
    import jax

    for s in rt.registry.shareds:
        if s.name in names:
            value = s.get_value(borrow=True, return_internal_type=True)
            assert isinstance(value, jax.Array), (rt.place.rank, s.name, type(value))
            assert {d.platform for d in value.devices()} == {gpu_env.PLATFORM}, \
                (rt.place.rank, value.devices())


def _case_mlp_step(n):
    # JAX's default float32 matmul on Ampere and later GPUs is TF32 (about 3 digits): full
    # float32 in every rank (they read it at import), so NumPy's float32 is the oracle.
    os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    run_all = child.on_every_rank()
    synk.fork(n)
    rng = np.random.default_rng(0)
    W0 = (rng.standard_normal((20, 4)) * 0.1).astype("float32")
    W = pytensor.shared(W0.copy(), name="W")
    x, y = pt.matrix("x"), pt.matrix("y")
    loss = ((pt.dot(x, W) - y) ** 2).mean()
    f = synk.function([x, y], loss, updates=[(W, W - 0.1 * pytensor.grad(loss, W))])
    assert devices.uses_jax(f.spec.fn)                     # GPU mode: JAX by default
    synk.distribute()
    run_all(_on_gpu, {"W"})
    X = rng.standard_normal((30, 20)).astype("float32")
    Y = rng.standard_normal((30, 4)).astype("float32")
    got = f(X, Y)
    np.testing.assert_allclose(got, ((X @ W0 - Y) ** 2).mean(), rtol=1e-4)
    # Every rank stepped on its own rows.
    for r, (xr, yr) in enumerate(zip(np.array_split(X, n), np.array_split(Y, n))):
        grad = 2 * xr.T @ (xr @ W0 - yr) / yr.size
        np.testing.assert_allclose(synk.get_value(r, W), W0 - 0.1 * grad, rtol=1e-4, atol=1e-6)
    run_all(_on_gpu, {"W"})
    synk.all_reduce(W, "avg")                       # NCCL with one GPU per rank
    run_all(_on_gpu, {"W"})


def test_values_live_on_the_gpu_in_every_rank():
    child.run(_case_mlp_step, N_GPUS)


def test_values_live_on_the_gpu_with_one_rank():
    child.run(_case_mlp_step, 1)
