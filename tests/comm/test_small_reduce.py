"""The small reductions in C (synkhronos/comm/_reduce.c): scalars, small arrays, one output.

Every result is checked against NumPy or the Python code it replaces
(reduce_ops.combine_floats).
"""

import math
import mmap
import threading

import numpy as np
import pytest

from synkhronos.comm import reduce_ops
from synkhronos.comm._reduce import (SMALL_CODES, SmallReduce, combine_outputs, combine_scalar_array,
                                     pack_one, put_scalar_array)
from synkhronos.comm.slabs import EPOCH, EPOCH_WAITERS, GEN, STRIDE
from synkhronos.runtime._block import Block

pytestmark = pytest.mark.timeout(60)


def _block(n_slots=64):
    m = mmap.mmap(-1, 8 * n_slots)
    return m, Block(m), np.frombuffer(m, np.int64)


def _combine_floats(op, values, weights, dtype):
    """What the Python code gives (NaN where it divides by a zero total weight, as C does)."""
    try:
        return float(reduce_ops.combine_floats(op, [float(v) for v in values],
                                               [float(w) for w in weights], np.dtype(dtype)))
    except ZeroDivisionError:
        return math.nan


def _scalars(b, values, weights, dtype, seq, me):
    for q, (v, w) in enumerate(zip(values, weights)):
        if q != me:
            assert put_scalar_array(b, q * STRIDE + 3, seq, np.array(v, dtype), w)
    return [combine_scalar_array(b, 3, STRIDE, len(values), me, seq, code, np.array(values[me], dtype),
                                 weights[me]) for code in range(5)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_scalars_combine_to_the_bits_of_combine_floats(dtype, n):
    rng = np.random.default_rng(n)
    _, b, _ = _block(8 * STRIDE)
    for seq in range(1, 20):
        values = rng.standard_normal(n).astype(dtype)
        if seq % 5 == 0:
            values[:] = values[0]  # equal values average to themselves exactly
        weights = rng.integers(0, 9, n).astype(float) + (seq % 3 == 0)
        got = _scalars(b, values, weights, dtype, seq, me=seq % n)
        want = [_combine_floats(op, values, weights, dtype) for op in reduce_ops.COLLECTIVE_OPS]
        for op, g, w in zip(reduce_ops.COLLECTIVE_OPS, got, want):
            g = float(np.array(g, dtype))
            assert (g == w) or (math.isnan(g) and math.isnan(w)), (op, values, weights, g, w)


def test_scalars_follow_python_max_and_min_with_nan():
    _, b, _ = _block(8 * STRIDE)
    values = np.array([1.0, np.nan, 3.0])
    got = _scalars(b, values, np.ones(3), "float64", 1, me=0)
    assert got[3] == max(values.tolist()) and got[4] == min(values.tolist())


def test_a_scalar_from_another_command_or_dtype_is_not_combined():
    _, b, _ = _block(8 * STRIDE)
    assert put_scalar_array(b, STRIDE + 3, 5, np.array(1.0, "float32"), 1.0)
    mine = np.array(2.0, "float32")
    assert combine_scalar_array(b, 3, STRIDE, 2, 0, 6, 1, mine, 1.0) is None    # older seq
    assert combine_scalar_array(b, 3, STRIDE, 2, 0, 5, 1, np.array(2.0), 1.0) is None  # float64
    assert combine_scalar_array(b, 3, STRIDE, 2, 0, 5, 1, mine, 1.0) == 3.0
    for other in (np.array([1.0]), np.array(1, "int32"), np.array(1.0, "float16"), 1.0, "x"):
        assert not put_scalar_array(b, 3, 5, other, 1.0)
        assert combine_scalar_array(b, 3, STRIDE, 2, 0, 5, 1, other, 1.0) is None


class _Ranks:
    """n ranks' comm block and slabs in one process, as SmallReduce sees them."""

    def __init__(self, n, header, arrays, offsets):
        self.m, self.block, self.slots = _block(n * STRIDE)
        self.slabs = [bytearray(max(offsets) + 64 + 4096) for _ in range(n)]
        self.header, self.offsets = header, offsets
        self.n = n

    def leave(self, q, arrays, target):
        """Rank q's part: its header and arrays in its slab, its epoch published."""
        slab = self.slabs[q]
        slab[:len(self.header)] = self.header
        for a, off in zip(arrays, self.offsets):
            slab[off:off + a.nbytes] = a.tobytes()
        self.slots[q * STRIDE + EPOCH] = target

    def plan(self, me, codes, op, scale):
        return SmallReduce(self.block, me, self.n, STRIDE, EPOCH, EPOCH_WAITERS, GEN, self.header,
                           self.offsets, codes, reduce_ops.OP_CODES[op], scale)

    def run(self, plan, arrays, target, stage=0, spin_ns=0, block_ns=0):
        return plan.run(target, tuple(arrays), tuple(memoryview(s) for s in self.slabs),
                        tuple(0 for _ in range(self.n)), spin_ns, block_ns, stage)


def _values(rng, dtype, shape):
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return rng.standard_normal(shape).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)  # sums wrap


