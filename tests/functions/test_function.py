"""Function calls: f(x) on n ranks equals serial PyTensor on the whole x, reduced alike.

One runtime per rank count (1, 2 and 3 ranks; 3 ranks on 2 cores splits unevenly)
serves the whole module: every function is built before distribute(), which runs
once per fork.  Expectations come from serial ``pytensor.function`` calls on the
same data and from NumPy, never from synkhronos itself.
"""

import types

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(120)

N_ROWS = 11          # 6+5 rows on 2 ranks, 4+4+3 on 3


def shares(a, n):
    """Each rank's rows: the first len % n ranks get one more (numpy.array_split)."""
    return np.array_split(a, n)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}ranks")
def env(request, runtime_keeper):
    """Fork n ranks, build every function of this module, distribute once."""
    n = request.param
    runtime_keeper.fork(n)
    try:
        e = _build_env(n)
    except BaseException:
        runtime_keeper.close()
        raise
    yield e
    runtime_keeper.close()


def _build_env(n):
    e = types.SimpleNamespace(n=n)
    x = pt.dmatrix("x")
    m = pt.dmatrix("m")
    e.x = x

    # Every output op on one input; the serial function computes the same graphs.
    ops_outputs = [
        (x.mean(axis=0), "avg"),
        (x.sum(axis=0), "sum"),
        ((1 + 0.1 * x).prod(axis=0), "prod"),
        (x.max(axis=0), "max"),
        (x.min(axis=0), "min"),
        (x.sum(axis=0), None),
        (2 * x + 1, "gather"),
        x.mean(),                                   # a bare variable: "avg"
    ]
    e.ops = ["avg", "sum", "prod", "max", "min", None, "gather", "avg"]
    e.f_ops = synk.function([x], outputs=ops_outputs, name="ops")
    # Slices of an op-None output cannot be combined: the slicing twin leaves it out.
    e.f_ops_sliced = synk.function([x], outputs=[o for o, op in zip(ops_outputs, e.ops)
                                                 if op is not None], name="ops_sliced")
    e.serial_ops = pytensor.function(
        [x], [o if not isinstance(o, tuple) else o[0] for o in ops_outputs])

    e.f_single = synk.function([x], x.mean(axis=0))
    e.f_pair = synk.function([x], (x.sum(), "sum"))
    e.f_list1 = synk.function([x], [(x.max(), "max")])

    # The reference's introductory example: a broadcast input.
    xf, yf = pt.fmatrix("xf"), pt.fvector("yf")
    z = pt.mean(xf.dot(yf), axis=0)
    e.f_intro = synk.function(inputs=[xf], bcast_inputs=[yf], outputs=z, name="intro")
    e.serial_intro = pytensor.function([xf, yf], z)
    e.f_rows_avg = synk.function([x], (x * 1, "avg"))
    a = pt.dscalar("a")
    e.f_scale = synk.function([x], bcast_inputs=[a], outputs=[(a * x.sum(axis=0), "sum"),
                                                             (a * x, "gather")])

    # Updates of a shared variable that several functions share.
    s = pytensor.shared(np.zeros(3), name="s")
    v3 = pt.dvector("v3")
    e.s = s
    e.f_set = synk.function([], bcast_inputs=[v3], updates=[(s, v3)])
    e.f_get = synk.function([], outputs=(s, None))
    e.f_upd = synk.function([x], updates=[(s, s + x.sum(axis=0))])
    e.f_upd_sum = synk.function([x], outputs=(x.sum(axis=0), "sum"),
                                updates=[(s, s + x.sum(axis=0), "sum")])
    e.f_upd_avg = synk.function([x], updates=[(s, s - 0.5 * x.mean(axis=0))])
    e.f_upd_max = synk.function([x], updates=[(s, pt.maximum(s, x.max(axis=0)), "max")])

    # A full input and a minibatch input.
    mb_outputs = [((x * m).sum(axis=0), "sum"), (x * m, "gather")]
    e.f_mb = synk.function([x, m], outputs=mb_outputs)
    e.serial_mb = pytensor.function([x, m], [o for o, _ in mb_outputs])
    # Two inputs of one name: x= cannot say which.
    x2 = pt.dmatrix("x")
    e.f_dup = synk.function([x], bcast_inputs=[x2], outputs=((x.sum() + x2.sum()), "sum"))

    # Data-parallel data held in a shared variable: S gets each rank's rows.
    S = pytensor.shared(np.zeros((1, 3)), name="S")
    xs = pt.dmatrix("xs")
    e.f_scatter_S = synk.function([xs], updates=[(S, xs)])
    e.f_S = synk.function([], outputs=[(S.sum(axis=0), "sum"), (2 * S, "gather"),
                                       (S.max(axis=0), "max"), (S.mean(axis=0), "avg")],
                          sliceable_shareds=[S])
    e.f_xS = synk.function([x], outputs=(x.sum(axis=0) + S.sum(axis=0), "sum"),
                           sliceable_shareds=[S])
    synk.distribute()
    return e


