"""The latency paths against NumPy: small all_reduce on a cached plan, repeated call
messages, and float scalars passed outside the slabs.

Each path keeps state from one call to the next (a plan, a pickled message, a
control slot), so these tests change what the cache was built on between calls
and check every result against NumPy.
"""

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.raise_op import Assert
import pytest

import synkhronos as synk
from synkhronos.comm.base import SPLIT_BYTES

pytestmark = pytest.mark.timeout(120)


def _shares(x, n):
    return np.array_split(x, n)  # as the library splits rows: the first ranks take one more


@pytest.mark.parametrize("n", [2, 3])
def test_small_all_reduce_follows_values_and_updates(forked, n):
    forked(n)
    v = pytensor.shared(np.zeros(5, "float32"), name="v")
    z = pytensor.shared(np.array(0.0), name="z")
    i = pytensor.shared(np.zeros(3, "int32"), name="i")
    double = synk.function([], [], updates=[(v, v * 2), (z, z + 1), (i, i * 3)])
    synk.distribute()
    for salt in range(3):
        per = [{"v": (np.arange(5) + r + salt).astype("float32"),
                "z": np.array(0.5 * r + salt), "i": np.arange(3, dtype="int32") + r - salt}
               for r in range(n)]
        for r in range(n):
            synk.set_value(r, [v, z, i], [per[r]["v"], per[r]["z"], per[r]["i"]])
        for _ in range(2):
            # The update replaces each rank's arrays: the plan checks the new ones.
            double()
            for p in per:
                p["v"], p["z"], p["i"] = p["v"] * 2, p["z"] + 1, p["i"] * 3
            synk.all_reduce([v, z], op="avg")
            synk.all_reduce(i, op="sum")
            synk.all_reduce(v, op="max")
            want_v = np.max([np.mean([p["v"] for p in per], axis=0)] * n, axis=0)
            want_z = np.mean([p["z"] for p in per])
            want_i = np.sum([p["i"] for p in per], axis=0)
            for p in per:
                p["v"], p["z"], p["i"] = want_v.astype("float32"), want_z, want_i
            got_v = synk.gather(v, nd_up=1)
            np.testing.assert_allclose(got_v, np.stack([want_v] * n), rtol=1e-6)
            assert all(np.array_equal(got_v[0], g) for g in got_v[1:])  # the same bits
            np.testing.assert_allclose(synk.gather(z, nd_up=1), [want_z] * n, rtol=1e-12)
            np.testing.assert_array_equal(synk.gather(i, nd_up=1), np.stack([want_i] * n))


