"""Collectives through NCCL on real GPUs, and the host path when ranks share a GPU.

GPU machines only; with one GPU the NCCL runs have one rank (the communicator,
grouping, DLPack hand-over and scaling still run for real).  Bodies run in
forked children (tests/helpers/child.py).
"""

import logging

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from helpers import child, gpu_env
from helpers.gpu_env import N_GPUS, needs_cupy, needs_gpu
from synkhronos.runtime.state import get_runtime

pytestmark = needs_gpu + [needs_cupy]

OPS = {"avg": np.mean, "sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}


def _on_gpu(rt, names):
    import jax

    for s in rt.registry.shareds:
        if s.name in names:
            value = s.get_value(borrow=True, return_internal_type=True)
            assert isinstance(value, jax.Array), (rt.place.rank, s.name, type(value))
            assert {d.platform for d in value.devices()} == {gpu_env.PLATFORM}


def _connected(rt):
    assert rt.backend.device_arrays and rt.backend.comm is not None, rt.place.rank


def _check_all(n, var, per_rank, rtol=1e-6):
    for r in range(n):
        np.testing.assert_allclose(synk.get_value(r, var), per_rank[r], rtol=rtol,
                                   err_msg=f"{var} in rank {r}")


def _case_collectives(n):
    run_all = child.on_every_rank()
    synk.fork(n)
    v = pytensor.shared(np.zeros(5, "float32"), name="v")
    g = pytensor.shared(np.zeros(6_000_001, "float32"), name="g")   # a 24 MB flat gradient
    i = pytensor.shared(np.zeros(4, "int32"), name="i")
    L = pytensor.shared(np.zeros(2, "float32"), name="L")
    synk.function([], v.sum() + g.sum() + i.sum() + L.sum())
    synk.distribute()
    run_all(_on_gpu, {"v", "g", "i", "L"})
    rng = np.random.default_rng(1)
    vals = [rng.integers(1, 4, 5).astype("float32") for _ in range(n)]
    for op, ref in OPS.items():
        for r in range(n):
            synk.set_value(r, v, vals[r])
        synk.all_reduce(v, op)
        _check_all(n, v, [ref(np.stack(vals), axis=0)] * n)
    if n > 1:   # one rank's reductions give back their inputs: no communicator yet
        run_all(_connected)
    run_all(_on_gpu, {"v"})

    grads = [np.full(g.get_value().shape, r + 1.0, "float32") for r in range(n)]
    for r in range(n):
        synk.set_value(r, g, grads[r])
    synk.all_reduce(g, "sum")                         # one NCCL call
    _check_all(n, g, [np.full(grads[0].shape, n * (n + 1) / 2.0)] * n)

    ints = [np.arange(4, dtype="int32") + r for r in range(n)]
    for r in range(n):
        synk.set_value(r, [v, i], [vals[r], ints[r]])
    synk.all_reduce([v, i], "sum")                    # one group, two calls
    _check_all(n, i, [np.sum(ints, axis=0)] * n)
    with pytest.raises(TypeError, match="avg"):
        synk.all_reduce(i, "avg")

    for r in range(n):
        synk.set_value(r, v, vals[r])
    got = synk.reduce(v, "sum", in_place=False)
    np.testing.assert_allclose(np.asarray(got), np.sum(vals, axis=0))
    synk.broadcast(v)
    _check_all(n, v, [vals[get_runtime().place.master_rank]] * n)
    for r in range(n):
        synk.set_value(r, v, vals[r])
    np.testing.assert_allclose(np.asarray(synk.gather(v)), np.stack(vals))
    np.testing.assert_allclose(np.asarray(synk.gather(v, nd_up=0)), np.concatenate(vals))
    synk.all_gather(v)
    _check_all(n, v, [np.concatenate(vals)] * n)
    run_all(_connected)                               # gathers go through NCCL, one rank too
    run_all(_on_gpu, {"v", "g", "i"})

    if n > 1:
        # Lengths differ between ranks: the host path gathers them exactly.
        lens = [np.arange(r + 2, dtype="float32") for r in range(n)]
        for r in range(n):
            synk.set_value(r, L, lens[r])
        np.testing.assert_allclose(np.asarray(synk.gather(L, nd_up=0)), np.concatenate(lens))
        with pytest.raises(ValueError):
            synk.all_reduce(L, "sum")
        synk.all_reduce(v, "max")                     # and NCCL goes on working


def test_collectives_through_nccl_on_every_gpu():
    child.run(_case_collectives, N_GPUS)


def test_collectives_through_nccl_on_one_gpu():
    child.run(_case_collectives, 1)


def _case_shared_gpu(n_gpus):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("synkhronos").addHandler(handler)
    n = 2 * n_gpus
    synk.fork(n, use_gpu=True)                        # two ranks on every GPU
    v = pytensor.shared(np.zeros(3, "float32"), name="v")
    x = pt.vector("x")
    f = synk.function([x], (x.sum() + v.sum(), "sum"))
    synk.distribute()
    for r in range(n):
        synk.set_value(r, v, np.full(3, r + 1.0, "float32"))
    synk.all_reduce(v, "sum")
    total = n * (n + 1) / 2.0
    _check_all(n, v, [np.full(3, total)] * n)
    assert sum("share" in r.getMessage() for r in records) == 1
    synk.all_reduce(v, "sum", nccl=False)
    _check_all(n, v, [np.full(3, n * total)] * n)
    xs = np.arange(4 * n, dtype="float32")             # rows for every rank
    np.testing.assert_allclose(f(xs), xs.sum() + n * 3 * n * total, rtol=1e-5)


def test_ranks_sharing_a_gpu_take_the_host_path():
    child.run(_case_shared_gpu, N_GPUS)