def assert_ops(e, got, xsel):
    """Check f_ops's outputs against the serial function on the selected rows."""
    want = e.serial_ops(xsel)
    assert isinstance(got, list) and len(got) == len(want)
    for op, g, w in zip(e.ops, got, want):
        if op is None:
            # Per-rank results in rank order, each the serial result on that rank's rows.
            assert isinstance(g, list) and len(g) == e.n
            for r, (gr, part) in enumerate(zip(g, shares(xsel, e.n))):
                np.testing.assert_allclose(gr, e.serial_ops(part)[5], rtol=1e-12,
                                           err_msg=f"rank {r}")
        else:
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14, err_msg=f"op {op}")


@pytest.fixture
def xd(env, rng):
    x = rng.standard_normal((N_ROWS, 3))
    return x, synk.data(x)


# ---- the central check -------------------------------------------------------

def test_every_output_op_equals_serial(env, xd):
    x, d = xd
    assert_ops(env, env.f_ops(d), x)


def test_avg_is_exact_for_uneven_splits(env, rng):
    # 7 rows: 4+3 on 2 ranks, 3+2+2 on 3; an equally weighted mean of rank means
    # would differ from the serial mean.
    x = rng.standard_normal((7, 3)) + np.arange(7.0)[:, None]
    got = env.f_ops(synk.data(x))
    np.testing.assert_allclose(got[0], x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(got[7], x.mean(), rtol=1e-12)


def test_single_output_and_list_returns(env, xd):
    x, d = xd
    got = env.f_single(d)
    assert isinstance(got, np.ndarray)
    np.testing.assert_allclose(got, x.mean(axis=0), rtol=1e-12)
    got = env.f_pair(d)
    assert np.ndim(got) == 0
    np.testing.assert_allclose(got, x.sum(), rtol=1e-12)
    got = env.f_list1(d)
    assert isinstance(got, list) and len(got) == 1
    assert got[0] == x.max()


def test_bcast_inputs_the_introductory_example(env, rng):
    x = rng.standard_normal((100, 10)).astype("float32")
    y = rng.standard_normal(10).astype("float32")
    r = env.f_intro(synk.data(x), synk.data(y))
    np.testing.assert_allclose(r, env.serial_intro(x, y), rtol=1e-5)


def test_scalar_bcast_input(env, xd):
    x, d = xd
    for a in (synk.data(np.float64(2.5)), np.float64(2.5), 2.5):
        total, rows = env.f_scale(d, a)
        np.testing.assert_allclose(total, 2.5 * x.sum(axis=0), rtol=1e-12)
        np.testing.assert_allclose(rows, 2.5 * x, rtol=1e-12)


def test_kwargs_by_input_name(env, xd, rng):
    x, d = xd
    assert_ops(env, env.f_ops(x=d), x)
    xf = rng.standard_normal((9, 4)).astype("float32")
    yf = rng.standard_normal(4).astype("float32")
    got = env.f_intro(yf=synk.data(yf), xf=synk.data(xf))
    np.testing.assert_allclose(got, env.serial_intro(xf, yf), rtol=1e-5)
    got = env.f_intro(synk.data(xf), yf=synk.data(yf))
    np.testing.assert_allclose(got, env.serial_intro(xf, yf), rtol=1e-5)


def test_numpy_arrays_as_inputs_are_copied(env, rng):
    x = rng.standard_normal((N_ROWS, 3))
    keep = x.copy()
    assert_ops(env, env.f_ops(x), x)
    np.testing.assert_array_equal(x, keep)
    # Another shape next time (the copy grows), and a lossless cast from int.
    x2 = rng.integers(-5, 5, size=(2 * N_ROWS, 3))
    assert_ops(env, env.f_ops(x2), x2.astype(np.float64))
    xf = rng.standard_normal((6, 2)).astype("float32")
    yf = rng.standard_normal(2).astype("float32")
    np.testing.assert_allclose(env.f_intro(xf, yf), env.serial_intro(xf, yf), rtol=1e-5)


def test_output_subset(env, xd):
    x, d = xd
    want = env.serial_ops(x)
    got = env.f_ops(d, output_subset=[4, 0, 6])
    assert len(got) == 3
    np.testing.assert_allclose(got[0], want[4], rtol=1e-12)
    np.testing.assert_allclose(got[1], want[0], rtol=1e-12)
    np.testing.assert_allclose(got[2], want[6], rtol=1e-12)
    got = env.f_ops(d, output_subset=[5])
    for gr, part in zip(got[0], shares(x, env.n)):
        np.testing.assert_allclose(gr, part.sum(axis=0), rtol=1e-12)


# ---- batch ---------------------------------------------------------------------

@pytest.mark.parametrize("batch", [
    9, N_ROWS, slice(2, 10), slice(3, None), slice(None, 5), [4, 0, 10, 3, 3, 7, 1],
    "perm", "perm_array"], ids=str)
def test_batch_selects_rows_before_scattering(env, rng, xd, batch):
    x, d = xd
    if batch == "perm":
        batch = [int(i) for i in rng.permutation(N_ROWS)[:8]]
    elif batch == "perm_array":
        batch = rng.permutation(N_ROWS)[:9].astype(np.int32)
    sel = x[:batch] if isinstance(batch, int) else x[batch]
    assert_ops(env, env.f_ops(d, batch=batch), sel)


def test_large_index_batch(env, rng):
    # An index list bigger than the control channel's first message buffer, and
    # outputs bigger than the first communication buffers: both grow.
    x = rng.standard_normal((300_000, 3))
    idx = rng.permutation(len(x))[:200_000]
    got = env.f_ops(synk.data(x), batch=idx)
    want = env.serial_ops(x[idx])
    for i in (0, 1, 3, 4, 6, 7):
        np.testing.assert_allclose(got[i], want[i], rtol=1e-9)


def test_batch_with_numpy_input(env, rng):
    x = rng.standard_normal((N_ROWS, 3))
    idx = rng.permutation(N_ROWS)[:7]
    assert_ops(env, env.f_ops(x, batch=idx), x[idx])


def test_minibatch_data_pairs_with_batch_positions(env, rng):
    x = rng.standard_normal((N_ROWS, 3))
    xd = synk.data(x)
    mb = rng.standard_normal((8, 3))
    md = synk.data(mb, minibatch=True)

    # int and slice: shifted so the first selected row pairs with minibatch row 0
    for batch, rows in [(5, x[:5]), (slice(3, 9), x[3:9]), (slice(0, 8), x[:8])]:
        got = env.f_mb(xd, md, batch=batch)
        want = env.serial_mb(rows, mb[:len(rows)])
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12)

    # index list: minibatch row j pairs with batch[j]
    idx = rng.permutation(N_ROWS)[:6]
    got = env.f_mb(xd, md, batch=idx)
    want = env.serial_mb(x[idx], mb[:6])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-12)

    # without batch, a minibatch input is an ordinary scattered input
    got = env.f_mb(synk.data(x[:8]), md)
    np.testing.assert_allclose(got[1], env.serial_mb(x[:8], mb)[1], rtol=1e-12)

    # a minibatch shorter than the selection is an error, and nothing breaks
    with pytest.raises(ValueError, match="minibatch"):
        env.f_mb(xd, md, batch=9)
    with pytest.raises(ValueError, match="minibatch"):
        env.f_mb(xd, md, batch=list(range(9)))
    got = env.f_mb(xd, md, batch=slice(1, 4))
    np.testing.assert_allclose(got[0], env.serial_mb(x[1:4], mb[:3])[0], rtol=1e-12)