# avg of integers is refused before the small path (its result is a float).
CASES = [(np.dtype(c).name, op) for c in SMALL_CODES if c not in "lL"
         for op in ("sum", "prod", "max", "min", "avg") if op != "avg" or c in "fd"]


@pytest.mark.parametrize("dtype, op", CASES)
@pytest.mark.parametrize("n", [2, 3, 5])
def test_small_reduce_gives_numpys_bits(dtype, op, n):
    dt = np.dtype(dtype)
    rng = np.random.default_rng(n)
    per_rank = [[_values(rng, dt, (3,)), _values(rng, dt, (2, 2))] for _ in range(n)]
    if dt.kind == "f":
        per_rank[1][0][1] = np.nan  # max and min keep NaN as NumPy does
    header = b"h" * 40
    offsets = (64, 128)
    ranks = _Ranks(n, header, per_rank[0], offsets)
    for q in range(1, n):
        ranks.leave(q, per_rank[q], 11)
    mine = [a.copy() for a in per_rank[0]]
    scale = 1.0 / n if op == "avg" else None
    plan = ranks.plan(0, (dt.char * 2).encode(), op, scale)
    with np.errstate(all="ignore"):
        assert ranks.run(plan, mine, 11) == 1
        for i in range(2):
            ufunc = reduce_ops.UFUNCS[op]
            want = ufunc(per_rank[0][i], per_rank[1][i])
            for q in range(2, n):
                want = ufunc(want, per_rank[q][i])
            if scale is not None:
                want *= scale
            np.testing.assert_array_equal(mine[i], want)
            assert mine[i].dtype == dt
    assert ranks.slots[EPOCH] == 11  # this rank's epoch published


def test_small_reduce_waits_reports_headers_and_generations():
    a = [np.arange(4, dtype="float32")]
    ranks = _Ranks(2, b"x" * 40, a, (64,))
    plan = ranks.plan(0, b"f", "sum", None)
    mine = [a[0].copy()]
    assert ranks.run(plan, mine, 5, spin_ns=100_000) == 0  # rank 1 not there: still waiting
    ranks.leave(1, a, 5)
    ranks.slots[STRIDE + GEN] = 3                   # rank 1's slab is a newer generation
    assert ranks.run(plan, mine, 5, stage=1) == -2
    ranks.slots[STRIDE + GEN] = 0
    ranks.slabs[1][:2] = b"yy"                      # rank 1 packed something else
    assert ranks.run(plan, mine, 5, stage=1) == -1
    np.testing.assert_array_equal(mine[0], a[0])   # nothing written then
    ranks.slabs[1][:2] = b"xx"
    assert ranks.run(plan, mine, 5, stage=2) == 1
    np.testing.assert_array_equal(mine[0], 2 * a[0])


def test_small_reduce_refuses_what_does_not_fit():
    a = [np.arange(4, dtype="float32")]
    ranks = _Ranks(2, b"x" * 40, a, (64,))
    with pytest.raises(ValueError, match="not compiled"):
        ranks.plan(0, b"e", "sum", None)
    plan = ranks.plan(0, b"f", "sum", None)
    with pytest.raises(ValueError, match="do not fit"):
        ranks.run(plan, [np.zeros(5000, "float32")], 1)
    with pytest.raises(ValueError, match="one array per offset"):
        ranks.run(plan, [], 1)
    with pytest.raises(ValueError, match="contiguous"):
        ranks.run(plan, [np.arange(4, dtype="float32")[::2]], 1)


