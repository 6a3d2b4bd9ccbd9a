"""reducers: the op table and the NumPy reductions behind it."""

import numpy as np
import pytest

from synkhronos.comm import reduce_ops


@pytest.fixture
def parts(rng):
    return [rng.standard_normal((4, 3)) for _ in range(3)]


@pytest.mark.parametrize("op, numpy_fn", [
    ("sum", np.sum), ("prod", np.prod), ("max", np.max), ("min", np.min), ("avg", np.mean),
])
def test_combine_matches_numpy(parts, op, numpy_fn):
    expected = numpy_fn(np.stack(parts), axis=0)
    np.testing.assert_allclose(reduce_ops.combine(op, parts), expected, rtol=1e-12)


def test_combine_does_not_modify_its_inputs(parts):
    before = [p.copy() for p in parts]
    for op in reduce_ops.COLLECTIVE_OPS:
        reduce_ops.combine(op, parts)
        reduce_ops.combine(op, parts, weights=[1, 2, 3])
    for p, b in zip(parts, before):
        np.testing.assert_array_equal(p, b)


def test_weighted_avg_of_uneven_shares_is_the_whole_mean(rng):
    x = rng.standard_normal((11, 4))
    shares = np.array_split(x, 3)                    # 4, 4 and 3 rows
    means = [s.mean(axis=0) for s in shares]
    got = reduce_ops.combine("avg", means, weights=[len(s) for s in shares])
    np.testing.assert_allclose(got, x.mean(axis=0), rtol=1e-12)
    # Equal weighting (the original's rule) is not exact here.
    assert not np.allclose(reduce_ops.combine("avg", means), x.mean(axis=0), rtol=1e-12)


def test_weighted_avg_ignores_zero_weight_parts(rng):
    a, b = rng.standard_normal(3), rng.standard_normal(3)
    np.testing.assert_allclose(reduce_ops.combine("avg", [a, b], weights=[5, 0]), a)


def test_avg_of_integers_is_float64():
    got = reduce_ops.combine("avg", [np.array([1, 2]), np.array([2, 5])])
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [1.5, 3.5])


def test_combine_into_out_buffer(parts):
    out = np.empty((4, 3))
    ret = reduce_ops.combine("max", parts, out=out)
    assert ret is out
    np.testing.assert_array_equal(out, np.max(np.stack(parts), axis=0))


def test_combine_keeps_dtype_for_non_avg_ops():
    parts = [np.array([1, 2], dtype=np.int32), np.array([3, 4], dtype=np.int32)]
    got = reduce_ops.combine("sum", parts)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [4, 6])


def test_combine_scalars():
    parts = [np.float64(2.0), np.float64(3.0), np.float64(7.0)]
    assert reduce_ops.combine("prod", parts) == 42.0
    assert reduce_ops.combine("avg", parts, weights=[1, 1, 2]) == pytest.approx(4.75)


@pytest.mark.parametrize("op, numpy_fn", [
    ("sum", np.sum), ("prod", np.prod), ("max", np.max), ("min", np.min)])
def test_accumulate_folds_like_numpy(rng, op, numpy_fn):
    values = [rng.standard_normal(5) for _ in range(4)]
    acc = None
    for v in values:
        acc = reduce_ops.accumulate(op, acc, v)
    np.testing.assert_allclose(acc, numpy_fn(np.stack(values), axis=0), rtol=1e-12)


def test_accumulate_avg_is_a_running_weighted_mean(rng):
    x = rng.standard_normal((10, 3))
    slices = np.array_split(x, 4)
    acc, w_acc = None, 0.0
    for s in slices:
        acc = reduce_ops.accumulate("avg", acc, s.mean(axis=0), w_acc, float(len(s)))
        w_acc += len(s)
    np.testing.assert_allclose(acc, x.mean(axis=0), rtol=1e-12)


def test_accumulate_first_value_is_copied():
    v = np.array([1.0, 2.0])
    acc = reduce_ops.accumulate("sum", None, v)
    acc += 1
    np.testing.assert_array_equal(v, [1.0, 2.0])


def test_accumulate_rejects_gather_and_none():
    for op in ("gather", None):
        with pytest.raises(ValueError):
            reduce_ops.accumulate(op, None, np.zeros(2))


@pytest.mark.parametrize("op", ["avg", "sum", "prod", "max", "min"])
def test_check_op_accepts_collective_ops(op):
    assert reduce_ops.check_op(op, "all_reduce") == op


@pytest.mark.parametrize("op", [None, "gather"])
def test_check_op_output_only_ops(op):
    assert reduce_ops.check_op(op, "function", reduce_ops.OUTPUT_OPS) == op
    with pytest.raises(ValueError, match="all_reduce"):
        reduce_ops.check_op(op, "all_reduce")


@pytest.mark.parametrize("op", ["mean", "Sum", "", 1, ("sum",), np.add])
def test_check_op_rejects_and_names_where(op):
    with pytest.raises(ValueError) as info:
        reduce_ops.check_op(op, "all_reduce", reduce_ops.OUTPUT_OPS)
    msg = str(info.value)
    assert msg.startswith("all_reduce")
    assert "avg" in msg and "None" in msg and repr(op) in msg