def test_small_all_reduce_meets_the_general_path_and_recovers(forked):
    # Rank 1's value is over the split threshold: it takes the general path while
    # rank 0 takes the fast one.  Both must raise the same error and stay usable.
    forked(2)
    v = pytensor.shared(np.zeros(4, "float32"), name="v")
    synk.function([], pt.sum(v))
    synk.distribute()
    synk.set_value(0, v, np.ones(4, "float32"))
    synk.all_reduce(v, op="sum")  # builds the plan
    big = np.ones(SPLIT_BYTES // 4 + 10, "float32")
    synk.set_value(1, v, big)
    with pytest.raises(ValueError, match="differ"):
        synk.all_reduce(v, op="sum")
    synk.set_value(1, v, np.full(4, 3.0, "float32"))
    synk.set_value(0, v, np.full(4, 2.0, "float32"))
    synk.all_reduce(v, op="sum")
    np.testing.assert_array_equal(synk.gather(v, nd_up=1), np.full((2, 4), 5.0))
    # A different small shape on one rank only: the fast path on both, same error.
    synk.set_value(1, v, np.ones(3, "float32"))
    with pytest.raises(ValueError, match="differ"):
        synk.all_reduce(v, op="avg")
    synk.set_value(1, v, np.ones(4, "float32"))
    synk.all_reduce(v, op="avg")
    np.testing.assert_array_equal(synk.gather(v, nd_up=1), np.full((2, 4), 3.0))


def test_repeated_calls_see_every_change_to_their_data(forked):
    forked(2)
    x = pt.dmatrix("x")
    f = synk.function([x], [(pt.sum(x, axis=0), "sum"), (pt.max(x), "max")])
    synk.distribute()
    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 3))
    d = synk.data(a)

    def check(value, got):
        np.testing.assert_allclose(got[0], value.sum(axis=0), rtol=1e-12)
        assert float(got[1]) == value.max()

    check(a, f(d))
    check(a, f(d))  # the same message, sent again
    b = rng.normal(size=(6, 3))
    d.set_value(b)  # same shape, new contents
    check(b, f(d))
    c = rng.normal(size=(9, 3))
    d.set_value(c)  # new shape: a new message
    check(c, f(d))
    # Options after a plain call must not reuse the plain call's message.
    got = f(d, num_slices=2)
    check(c, got)
    assert f(d, output_subset=[1])[0] == c.max()
    check(c[:4], f(d, batch=4))
    check(c, f(d))
    e = synk.data(a)
    check(a, f(e))
    del d, e  # freed: a new Data may reuse the memory address of the old object
    for k in range(3):
        g = synk.data(a + k)
        check(a + k, f(g))
    # NumPy inputs are copied at every call, also when the same array changed in place.
    arr = a.copy()
    check(arr, f(arr))
    arr += 1.0
    check(arr, f(arr))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_scalar_outputs_against_numpy(forked, dtype):
    # 10 rows on 3 ranks: 4, 3, 3.  "avg" weighs each rank's mean by its rows.
    forked(3)
    x = pt.vector("x", dtype=dtype)
    total = synk.function([x], (pt.sum(x, dtype=dtype), "sum"), name="total")
    if dtype == "int32":
        mean = synk.function([x], (pt.max(x), "max"), name="mean")
    else:
        mean = synk.function([x], pt.mean(x).astype(dtype), name="mean")  # "avg", by rows
    synk.distribute()
    values = (np.arange(10) % 7 + 1).astype(dtype)
    d = synk.data(values)
    for _ in range(2):
        got = total(d)
        assert got.dtype == np.dtype(dtype) and got.shape == ()
        want = sum(float(p.sum(dtype=dtype)) for p in _shares(values, 3))
        assert float(got) == float(np.array(want, dtype=dtype))
        got = mean(d)
        assert got.dtype == np.dtype(dtype)
        if dtype == "int32":
            assert int(got) == values.max()
        else:
            parts = _shares(values, 3)
            means = [float(p.mean(dtype=dtype).astype(dtype)) for p in parts]
            want = sum(m * len(p) for m, p in zip(means, parts)) / len(values)
            np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_small_all_reduce_follows_a_slab_that_grew(forked):
    # A call whose output outgrows the workers' slabs replaces them (a new
    # generation) but not the master's: a kept all-reduce must map the new ones,
    # whether the master's old mapping of them closed (round 0) or stays open
    # under views of it (later rounds, after a gather read them).
    forked(3)
    v = pytensor.shared(np.zeros(4, "float32"), name="v")
    size = pytensor.shared(np.int64(300_000), name="size")
    big = synk.function([], (pt.ones(size) * pt.sum(v), "sum"))
    synk.distribute()
    per = [np.arange(4, dtype="float32") + r for r in range(3)]
    for round_ in range(3):
        for r in range(3):
            synk.set_value(r, [v, size], [per[r] * (round_ + 1), np.int64(300_000 * 2 ** round_)])
        synk.all_reduce(v, op="sum")
        want = (np.sum(per, axis=0) * (round_ + 1)).astype("float32")
        out = big()  # every worker's slab outgrown each round (2.4, 4.8, 9.6 MB)
        np.testing.assert_allclose(out, np.full(300_000 * 2 ** round_, 3 * want.sum()))
        synk.all_reduce(v, op="sum")  # right after: the master maps the new slabs
        np.testing.assert_array_equal(synk.gather(v, nd_up=1), np.stack([want * 3] * 3))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_small_array_outputs_equal_the_general_path_and_numpy(forked, dtype):
    # 10 rows on 3 ranks: 4, 3, 3.  A kept call's small outputs are combined in C;
    # output_subset sends the same call down the general path (NumPy in Python):
    # both must give the same bits, and NumPy's answer on the whole.
    forked(3)
    x = pt.matrix("x", dtype=dtype)
    ops = ["sum", "max", "min", "prod"] + (["avg"] if dtype.startswith("float") else [])
    exprs = {"sum": pt.sum(x, axis=0, dtype=dtype), "max": pt.max(x, axis=0),
             "min": pt.min(x, axis=0), "prod": pt.prod(x, axis=0, dtype=dtype),
             "avg": pt.mean(x, axis=0).astype(dtype)}
    fs = {op: synk.function([x], (exprs[op], op)) for op in ops}
    synk.distribute()
    rng = np.random.default_rng(1)
    values = (rng.integers(-3, 4, size=(10, 5)) + (rng.random((10, 5)) if dtype.startswith("float")
                                                   else 0)).astype(dtype)
    d = synk.data(values)
    whole = {"sum": values.sum(0, dtype=dtype), "max": values.max(0), "min": values.min(0),
             "prod": values.prod(0, dtype=dtype), "avg": values.mean(0)}
    for op in ops:
        for _ in range(3):  # the first call plans; the repeats are kept
            kept = fs[op](d)
            general = fs[op](d, output_subset=[0])
            assert kept.dtype == np.dtype(dtype) and kept.shape == (5,)
            np.testing.assert_array_equal(kept, general)
            np.testing.assert_allclose(kept, whole[op], rtol=1e-5 if dtype == "float32" else 1e-12)


