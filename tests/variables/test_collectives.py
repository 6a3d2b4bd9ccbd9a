"""Collectives on shared variables against NumPy, on 1, 2 and 3 ranks and on every backend.

Every rank gets its own values through set_value(); each collective's effect
is read back with get_value() / gather() and compared with NumPy on the same
per-rank values.
"""

import os

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(90)

# SYNK_TEST_MODE=JAX (see conftest.py, test_jax_mode.py) reruns this suite on JAX arrays.
MODE = os.environ.get("SYNK_TEST_MODE") or "FAST_COMPILE"

OPS = ["avg", "sum", "prod", "max", "min"]
BIG = 70_001  # float32 elements: over the split threshold, odd on purpose
COLLECTIVES = ["broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
               "set_value", "get_value", "get_lengths", "get_shapes"]


@pytest.fixture(params=["shm", "zmq"])
def backend(request, monkeypatch):
    monkeypatch.setenv("SYNK_BACKEND", request.param)
    return request.param


def _build(extra=()):
    """Shared variables of several dtypes and ndims, all used by one function."""
    shareds = {
        "v": pytensor.shared(np.zeros(5, "float32"), name="v"),
        "m": pytensor.shared(np.zeros((3, 4), "float32"), name="m"),
        "i": pytensor.shared(np.zeros(4, "int32"), name="i"),
        "z": pytensor.shared(np.array(0.0), name="z"),
        "big": pytensor.shared(np.zeros(BIG, "float32"), name="big"),
    }
    unused = pytensor.shared(np.zeros(2, "float32"), name="unused")
    total = sum(pt.sum(s) for s in list(shareds.values()) + list(extra))
    synk.function([], [total], mode=MODE)
    synk.distribute()
    return shareds, unused


def _values(rank, salt=0):
    """Small integers (exact in every dtype and op), different on every rank."""
    def arr(shape, dtype, k):
        n = int(np.prod(shape))
        return ((np.arange(n) * 3 + k + salt) % 4 + rank + 1).astype(dtype).reshape(shape)
    return {"v": arr((5,), "float32", 1), "m": arr((3, 4), "float32", 2),
            "i": arr((4,), "int32", 3), "z": arr((), "float64", 4),
            "big": arr((BIG,), "float32", 5)}


def _set_all(sh, n, salt=0):
    names = list(sh)
    per_rank = [_values(r, salt) for r in range(n)]
    for r in range(n):
        synk.set_value(r, [sh[k] for k in names], [per_rank[r][k] for k in names])
    return per_rank


def _reduced(op, parts):
    stack = np.stack(parts)
    if op == "avg":
        return stack.mean(axis=0)
    return {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](stack, axis=0)