def test_one_output_packs_as_slabs_do_and_combines_by_rank():
    from synkhronos.comm.slabs import HEAD_STRUCT

    a = [np.array([1.5, -2.0, 3.0], "float32"), np.array([0.5, 4.0, -1.0], "float32")]
    m, block, slots = _block(2 * STRIDE)
    head = HEAD_STRUCT.pack(1, 0.0, 0) + np.array([ord("f"), 1, 128, 12, 3], np.int64).tobytes()
    slab = bytearray(256)
    pack_one(slab, head, 3.0, a[1], 128)
    assert HEAD_STRUCT.unpack_from(slab, 0) == (1, 3.0, 0)  # the weight set, the rest as given
    assert bytes(slab[16:len(head)]) == head[16:]
    np.testing.assert_array_equal(np.frombuffer(slab, "float32", 3, 128), a[1])
    slabs = (bytearray(256), slab)
    out = np.empty(3, "float32")
    gens = (0, 0)
    for op, code in reduce_ops.OP_CODES.items():
        assert combine_outputs(block, STRIDE, GEN, gens, slabs, 0, head, a[0], 1.0, 128, code, out) == 1
        want = reduce_ops.combine(op, a, [1.0, 3.0])
        np.testing.assert_array_equal(out, want)
    slots[STRIDE + GEN] = 1  # rank 1's slab is newer than the one mapped
    assert combine_outputs(block, STRIDE, GEN, gens, slabs, 0, head, a[0], 1.0, 128, 1, out) == -2
    slots[STRIDE + GEN] = 0
    other = HEAD_STRUCT.pack(1, 0.0, 0) + np.array([ord("f"), 1, 128, 12, 4], np.int64).tobytes()
    assert combine_outputs(block, STRIDE, GEN, gens, slabs, 0, other, a[0], 1.0, 128, 1, out) == 0
    with pytest.raises(ValueError, match="do not fit"):
        pack_one(bytearray(64), head, 1.0, a[0], 128)


def test_a_reduce_waiting_without_the_gil_keeps_its_own_slabs():
    # One run waits for rank 1 in another thread (GIL released, its slab views held) while
    # a run of another plan completes here: each must reduce its own slabs (views in a
    # static array were overwritten by the second run, then released twice).
    a = np.arange(4, dtype="float32")
    first, second = _Ranks(2, b"x" * 40, [a], (64,)), _Ranks(2, b"y" * 40, [a], (64,))
    plan = first.plan(0, b"f", "sum", None)
    mine, got = [a.copy()], []
    waiting = threading.Thread(target=lambda: got.append(first.run(plan, mine, 5, block_ns=10**10)))
    waiting.start()
    try:
        for _ in range(10_000):  # until it sleeps on rank 1's epoch
            if first.slots[STRIDE + EPOCH_WAITERS]:
                break
            waiting.join(0.001)
        assert first.slots[STRIDE + EPOCH_WAITERS] == 1
        second.leave(1, [10 * a], 7)
        theirs = [a.copy()]
        assert second.run(second.plan(0, b"f", "sum", None), theirs, 7) == 1
        np.testing.assert_array_equal(theirs[0], 11 * a)
    finally:
        first.leave(1, [100 * a], 5)
        first.block.publish(STRIDE + EPOCH, 5, STRIDE + EPOCH_WAITERS)
        waiting.join(10)
    assert got == [1]
    np.testing.assert_array_equal(mine[0], 101 * a)


def test_every_argument_is_checked():
    a = [np.arange(4, dtype="float32")]
    ranks = _Ranks(2, b"x" * 40, a, (64,))
    ranks.leave(1, a, 5)
    plan = ranks.plan(0, b"f", "sum", None)
    slabs = tuple(memoryview(s) for s in ranks.slabs)
    with pytest.raises(TypeError):  # a generation that is not an int
        plan.run(5, (a[0].copy(),), slabs, (0, "x"), 0, 0, 0)
    with pytest.raises(OverflowError):  # a stage that does not fit a C int
        plan.run(5, (a[0].copy(),), slabs, (0, 0), 0, 0, 2**40)
    with pytest.raises(ValueError, match="negative offset"):
        SmallReduce(ranks.block, 0, 2, STRIDE, EPOCH, EPOCH_WAITERS, GEN, ranks.header, (-8,), b"f",
                    1, None)
    with pytest.raises(TypeError, match="block"):
        put_scalar_array(bytearray(64), 3, 5, np.array(1.0), 1.0)
    with pytest.raises(OverflowError):  # an op that does not fit a C int
        combine_scalar_array(ranks.block, 3, STRIDE, 2, 0, 5, 2**40, np.array(1.0), 1.0)
    out = np.empty(4, "float32")
    with pytest.raises(TypeError):
        combine_outputs(ranks.block, STRIDE, GEN, (0, "x"), slabs, 0, ranks.header, a[0], 1.0, 64, 1,
                        out)
    with pytest.raises(ValueError, match="offset"):
        combine_outputs(ranks.block, STRIDE, GEN, (0, 0), slabs, 0, ranks.header, a[0], 1.0, -8, 1,
                        out)