# ---- num_slices ----------------------------------------------------------------

@pytest.mark.parametrize("num_slices", [2, 3, 5])
def test_num_slices_accumulates_like_one_call(env, xd, num_slices):
    x, d = xd
    got = env.f_ops_sliced(d, num_slices=num_slices)
    want = [w for w, op in zip(env.serial_ops(x), env.ops) if op is not None]
    ops = [op for op in env.ops if op is not None]
    for g, w, op in zip(got, want, ops):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14, err_msg=f"op {op}")


def test_num_slices_with_batch(env, rng, xd):
    x, d = xd
    idx = rng.permutation(N_ROWS)[:9]
    got = env.f_ops_sliced(d, batch=idx, num_slices=2)
    want = [w for w, op in zip(env.serial_ops(x[idx]), env.ops) if op is not None]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


def test_num_slices_refuses_op_none(env, xd):
    _, d = xd
    with pytest.raises(ValueError, match="op None"):
        env.f_ops(d, num_slices=2)
    np.testing.assert_allclose(env.f_ops(d)[0], env.serial_ops(xd[0])[0], rtol=1e-12)


# ---- updates -------------------------------------------------------------------

def _per_rank_s(e):
    got = e.f_get()
    assert isinstance(got, list) and len(got) == e.n
    return got