def _check_ranks(var, expected_per_rank):
    for r, want in enumerate(expected_per_rank):
        got = synk.get_value(r, var)
        assert got.shape == np.shape(want), (var, r)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{var} in rank {r}")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_get_set_gather_and_shapes(backend, forked, n):
    forked(n)
    sh, _ = _build()
    per_rank = _set_all(sh, n)
    names = list(sh)
    for r in range(n):
        got = synk.get_value(r, [sh[k] for k in names])
        assert isinstance(got, tuple) and len(got) == len(names)
        for k, g in zip(names, got):
            np.testing.assert_array_equal(g, per_rank[r][k])
            assert g.dtype == per_rank[r][k].dtype
    for k in names:
        np.testing.assert_array_equal(synk.gather(sh[k]), np.stack([p[k] for p in per_rank]))
        np.testing.assert_array_equal(synk.gather(k, nd_up=1),
                                      np.stack([p[k] for p in per_rank]))
        if k != "z":
            np.testing.assert_array_equal(synk.gather(sh[k], nd_up=0),
                                          np.concatenate([p[k] for p in per_rank]))
    both = synk.gather([sh["v"], "m"], nd_up=1, nccl=False)
    assert isinstance(both, tuple) and both[1].shape == (n, 3, 4)
    assert synk.get_shapes(sh["m"]) == [(3, 4)] * n
    assert synk.get_shapes([sh["z"], sh["v"]]) == ([()] * n, [(5,)] * n)
    assert synk.get_lengths(sh["big"]) == [BIG] * n
    assert synk.get_lengths(("v", sh["m"])) == ([5] * n, [3] * n)
    # Values set in one rank only.
    synk.set_value(n - 1, sh["v"], np.arange(9, dtype="float32"), batch=slice(2, 8))
    synk.set_value(0, "m", synk.data(np.full((4, 4), 7, "float32")), batch=[3, 1])
    _check_ranks(sh["v"], [p["v"] for p in per_rank[:-1]] + [np.arange(2, 8, dtype="float32")])
    assert synk.get_value(0, sh["m"]).shape == (2, 4)
    assert synk.get_lengths(sh["v"]) == [5] * (n - 1) + [6]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_reduce_and_all_reduce_every_op(backend, forked, n):
    forked(n)
    sh, _ = _build()
    floats = ["v", "m", "z", "big"]
    for op in OPS:
        per_rank = _set_all(sh, n)
        names = floats + ([] if op == "avg" else ["i"])
        want = {k: _reduced(op, [p[k] for p in per_rank]) for k in sh}
        got = synk.reduce([sh[k] for k in names], op=op, in_place=False)
        for k, g in zip(names, got):
            np.testing.assert_allclose(g, want[k], rtol=1e-6, err_msg=f"{op} {k}")
        np.testing.assert_allclose(synk.reduce(sh["i"], op=op, in_place=False), want["i"])
        # in_place=False changes nothing anywhere.
        _check_ranks(sh["v"], [p["v"] for p in per_rank])
        assert synk.reduce([sh[k] for k in names], op=op) is None
        for k in names:
            _check_ranks(sh[k], [want[k]] + [p[k] for p in per_rank[1:]])
        per_rank = _set_all(sh, n, salt=1)
        want = {k: _reduced(op, [p[k] for p in per_rank]) for k in sh}
        assert synk.all_reduce([sh[k] for k in names], op=op) is None
        for k in names:
            _check_ranks(sh[k], [want[k]] * n)
        synk.all_reduce(sh["v"], op, nccl=False)  # nccl means nothing on CPU
        _check_ranks(sh["v"], [_reduced(op, [want["v"]] * n)] * n)
        np.testing.assert_allclose(synk.reduce(sh["m"], op, in_place=False, nccl=False),
                                   _reduced(op, [want["m"]] * n), rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_broadcast_scatter_all_gather(backend, forked, n):
    forked(n)
    sh, _ = _build()
    per_rank = _set_all(sh, n)
    synk.broadcast([sh["v"], sh["big"], sh["z"]], nccl=False)
    for k in ("v", "big", "z"):
        _check_ranks(sh[k], [per_rank[0][k]] * n)
    _check_ranks(sh["m"], [p["m"] for p in per_rank])
    new_v = np.arange(6, dtype="float32")
    new_m = synk.data(np.ones((2, 4), "float32") * 5)
    synk.broadcast((sh["v"], "m"), [new_v, new_m])
    _check_ranks(sh["v"], [new_v] * n)
    _check_ranks(sh["m"], [new_m.data] * n)
    new_v[:] = -1  # the variables hold copies, not the user's array
    _check_ranks(sh["v"], [np.arange(6, dtype="float32")] * n)
    synk.broadcast(sh["i"], [1, 2, 3])
    _check_ranks(sh["i"], [np.array([1, 2, 3], "int32")] * n)

    data = np.arange(7 * 4, dtype="float32").reshape(7, 4)
    for batch in (None, slice(1, 6), 5, [6, 0, 3, 3, 1], np.array([2, 4])):
        rows = data if batch is None else data[:batch] if isinstance(batch, int) else data[batch]
        splits = np.array_split(rows, n)
        for value in (data, synk.data(data)):
            synk.scatter(sh["m"], value, batch=batch)
            _check_ranks(sh["m"], splits)
    big = np.arange(BIG * 2, dtype="float32")
    synk.scatter([sh["big"], sh["v"]], [big, big[:4]])
    _check_ranks(sh["big"], np.array_split(big, n))
    _check_ranks(sh["v"], np.array_split(big[:4], n))

    # Lengths that differ across ranks: gathered exactly, never cropped or padded.
    parts = [np.full((r + 2, 4), r, "float32") for r in range(n)]
    for r in range(n):
        synk.set_value(r, sh["m"], parts[r])
    assert synk.get_lengths(sh["m"]) == [r + 2 for r in range(n)]
    np.testing.assert_array_equal(synk.gather(sh["m"], nd_up=0), np.concatenate(parts))
    if n > 1:
        with pytest.raises(ValueError, match="nd_up=0"):
            synk.gather(sh["m"], nd_up=1)
        with pytest.raises(ValueError, match="differ across ranks"):
            synk.all_reduce(sh["m"], "sum")
        _check_ranks(sh["m"], parts)  # a failed reduction changes nothing
    synk.all_gather([sh["m"], "v"], nccl=False)
    _check_ranks(sh["m"], [np.concatenate(parts)] * n)
    _check_ranks(sh["v"], [np.concatenate(np.array_split(big[:4], n))] * n)


@pytest.mark.parametrize("n", [2, 3])
def test_many_variables_take_one_pass(backend, forked, n):
    forked(n)
    params = [pytensor.shared(np.zeros(size, "float32"), name=f"p{j}")
              for j, size in enumerate([3, 1000, 7, 30_000, 1, 50_000] * 5)]
    synk.function([], [sum(pt.sum(p) for p in params)], mode=MODE)
    synk.distribute()
    per_rank = [[np.full(p.get_value().shape, r + j, "float32") for j, p in enumerate(params)]
                for r in range(n)]
    for r in range(n):
        synk.set_value(r, params, per_rank[r])
    rt = get_runtime()
    seq = rt.control.seq
    synk.all_reduce(params, op="sum")
    assert rt.control.seq == seq + 1  # one command...
    assert rt.backend.k <= 3  # ...with a few barriers / steps, not one per variable
    got = synk.gather(params)
    for j in range(len(params)):
        want = sum(per_rank[r][j] for r in range(n))
        np.testing.assert_array_equal(got[j], np.stack([want] * n))


def test_reference_shared_variable_example(backend, forked):
    """The API reference's "Theano Shared Variable Example", with its printed values."""
    forked(2)
    s_init = np.ones(2, dtype="float32")
    x = pt.matrix("x")
    s = pytensor.shared(s_init, name="s")
    f = synk.function([x], updates=[(s, pt.sum(x * s, axis=0))], mode=MODE)
    synk.distribute()
    x_dat = synk.data(np.array([[1, 1], [2, 2], [3, 3], [4, 4]]).astype("float32"))
    np.testing.assert_array_equal(s.get_value(), [1, 1])
    f.as_theano(x_dat.data)
    np.testing.assert_array_equal(s.get_value(), [10, 10])

    s.set_value(s_init)
    f(x_dat)
    np.testing.assert_array_equal(s.get_value(), [3, 3])
    np.testing.assert_array_equal(synk.gather(s, nd_up=1), [[3, 3], [7, 7]])
    synk.reduce(s, op="sum")
    np.testing.assert_array_equal(s.get_value(), [10, 10])
    np.testing.assert_array_equal(synk.gather(s, nd_up=1), [[10, 10], [7, 7]])

    synk.broadcast(s, s_init)
    f(x_dat)
    synk.all_reduce(s, op="sum")
    np.testing.assert_array_equal(synk.gather(s, nd_up=1), [[10, 10], [10, 10]])
    np.testing.assert_array_equal(s_init, [1, 1])  # the user's array is never written


# ---- misuse --------------------------------------------------------------------
def _calls(s):
    """One call of every collective, valid once distributed."""
    return {
        "broadcast": lambda: synk.broadcast(s),
        "scatter": lambda: synk.scatter(s, np.zeros(4, "float32")),
        "gather": lambda: synk.gather(s),
        "all_gather": lambda: synk.all_gather(s),
        "reduce": lambda: synk.reduce(s),
        "all_reduce": lambda: synk.all_reduce(s),
        "set_value": lambda: synk.set_value(0, s, np.zeros(2, "float32")),
        "get_value": lambda: synk.get_value(0, s),
        "get_lengths": lambda: synk.get_lengths(s),
        "get_shapes": lambda: synk.get_shapes(s),
    }


def test_collectives_need_fork_and_distribute(forked):
    s = pytensor.shared(np.zeros(2, "float32"), name="s")
    assert sorted(_calls(s)) == sorted(COLLECTIVES) and set(COLLECTIVES) <= set(synk.__all__)
    for name, call in _calls(s).items():
        with pytest.raises(synk.SynkStateError, match="fork"):
            call()
    forked(2)
    for name, call in _calls(s).items():
        with pytest.raises(RuntimeError, match=rf"{name}\(\) needs distribute"):
            call()
    synk.function([], [pt.sum(s)], mode=MODE)
    synk.distribute()
    for call in _calls(s).values():
        call()
    synk.close()
    for call in _calls(s).values():
        with pytest.raises(synk.SynkStateError):
            call()


def test_misuse_raises_in_the_master_before_any_worker_moves(forked):
    forked(2)
    fixed = pytensor.shared(np.zeros(3, "float32"), shape=(3,), name="fixed")
    sh, unused = _build([fixed])
    v, m, i, z = sh["v"], sh["m"], sh["i"], sh["z"]
    f64_data = synk.data(np.zeros(5))
    cases = [
        (lambda: synk.all_reduce(unused), ValueError, "not used by any function"),
        (lambda: synk.gather("nope"), ValueError, "no shared variable named 'nope'"),
        (lambda: synk.broadcast(np.zeros(2)), TypeError, "shared_vars"),
        (lambda: synk.all_reduce([v, v]), ValueError, "twice"),
        (lambda: synk.all_reduce([]), ValueError, "empty"),
        (lambda: synk.reduce(v, op="mean"), ValueError, "op must be one of"),
        (lambda: synk.all_reduce(v, op=None), ValueError, "op must be one of"),
        (lambda: synk.all_reduce(i, op="avg"), TypeError, "use 'sum'"),
        (lambda: synk.reduce(i), TypeError, "use 'sum'"),
        (lambda: synk.broadcast(v, np.zeros(5)), TypeError, "float32"),
        (lambda: synk.broadcast(v, np.zeros((5, 1), "float32")), TypeError, "ndim 1"),
        (lambda: synk.broadcast([v, m], [np.zeros(5, "float32")]), ValueError, "one value"),
        (lambda: synk.broadcast(v, f64_data), TypeError, "float32"),
        (lambda: synk.broadcast(v, "text"), TypeError, "convert"),
        (lambda: synk.scatter(z, np.array(1.0)), ValueError, "0-d"),
        (lambda: synk.scatter(v, np.zeros(4, "float32"), batch=[1, 4]), ValueError, "row 4"),
        (lambda: synk.scatter(v, np.zeros(4, "float32"), batch=slice(0, 9)), ValueError,
         "row 8"),
        (lambda: synk.scatter(v, np.zeros(4, "float32"), batch=[0.5]), TypeError, "batch"),
        (lambda: synk.set_value(2, v, np.zeros(5, "float32")), ValueError, "range"),
        (lambda: synk.set_value(-1, v, np.zeros(5, "float32")), ValueError, "range"),
        (lambda: synk.set_value("1", v, np.zeros(5, "float32")), TypeError, "rank"),
        (lambda: synk.set_value(True, v, np.zeros(5, "float32")), TypeError, "rank"),
        (lambda: synk.set_value(1, v, np.zeros(5, "float32"), batch=9), ValueError, "row 8"),
        (lambda: synk.set_value(1, v, np.zeros(5, "int64")), TypeError, "float32"),
        (lambda: synk.get_value(5, v), ValueError, "range"),
        (lambda: synk.gather(v, nd_up=2), ValueError, "nd_up"),
        (lambda: synk.gather(z, nd_up=0), ValueError, "0-d"),
        (lambda: synk.all_gather(z), ValueError, "0-d"),
        (lambda: synk.get_lengths(z), ValueError, "0-d"),
        (lambda: synk.all_gather(fixed), ValueError, "fixed length"),
        (lambda: synk.broadcast(fixed, np.zeros(4, "float32")), ValueError, "fixed length"),
        (lambda: synk.scatter(fixed, np.zeros(5, "float32")), ValueError, "fixed length"),
        # flags are bools: the string "no" is no False
        (lambda: synk.reduce(v, in_place="no"), TypeError, "reduce: in_place"),
        (lambda: synk.reduce(v, in_place=0), TypeError, "in_place"),
        (lambda: synk.reduce(v, nccl="no"), TypeError, "reduce: nccl"),
        (lambda: synk.all_reduce(v, nccl="no"), TypeError, "all_reduce: nccl"),
        (lambda: synk.broadcast(v, nccl="no"), TypeError, "broadcast: nccl"),
        (lambda: synk.gather(v, nccl="no"), TypeError, "gather: nccl"),
        (lambda: synk.all_gather(v, nccl=None), TypeError, "all_gather: nccl"),
        (lambda: synk.gather(v, nd_up=1.0), ValueError, "nd_up"),
        (lambda: synk.get_value(1.0, v), TypeError, "rank"),
    ]
    rt = get_runtime()
    for call, exc, match in cases:
        seq = rt.control.seq
        with pytest.raises(exc, match=match):
            call()
        assert rt.control.seq == seq, match  # no command was posted
    synk.scatter(fixed, np.arange(6, dtype="float32"))
    _check_ranks(fixed, [np.arange(3), np.arange(3, 6)])
    for r in range(2):
        synk.set_value(r, v, np.full(5, r + 1, "float32"))
    synk.all_reduce(v, op="sum")
    _check_ranks(v, [np.full(5, 3, "float32")] * 2)


# ---- no collective inside a call --------------------------------------------------

_FROM_AN_OP = {
    "all_reduce": lambda: synk.all_reduce("s"),
    "broadcast": lambda: synk.broadcast("s"),
    "gather": lambda: synk.gather("s"),
    "get_value": lambda: synk.get_value(0, "s"),
    "call": lambda: get_runtime().registry.functions[0](),     # a synkhronos function, without inputs
}


class CollectiveInOp(Op):
    """Return x; first run ``what`` from inside the graph, as a user Op might."""

    __props__ = ("what",)

    def __init__(self, what):
        self.what = what

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        _FROM_AN_OP[self.what]()
        outputs[0][0] = inputs[0].copy()


@pytest.mark.parametrize("what", list(_FROM_AN_OP))
def test_a_collective_inside_a_call_raises_in_every_rank_at_once(forked, what):
    """It would wait for ranks busy in the very call: SynkStateError instead of a hang."""
    forked(2)
    s = pytensor.shared(np.ones(3, "float32"), name="s")
    synk.function([], [pt.sum(s)], mode=MODE)            # function 0, what "call" runs
    x = pt.dvector("x")
    f = synk.function([x], (CollectiveInOp(what)(x).sum(), "sum"), mode="FAST_COMPILE")
    plain = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    with pytest.raises(synk.SynkStateError, match="inside a call") as info:
        f(np.ones(4))
    assert set(info.value.failures) == {0, 1}            # the master and the worker alike
    assert plain(np.ones(4)) == 4.0                      # the run goes on
    synk.all_reduce(s, op="sum")
    np.testing.assert_array_equal(synk.get_value(1, s), np.full(3, 2.0))