def test_small_array_outputs_fall_back_where_ranks_differ(forked):
    forked(3)
    x = pt.dmatrix("x")
    per_row = synk.function([x], (x.sum(axis=1), "sum"))    # one value per row of the rank
    cols = synk.function([x], (x.sum(axis=0), "sum"))
    synk.distribute()
    d = synk.data(np.ones((10, 2)))
    with pytest.raises(ValueError, match="different shapes across ranks"):
        per_row(d)                                           # 4, 3, 3 rows: shapes differ
    np.testing.assert_array_equal(cols(d), [10.0, 10.0])
    np.testing.assert_array_equal(cols(d), [10.0, 10.0])     # kept
    two = synk.data(np.ones((2, 2)))                         # rank 2 gets no rows
    np.testing.assert_array_equal(cols(two), [2.0, 2.0])
    np.testing.assert_array_equal(cols(two), [2.0, 2.0])
    np.testing.assert_array_equal(cols(d), [10.0, 10.0])


@pytest.mark.parametrize("spin", [None, "0"])
def test_repeats_that_fail_or_find_a_rank_still_running_go_the_long_way(forked, monkeypatch, spin):
    """A repeated call's fast path (runtime/run.py, repeat): a rank that fails on new contents
    of the same Data, the master's share failing, and (without spinning, SYNK_SPIN_S=0) a
    worker not yet done at the first look all finish in run_command: reported, and the run
    goes on with the right sums."""
    if spin is not None:
        monkeypatch.setenv("SYNK_SPIN_S", spin)
    forked(2)
    x = pt.dvector("x")
    checked = Assert("a value of 100 or more")(x, pt.all(pt.lt(x, 100.0)))
    f = synk.function([x], (checked.sum(), "sum"))
    synk.distribute()
    a = np.arange(8.0)
    d = synk.data(a)
    for _ in range(3):
        assert f(d) == a.sum()
    for row, rank in ((6, 1), (1, 0)):   # rank 1's rows, then the master's
        d[row] = 1000.0
        for _ in range(2):
            with pytest.raises(synk.WorkerError, match=f"failed in rank {rank}") as info:
                f(d)
            assert "a value of 100 or more" in str(info.value)
        d[row] = a[row]
        for _ in range(3):
            assert f(d) == a.sum()
    d[:] = a + 1.0
    assert f(d) == (a + 1.0).sum()


def test_a_repeated_call_waits_for_another_threads_call(forked):
    """Threads calling the same function at once take turns (the repeat holds the call lock)."""
    import threading

    forked(2)
    x = pt.dvector("x")
    f = synk.function([x], (pt.sum(x ** 2), "sum"))
    synk.distribute()
    a = np.arange(64.0)
    d = synk.data(a)
    want = float((a ** 2).sum())
    got, errors = [], []

    def calls():
        try:
            for _ in range(300):
                got.append(float(f(d)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=calls) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(got) == 900 and set(got) == {want}
