"""The compiled control path (synkhronos/runtime/_block.c): waits, wake-ups, scalars, small reductions.

Every result is checked against NumPy or the Python code it replaces
(reduce_ops.combine_floats); waits against a second process.
"""

import math
import mmap
import os
import signal
import time

import numpy as np
import pytest

from synkhronos.comm import reduce_ops
from synkhronos.comm.slabs import EPOCH, EPOCH_WAITERS, GEN, STRIDE
from synkhronos.runtime._block import EQ, GE, NE, SMALL_CODES, Block, SmallReduce

pytestmark = pytest.mark.timeout(60)


def _block(n_slots=64):
    m = mmap.mmap(-1, 8 * n_slots)
    return m, Block(m), np.frombuffer(m, np.int64)


def test_wait_returns_at_once_when_the_slot_holds():
    _, b, slots = _block()
    slots[5] = 7
    assert b.wait(5, EQ, 7, 1, 0, 0)
    assert b.wait(5, NE, 6, 1, 0, 0)
    assert b.wait(5, GE, 7, 1, 0, 0) and not b.wait(5, GE, 8, 1, 0, 0)
    assert b.wait_all((5, 6), GE, 0, 1, 0, 0)
    assert b.wait_all((), EQ, 1, 1, 0, 0)  # nothing to wait for


@pytest.mark.parametrize("spin_ns, block_ns", [(2_000_000, 0), (0, 2_000_000), (1_000_000, 1_000_000)])
def test_a_wait_that_never_holds_is_bounded(spin_ns, block_ns):
    _, b, slots = _block()
    t0 = time.perf_counter()
    assert not b.wait(3, EQ, 1, 1, spin_ns, block_ns)
    assert not b.wait_all((3, 4), EQ, 1, 1, spin_ns, block_ns)
    took = time.perf_counter() - t0
    assert (spin_ns + block_ns) * 2e-9 * 0.9 <= took < 1.0


def test_bad_slots_raise():
    _, b, _ = _block(8)
    with pytest.raises(IndexError, match="out of range"):
        b.wait(8, EQ, 0, 1, 0, 0)
    with pytest.raises(IndexError):
        b.publish(0, 1, 99)
    with pytest.raises(TypeError):
        b.wait_all([1, 2], EQ, 0, 1, 0, 0)
    b.release()
    with pytest.raises(ValueError, match="released"):
        b.publish(0, 1, 1)


def _ping_pong(n, spin_ns):
    """A forked child answers every number the parent publishes; return the seconds it took."""
    m, b, slots = _block()
    pid = os.fork()
    if pid == 0:
        try:
            for i in range(1, n + 1):
                while not b.wait(0, GE, i, 1, spin_ns, 50_000_000):
                    pass
                b.publish(8, i, 9)
        finally:
            os._exit(0)
    try:
        t0 = time.perf_counter()
        for i in range(1, n + 1):
            b.publish(0, i, 1)
            deadline = time.monotonic() + 10
            while not b.wait(8, GE, i, 1, spin_ns, 50_000_000):
                assert time.monotonic() < deadline, f"no answer to {i}"
        took = time.perf_counter() - t0
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert slots[8] == n and slots[9] == 0 and slots[1] == 0  # no waiter left registered
    return took


@pytest.mark.parametrize("spin_ns", [10_000_000, 0], ids=["spinning", "sleeping"])
def test_every_publish_reaches_a_waiting_process(spin_ns):
    # Sleeping waiters are woken through the futex: a lost wake-up would stall a round
    # for the whole 50 ms bound, so 300 rounds would take far longer than this.
    assert _ping_pong(300, spin_ns) < 10


def test_finish_writes_the_status_then_the_done_slot():
    _, b, slots = _block()
    b.finish(9, 8, 10, 1, 42)
    assert slots[9] == 1 and slots[8] == 42
    assert b.count_ne((9, 17, 25), 0) == 1


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
            assert b.put_scalar_array(q * STRIDE + 3, seq, np.array(v, dtype), w)
    return [b.combine_scalar_array(3, STRIDE, len(values), me, seq, code, np.array(values[me], dtype),
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
    assert b.put_scalar_array(STRIDE + 3, 5, np.array(1.0, "float32"), 1.0)
    mine = np.array(2.0, "float32")
    assert b.combine_scalar_array(3, STRIDE, 2, 0, 6, 1, mine, 1.0) is None    # older seq
    assert b.combine_scalar_array(3, STRIDE, 2, 0, 5, 1, np.array(2.0), 1.0) is None  # float64
    assert b.combine_scalar_array(3, STRIDE, 2, 0, 5, 1, mine, 1.0) == 3.0
    for other in (np.array([1.0]), np.array(1, "int32"), np.array(1.0, "float16"), 1.0, "x"):
        assert not b.put_scalar_array(3, 5, other, 1.0)
        assert b.combine_scalar_array(3, STRIDE, 2, 0, 5, 1, other, 1.0) is None


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
    from synkhronos.runtime._block import combine_outputs, pack_one

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