def _reset_s(e, s0):
    e.f_set(synk.data(s0))
    for v in _per_rank_s(e):
        np.testing.assert_array_equal(v, s0)


def test_updates_apply_in_every_rank_on_its_rows(env, xd):
    x, d = xd
    s0 = np.array([1.0, -2.0, 0.5])
    _reset_s(env, s0)
    assert env.f_upd(d) == []                       # no outputs
    for r, (v, part) in enumerate(zip(_per_rank_s(env), shares(x, env.n))):
        np.testing.assert_allclose(v, s0 + part.sum(axis=0), rtol=1e-12, err_msg=f"rank {r}")
    # the master's own variable holds the master rank's value
    np.testing.assert_allclose(env.s.get_value(), s0 + shares(x, env.n)[0].sum(axis=0))


def test_update_triples_accumulate_over_slices_from_the_original_values(env, xd):
    x, d = xd
    s0 = np.array([1.0, -2.0, 0.5])
    n = env.n

    # "avg" (the default): a mean-type update sliced equals the unsliced update
    _reset_s(env, s0)
    env.f_upd_avg(d, num_slices=3)
    for v, part in zip(_per_rank_s(env), shares(x, n)):
        np.testing.assert_allclose(v, s0 - 0.5 * part.mean(axis=0), rtol=1e-12)

    # "max": every slice sees s0; the maximum over slices is the unsliced update
    _reset_s(env, s0)
    env.f_upd_max(d, num_slices=2)
    for v, part in zip(_per_rank_s(env), shares(x, n)):
        np.testing.assert_allclose(v, np.maximum(s0, part.max(axis=0)))

    # "sum": slice k gives s0 + sum(slice k); they add up, applied once at the end
    _reset_s(env, s0)
    out = env.f_upd_sum(d, num_slices=3)
    np.testing.assert_allclose(out, x.sum(axis=0), rtol=1e-12)
    for v, part in zip(_per_rank_s(env), shares(x, n)):
        slices = [p for p in np.array_split(part, 3) if len(p)]
        want = sum(s0 + p.sum(axis=0) for p in slices)
        np.testing.assert_allclose(v, want, rtol=1e-12)

    # one slice: the plain update, from the same start
    _reset_s(env, s0)
    env.f_upd_sum(d, num_slices=1)
    for v, part in zip(_per_rank_s(env), shares(x, n)):
        np.testing.assert_allclose(v, s0 + part.sum(axis=0), rtol=1e-12)


