"""More ranks than cores: 8 and 16 ranks against NumPy and serial PyTensor.

One runtime per rank count and backend serves the module (forked, built and distributed once):
calls with every output op, with batch and num_slices, updates; every collective
with every reduce op; Data made before distribute(), grown and dropped; a
checkpoint of per-rank values; an error raised in one rank.  Expectations come from
NumPy and serial PyTensor only.  A rank killed among 16 and 64 ranks: test_rank_limits.py.
"""

import os

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos.runtime.state import get_runtime
from synkhronos.variables import checkpoint

from helpers.procs import FailInRank

pytestmark = pytest.mark.timeout(120)

MODE = "FAST_COMPILE"     # the graphs are trivial: compiling must not dominate
N_ROWS = 101              # uneven on 8 and 16 ranks, and every rank has rows
OPS = ["avg", "sum", "prod", "max", "min"]
BIG = 70_001              # float32 elements: the shm backend splits its reduction among ranks


def shares(a, n):
    return np.array_split(a, n)


@pytest.fixture(scope="module", params=[(8, "shm"), (16, "shm"), (8, "zmq")],
                ids=lambda p: f"{p[0]}ranks-{p[1]}")
def env(request, runtime_keeper):
    """Shared memory (workers started again from the master at distribute()), and ZeroMQ
    (the same workers throughout, every function pickled to them)."""
    n, backend = request.param
    saved = os.environ.get("SYNK_BACKEND")
    os.environ["SYNK_BACKEND"] = backend
    try:
        runtime_keeper.fork(n)
    finally:
        if saved is None:
            del os.environ["SYNK_BACKEND"]
        else:
            os.environ["SYNK_BACKEND"] = saved
    try:
        e = _build(n)
    except BaseException:
        runtime_keeper.close()
        raise
    procs = list(get_runtime().processes.procs.values())
    yield e
    runtime_keeper.close()
    assert all(not p.is_alive() for p in procs)


def _build(n):
    class Env:
        pass

    e = Env()
    e.n = n
    x = pt.dmatrix("x")
    outs = [(x.mean(axis=0), "avg"), (x.sum(axis=0), "sum"), ((1 + 0.01 * x).prod(axis=0), "prod"),
            (x.max(axis=0), "max"), (x.min(axis=0), "min"), (x.sum(axis=0), None),
            (2 * x + 1, "gather")]
    e.ops = [op for _, op in outs]
    e.f_ops = synk.function([x], outs, mode=MODE)
    e.f_sliced = synk.function([x], [o for o in outs if o[1] is not None], mode=MODE)
    e.serial = pytensor.function([x], [o for o, _ in outs], mode=MODE)
    e.w = pytensor.shared(np.array([0.5, -1.0, 2.0]), name="w")
    e.f_upd = synk.function([x], (x.dot(e.w).sum(), "sum"),
                            updates=[(e.w, e.w - np.float64(0.01) * x.mean(axis=0))], mode=MODE)
    e.sh = {"v": pytensor.shared(np.zeros(5, "float32"), name="v"),
            "m": pytensor.shared(np.zeros((3, 4)), name="m"),
            "i": pytensor.shared(np.zeros(4, "int32"), name="i"),
            "z": pytensor.shared(np.array(0.0), name="z"),
            "big": pytensor.shared(np.zeros(BIG, "float32"), name="big")}
    total = sum(pt.sum(s) for s in e.sh.values())
    e.f_total = synk.function([], (total, None), mode=MODE)
    e.f_fail = synk.function([x], (FailInRank(n - 3)(x).sum(), "sum"), mode=MODE)
    rng = np.random.default_rng(n)
    e.early_x = rng.standard_normal((N_ROWS, 3))
    e.early = synk.data(e.early_x)        # made before distribute(): the workers map it
    synk.distribute()
    return e


def assert_ops(e, got, rows, ops=None):
    ops = e.ops if ops is None else ops
    want = [w for w, op in zip(e.serial(rows), e.ops) if op in ops]
    assert len(got) == len(want)
    for op, g, w in zip(ops, got, want):
        if op is None:
            assert len(g) == e.n
            for r, (gr, part) in enumerate(zip(g, shares(rows, e.n))):
                np.testing.assert_allclose(gr, part.sum(axis=0), rtol=1e-12, err_msg=f"rank {r}")
        else:
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14, err_msg=f"op {op}")


def test_every_output_op_equals_serial(env, rng):
    assert_ops(env, env.f_ops(env.early), env.early_x)
    x = rng.standard_normal((N_ROWS, 3)) + np.arange(N_ROWS)[:, None]
    assert_ops(env, env.f_ops(synk.data(x)), x)
    assert_ops(env, env.f_ops(x), x)       # a NumPy input, copied into Data


def test_batch_and_num_slices(env, rng):
    x = rng.standard_normal((N_ROWS, 3))
    d = synk.data(x)
    idx = np.concatenate([rng.permutation(N_ROWS)[:70], [3, 3, 3]])
    assert_ops(env, env.f_ops(d, batch=idx), x[idx])
    assert_ops(env, env.f_ops(d, batch=slice(10, 90)), x[10:90])
    assert_ops(env, env.f_ops(d, batch=60), x[:60])
    sliced = [op for op in env.ops if op is not None]
    for num_slices in (2, 3):
        assert_ops(env, env.f_sliced(d, num_slices=num_slices), x, sliced)
        assert_ops(env, env.f_sliced(d, batch=idx, num_slices=num_slices), x[idx], sliced)


def test_updates_apply_in_every_rank_on_its_rows(env, rng):
    x = rng.standard_normal((N_ROWS, 3))
    d = synk.data(x)
    w = [np.array([0.5, -1.0, 2.0])] * env.n
    for r in range(env.n):
        synk.set_value(r, env.w, w[r])
    parts = shares(x, env.n)
    for num_slices in (1, 3, 1):  # sliced, a mean-type ("avg") update equals the whole one
        got = env.f_upd(d, num_slices=num_slices)
        np.testing.assert_allclose(got, sum(p.dot(wr).sum() for p, wr in zip(parts, w)),
                                   rtol=1e-12)
        w = [wr - 0.01 * p.mean(axis=0) for p, wr in zip(parts, w)]
        np.testing.assert_allclose(synk.gather(env.w), np.stack(w), rtol=1e-12)


def _values(rank, salt=0):
    """1s and 2s, different on every rank: products of 16 ranks stay exact in float32 and int32."""
    def arr(shape, dtype, k):
        count = int(np.prod(shape))
        return ((np.arange(count) + k + rank + salt) % 2 + 1).astype(dtype).reshape(shape)
    return {"v": arr((5,), "float32", 0), "m": arr((3, 4), "float64", 1),
            "i": arr((4,), "int32", 2), "z": arr((), "float64", 3), "big": arr((BIG,), "float32", 4)}


def _set_all(e, salt=0):
    per_rank = [_values(r, salt) for r in range(e.n)]
    names = list(e.sh)
    for r in range(e.n):
        synk.set_value(r, [e.sh[k] for k in names], [per_rank[r][k] for k in names])
    return per_rank


def _reduced(op, parts):
    stack = np.stack(parts)
    if op == "avg":
        return stack.mean(axis=0)
    return {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](stack, axis=0)


def _check_ranks(e, name, per_rank):
    """Every rank's value of ``e.sh[name]`` is ``per_rank[rank]`` (gathered in one command)."""
    assert len(per_rank) == e.n
    if np.ndim(per_rank[0]) == 0:
        got, want = synk.gather(e.sh[name]), np.stack(per_rank)
    else:
        got, want = synk.gather(e.sh[name], nd_up=0), np.concatenate(per_rank)
    np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)


def test_reduce_and_all_reduce_every_op(env):
    sh = env.sh
    for op in OPS:
        names = [k for k in sh if not (op == "avg" and k == "i")]
        per_rank = _set_all(env)
        want = {k: _reduced(op, [p[k] for p in per_rank]) for k in names}
        got = synk.reduce([sh[k] for k in names], op=op, in_place=False)
        for k, g in zip(names, got):
            np.testing.assert_allclose(g, want[k], rtol=1e-6, err_msg=f"reduce {op} {k}")
        synk.all_reduce([sh[k] for k in names], op=op)
        for k in names:
            _check_ranks(env, k, [want[k]] * env.n)
        # The function reads every rank's reduced values.
        last = {k: want[k] if k in names else per_rank[-1][k] for k in sh}
        total = sum(float(np.sum(v, dtype="float64")) for v in last.values())
        np.testing.assert_allclose(env.f_total()[-1], total, rtol=1e-5)