def test_as_theano_runs_in_the_master_only(env, xd):
    x, d = xd
    s0 = np.array([1.0, 2.0, 3.0])
    _reset_s(env, s0)
    want = env.serial_ops(x)
    got = env.f_ops.as_theano(d)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12)
    np.testing.assert_allclose(env.f_single.as_theano(x), x.mean(axis=0), rtol=1e-12)
    env.f_upd.as_theano(x=x)
    per_rank = _per_rank_s(env)
    master = get_runtime().place.master_rank
    for r, v in enumerate(per_rank):
        want = s0 + x.sum(axis=0) if r == master else s0
        np.testing.assert_allclose(v, want, rtol=1e-12, err_msg=f"rank {r}")


# ---- batch_s and sliceable shared variables ----------------------------------

def _scatter_S(e, rng):  # noqa: N802 - S is the variable's name
    """Give each rank its rows of a fresh array in S; return the per-rank values."""
    x = rng.standard_normal((N_ROWS, 3))
    e.f_scatter_S(synk.data(x))
    return shares(x, e.n)


def test_sliceable_shareds_whole(env, rng):
    parts = _scatter_S(env, rng)
    total, gathered, mx, avg = env.f_S()
    whole = np.concatenate(parts)
    np.testing.assert_allclose(total, whole.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(gathered, 2 * whole, rtol=1e-12)
    np.testing.assert_allclose(mx, whole.max(axis=0))
    np.testing.assert_allclose(avg, whole.mean(axis=0), rtol=1e-12)


@pytest.mark.parametrize("batch_s", [slice(0, 2), slice(1, 3), [2, 0], np.array([1, 1, 0])],
                         ids=str)
def test_batch_s_one_selection_for_all_ranks(env, rng, batch_s):
    parts = _scatter_S(env, rng)
    sel = np.concatenate([p[batch_s] for p in parts])
    total, gathered, mx, avg = env.f_S(batch_s=batch_s)
    np.testing.assert_allclose(total, sel.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(gathered, 2 * sel, rtol=1e-12)
    np.testing.assert_allclose(mx, sel.max(axis=0))
    np.testing.assert_allclose(avg, sel.mean(axis=0), rtol=1e-12)


@pytest.mark.parametrize("kind", ["slice", "list", "array"])
def test_batch_s_one_selection_per_rank(env, rng, kind):
    parts = _scatter_S(env, rng)
    n = env.n
    if kind == "slice":
        batch_s = [slice(r % 2, 3) for r in range(n)]
    elif kind == "list":
        batch_s = [[2, 0, 0][: r + 1] for r in range(n)]
    else:
        batch_s = [np.array([r % 3, 0]) for r in range(n)]
    sel = np.concatenate([p[b] for p, b in zip(parts, batch_s)])
    total, gathered, mx, avg = env.f_S(batch_s=batch_s)
    np.testing.assert_allclose(total, sel.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(gathered, 2 * sel, rtol=1e-12)
    np.testing.assert_allclose(mx, sel.max(axis=0))
    np.testing.assert_allclose(avg, sel.mean(axis=0), rtol=1e-12)


def test_sliceable_shareds_with_num_slices(env, rng):
    parts = _scatter_S(env, rng)
    whole = np.concatenate(parts)
    total, gathered, mx, avg = env.f_S(num_slices=2)
    np.testing.assert_allclose(total, whole.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(gathered, 2 * whole, rtol=1e-12)
    np.testing.assert_allclose(mx, whole.max(axis=0))
    np.testing.assert_allclose(avg, whole.mean(axis=0), rtol=1e-12)
    sel = np.concatenate([p[0:3] for p in parts])
    total, gathered, _, _ = env.f_S(batch_s=slice(0, 3), num_slices=3)
    np.testing.assert_allclose(total, sel.sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(gathered, 2 * sel, rtol=1e-12)
    # a scattered input and a sliceable shared variable sliced together
    x = rng.standard_normal((N_ROWS, 3))
    got = env.f_xS(synk.data(x), num_slices=2)
    np.testing.assert_allclose(got, x.sum(axis=0) + whole.sum(axis=0), rtol=1e-12)


def test_batch_s_beyond_the_shared_rows_raises_and_recovers(env, rng):
    parts = _scatter_S(env, rng)
    rt = get_runtime()
    seq = rt.control.seq
    # Beyond the master's own rows: the master sees it before posting anything.
    for batch_s in (slice(0, 50), [0, 49], [slice(0, 50)] * env.n):
        with pytest.raises(IndexError, match="batch_s selects row 49") as info:
            env.f_S(batch_s=batch_s)
        assert not isinstance(info.value, synk.WorkerError)
    assert rt.control.seq == seq
    if env.n > 1:
        # Beyond a worker's rows only (the master has 4 or 6, the last rank 3 or 5):
        # that worker finds it, before computing anything.
        last = len(parts[-1])
        with pytest.raises(IndexError, match=f"batch_s selects row {last}") as info:
            env.f_S(batch_s=slice(0, last + 1))
        assert isinstance(info.value, synk.WorkerError)
    total = env.f_S(batch_s=[0])[0]
    np.testing.assert_allclose(total, sum(p[0] for p in parts), rtol=1e-12)


# ---- ranks without rows ----------------------------------------------------------

def test_ranks_with_no_rows(env, rng):
    """Fewer rows than ranks: an empty rank does not run (Function.__call__)."""
    n = env.n
    if n == 1:
        pytest.skip("needs two ranks or more")
    x = rng.standard_normal((n - 1, 3))
    d = synk.data(x)
    got = env.f_ops(d)
    want = env.serial_ops(x)
    for i, op in enumerate(env.ops):
        if op is None:
            assert got[i][-1] is None                  # the last rank got no rows
            for gr, row in zip(got[i][:-1], x):
                np.testing.assert_allclose(gr, row, rtol=1e-12)
        else:
            np.testing.assert_allclose(got[i], want[i], rtol=1e-12, err_msg=f"op {op}")
    # the empty rank applies no update
    s0 = np.array([3.0, 2.0, 1.0])
    _reset_s(env, s0)
    env.f_upd(d)
    per_rank = _per_rank_s(env)
    for r in range(n - 1):
        np.testing.assert_allclose(per_rank[r], s0 + x[r], rtol=1e-12)
    np.testing.assert_array_equal(per_rank[-1], s0)
    # no rows at all: PyTensor's results on the empty input (the master computes them)
    empty = np.zeros((0, 3))
    try:
        want = env.serial_ops(empty)
    except Exception as exc:  # noqa: BLE001 - a backend may refuse max() of nothing: so must we
        with pytest.raises(type(exc)):
            env.f_ops(synk.data(empty))
        return
    got = env.f_ops(synk.data(empty))
    for i, op in enumerate(env.ops):
        if op is None:
            np.testing.assert_array_equal(got[i][0], want[i])
            assert got[i][1:] == [None] * (n - 1)
        else:
            np.testing.assert_array_equal(got[i], want[i], err_msg=f"op {op}")


# ---- properties ------------------------------------------------------------------

def test_name_and_modes(env):
    assert env.f_ops.name == "ops"
    assert env.f_intro.name == "intro"
    assert env.f_ops.output_modes == env.ops
    assert env.f_single.output_modes == ["avg"]
    assert env.f_upd.update_modes == ["avg"]
    assert env.f_upd_sum.update_modes == ["sum"]
    assert env.f_upd_max.update_modes == ["max"]
    assert env.f_get.update_modes == []


def test_build_inputs(env, rng):
    xf = rng.standard_normal((5, 3))                # float64 values for float32 inputs
    yf = rng.standard_normal(3).astype("float32")
    with pytest.raises(TypeError, match="force_cast"):
        env.f_intro.build_inputs(xf, yf)
    dx, dy = env.f_intro.build_inputs(xf, yf, force_cast=True, oversize=2)
    assert isinstance(dx, synk.Data) and isinstance(dy, synk.Data)
    assert dx.dtype == np.float32 and dx.shape == (5, 3) and dx.alloc_size == 30
    assert dy.dtype == np.float32
    np.testing.assert_allclose(env.f_intro(dx, dy),
                               env.serial_intro(xf.astype("float32"), yf), rtol=1e-5)
    d = env.f_single.build_inputs(x=rng.standard_normal((4, 3)), minibatch=True)
    assert isinstance(d, synk.Data) and d.minibatch


# ---- misuse: clear errors, nothing runs, the next call works ----------------------

MISUSE = {
    "wrong dtype": (TypeError, "dtype", lambda e, d: e.f_ops(
        synk.data(np.zeros((4, 3), dtype=np.float32)))),
    "wrong ndim": (TypeError, "ndim", lambda e, d: e.f_ops(synk.data(np.zeros(4)))),
    "lossy cast": (TypeError, "dtype", lambda e, d: e.f_intro(np.zeros((3, 2)), np.zeros(2))),
    "not data": (TypeError, "input x", lambda e, d: e.f_ops("abc")),
    "not data either": (TypeError, "input x", lambda e, d: e.f_ops({"a": 1})),
    "missing": (TypeError, "missing", lambda e, d: e.f_ops()),
    "too many": (TypeError, "takes", lambda e, d: e.f_ops(d, d)),
    "unknown name": (TypeError, "nope", lambda e, d: e.f_ops(nope=d)),
    "given twice": (TypeError, "twice", lambda e, d: e.f_ops(d, x=d)),
    "unequal lengths": (ValueError, "equal lengths",
                        lambda e, d: e.f_mb(d, synk.data(np.zeros((3, 3))))),
    "batch float": (TypeError, "batch", lambda e, d: e.f_ops(d, batch=1.5)),
    "batch 2-d": (TypeError, "batch", lambda e, d: e.f_ops(d, batch=[[1, 2]])),
    "batch floats": (TypeError, "batch", lambda e, d: e.f_ops(d, batch=[0.5, 1.0])),
    "batch str": (TypeError, "batch", lambda e, d: e.f_ops(d, batch="all")),
    "batch step": (ValueError, "batch", lambda e, d: e.f_ops(d, batch=slice(0, 6, 2))),
    "batch negative": (ValueError, "batch", lambda e, d: e.f_ops(d, batch=-1)),
    "batch int too long": (ValueError, "batch", lambda e, d: e.f_ops(d, batch=N_ROWS + 1)),
    "batch slice too long": (ValueError, "batch",
                             lambda e, d: e.f_ops(d, batch=slice(2, N_ROWS + 5))),
    "batch index too high": (ValueError, "batch", lambda e, d: e.f_ops(d, batch=[0, N_ROWS])),
    "batch index negative": (ValueError, "batch", lambda e, d: e.f_ops(d, batch=[3, -1])),
    "batch without scattered input": (ValueError, "batch", lambda e, d: e.f_get(batch=2)),
    "num_slices 0": (ValueError, "num_slices", lambda e, d: e.f_ops(d, num_slices=0)),
    "num_slices float": (ValueError, "num_slices", lambda e, d: e.f_ops(d, num_slices=1.5)),
    "num_slices str": (ValueError, "num_slices", lambda e, d: e.f_ops(d, num_slices="2")),
    "num_slices bool": (ValueError, "num_slices", lambda e, d: e.f_ops(d, num_slices=True)),
    "subset range": (ValueError, "output_subset", lambda e, d: e.f_ops(d, output_subset=[8])),
    "subset repeat": (ValueError, "output_subset",
                      lambda e, d: e.f_ops(d, output_subset=[0, 0])),
    # output indices are ints: not truncated floats, digits or bools
    "subset float": (TypeError, "output_subset", lambda e, d: e.f_ops(d, output_subset=[0.7])),
    "subset digit": (TypeError, "output_subset", lambda e, d: e.f_ops(d, output_subset="1")),
    "subset digits": (TypeError, "output_subset", lambda e, d: e.f_ops(d, output_subset=["1"])),
    "subset bool": (TypeError, "output_subset", lambda e, d: e.f_ops(d, output_subset=[True])),
    "subset bools": (TypeError, "output_subset",
                     lambda e, d: e.f_ops(d, output_subset=np.array([True, False]))),
    "subset int": (TypeError, "output_subset", lambda e, d: e.f_ops(d, output_subset=1)),
    "batch uint64 wraps": (IndexError, "batch",
                           lambda e, d: e.f_ops(d, batch=np.array([2**64 - 1], "uint64"))),
    "batch bool index": (TypeError, "batch", lambda e, d: e.f_ops(d, batch=[0, True])),
    "ambiguous name": (TypeError, "named 'x'.*ambiguous",
                       lambda e, d: e.f_dup(x=d)),
    "ambiguous name missing": (TypeError, r"missing inputs: x \(input 1\)",
                               lambda e, d: e.f_dup(d)),
    "build_inputs force_cast str": (TypeError, "build_inputs: force_cast",
                                    lambda e, d: e.f_single.build_inputs(d.data,
                                                                         force_cast="no")),
    "build_inputs minibatch str": (TypeError, "build_inputs: minibatch",
                                   lambda e, d: e.f_single.build_inputs(d.data,
                                                                        minibatch="no")),
    "batch_s unsliceable": (ValueError, "batch_s",
                            lambda e, d: e.f_ops(d, batch_s=slice(0, 2))),
    "batch_s count": (ValueError, "batch_s",
                      lambda e, d: e.f_S(batch_s=[slice(0, 1)] * (e.n + 1))),
    "batch_s int": (TypeError, "batch_s", lambda e, d: e.f_S(batch_s=2)),
    "function after distribute": (synk.SynkStateError, "distribute",
                                  lambda e, d: synk.function([e.x], e.x.sum())),
    "distribute twice": (synk.SynkStateError, "distribute", lambda e, d: synk.distribute()),
}


@pytest.mark.parametrize("case", list(MISUSE))
def test_misuse_raises_before_running_and_the_next_call_works(env, xd, case):
    x, d = xd
    exc, words, call = MISUSE[case]
    with pytest.raises(exc, match=words):
        call(env, d)
    assert_ops(env, env.f_ops(d), x)


def test_reducing_outputs_of_unequal_shapes_raises_and_recovers(env, xd):
    x, d = xd
    if env.n == 1:
        np.testing.assert_array_equal(env.f_rows_avg(d), x)
        return
    # Row-wise outputs of uneven shares cannot be averaged: use "gather" or None.
    with pytest.raises(ValueError, match="gather"):
        env.f_rows_avg(d)
    assert_ops(env, env.f_ops(d), x)


def test_data_of_a_closed_run_is_refused(env, rng):
    # A Data object from this run works; its memory freed, it is refused by name.
    x = rng.standard_normal((N_ROWS, 3))
    d = synk.data(x)
    d.free_memory()
    with pytest.raises(ValueError, match="no memory"):
        env.f_ops(d)
    d.set_value(x)
    assert_ops(env, env.f_ops(d), x)