def test_broadcast_scatter_gather_all_gather(env):
    sh, n = env.sh, env.n
    per_rank = _set_all(env, salt=1)
    for k in sh:
        _check_ranks(env, k, [p[k] for p in per_rank])
        np.testing.assert_array_equal(synk.gather(sh[k], nd_up=1), np.stack([p[k] for p in per_rank]))
    assert synk.get_shapes(sh["m"]) == [(3, 4)] * n
    assert synk.get_lengths(sh["big"]) == [BIG] * n
    synk.broadcast([sh["v"], sh["big"], sh["z"]])
    for k in ("v", "big", "z"):
        _check_ranks(env, k, [per_rank[0][k]] * n)
    rows = np.arange(n * 2 * 4, dtype="float64").reshape(n * 2, 4)
    synk.scatter(sh["m"], synk.data(rows))
    _check_ranks(env, "m", shares(rows, n))
    np.testing.assert_array_equal(synk.gather(sh["m"], nd_up=0), rows)
    synk.all_gather(sh["m"])
    _check_ranks(env, "m", [rows] * n)
    big = np.arange(2 * BIG + 5, dtype="float32")
    synk.scatter(sh["big"], big)
    _check_ranks(env, "big", shares(big, n))
    synk.set_value(n - 1, sh["v"], np.arange(9, dtype="float32"))
    assert synk.get_lengths(sh["v"]) == [5] * (n - 1) + [9]
    np.testing.assert_array_equal(synk.get_value(n - 1, sh["v"]), np.arange(9, dtype="float32"))


def test_data_made_grown_and_dropped(env, rng):
    x = rng.standard_normal((40, 3))
    d = synk.data(x)
    assert_ops(env, env.f_ops(d), x)
    for _ in range(3):                         # mappings made and dropped on every rank
        gone_soon = synk.data(rng.standard_normal((N_ROWS, 3)))
        env.f_ops(gone_soon)
        del gone_soon
    bigger = rng.standard_normal((3 * N_ROWS, 3))
    d.set_length(len(bigger))                 # a new segment, mapped again by every rank
    d.data[:] = bigger
    assert_ops(env, env.f_ops(d), bigger)
    d.set_length(N_ROWS)                      # shrinks in place
    assert_ops(env, env.f_ops(d), bigger[:N_ROWS])
    assert_ops(env, env.f_ops(env.early), env.early_x)


def test_checkpoint_restores_every_ranks_values(env, tmp_path):
    sh, n = env.sh, env.n
    per_rank = _set_all(env, salt=3)
    w = np.array([1.0, 2.0, 3.0])
    for r in range(n):
        synk.set_value(r, env.w, w)
    path = tmp_path / "c.npz"
    checkpoint.save(path, metadata={"n": n})
    for r in range(n):
        synk.set_value(r, [sh["v"], sh["i"], env.w],
                       [np.zeros(5, "float32"), np.zeros(4, "int32"), np.zeros(3)])
    assert checkpoint.load(path) == {"n": n}
    for k in ("v", "i", "big"):
        _check_ranks(env, k, [p[k] for p in per_rank])
    for r, wr in enumerate(synk.gather(env.w)):
        np.testing.assert_array_equal(wr, w, err_msg=f"rank {r}")


def test_an_error_in_one_rank_reaches_the_master_and_the_run_goes_on(env, rng):
    x = rng.standard_normal((N_ROWS, 3))
    d = synk.data(x)
    for _ in range(2):
        with pytest.raises(synk.WorkerError, match=f"planted failure in rank {env.n - 3}") as info:
            env.f_fail(d)
        assert info.value.rank == env.n - 3 and set(info.value.failures) == {env.n - 3}
        assert f"rank {env.n - 3} of {env.n}" in info.value.failures[env.n - 3]
        assert_ops(env, env.f_ops(d), x)
