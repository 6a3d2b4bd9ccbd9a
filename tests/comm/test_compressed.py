"""Reduced-precision all-reduce: bit for bit against a NumPy model of the 16-bit path, bytes counted.

The model (``_model``) computes with NumPy and ml_dtypes what the 16-bit
transport must give: each addend rounded to the small type (float16 ones
scaled by a power of two first), the addends summed in float32 in rank
order, the sum rounded again, then unscaled.  A float32 transport gives other bits (the exact
sum), so these tests fail if the values do not travel in 16 bits; the byte
counts fail if more than each rank's parts travel.
"""

import math

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos.comm import compressed, parts
from synkhronos.runtime.commands import COMMANDS, Command
from synkhronos.runtime.run import run_command
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(100)

# Relative precision of one rounding (unit roundoff).
EPS = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
# The documented float16 scale target: the largest scaled sum is at most this.
F16_TARGET = 2.0 ** 13
TEST_CMD = Command.GET_VALUE
SHAPES = [(100_003,), (7,), (0,), (3, 4)]  # the last one float64


def _model(inputs, op, dtype):
    """The 16-bit path's result for ``inputs[q]``, rank q's list of arrays, in NumPy."""
    n = len(inputs)
    small = compressed.small_dtype(dtype)
    out = []
    for i, like in enumerate(inputs[0]):
        xs = [np.asarray(inp[i], np.float32).reshape(-1) for inp in inputs]
        if n == 1:
            out.append(xs[0].astype(small).astype(like.dtype).reshape(like.shape))
            continue
        peak = max(float(np.max(np.abs(x), initial=0.0)) for x in xs)
        s = 1.0
        if dtype == "float16" and peak:
            s = 2.0 ** math.floor(math.log2(F16_TARGET / (n * peak)))
        total = (xs[0] * np.float32(s)).astype(small).astype(np.float32)
        for x in xs[1:]:
            total = total + (x * np.float32(s)).astype(small).astype(np.float32)
        factor = np.float32((1.0 / n if op == "avg" else 1.0) / s)
        result = total.astype(small).astype(np.float32) * factor
        out.append(result.astype(like.dtype).reshape(like.shape))
    return out


def _inputs(rank, shapes=SHAPES):
    rng = np.random.default_rng(100 + rank)
    return [rng.normal(size=s).astype("float64" if len(s) == 2 else "float32") * (rank + 1)
            for s in shapes]


# ---- run on every rank inside a test command (the master included) -------------------
def _run_test_fn(rt, payload):
    fn, args = payload
    fn(rt, *args)


class _Counter:
    """Count, in one process, the bytes a backend's collectives send for this rank.

    ``sent``: at the Backend interface, the 16-bit (uint16) values the
    other ranks receive from this one (``all_to_all``: the lists for the
    others; ``all_gather``: the arrays, once per other rank); ``control``:
    the other arrays, counted alike (shapes, float16's largest magnitudes).
    Nested calls (the default ``all_to_all`` calls ``all_gather``) are not
    counted twice.  ``wire``: all bytes the transport carries from this rank:
    zmq message data frames, or shm bytes packed into this rank's slab (read
    there by the others).
    """

    def __init__(self, be):
        self.be = be
        self.sent = {"all_to_all": 0, "all_gather": 0}
        self.control = 0
        self.wire = 0
        self.depth = 0
        n, me = be.n_parallel, be.rank
        receivers = {"all_to_all": lambda per_rank: [(a, 1) for q, e in enumerate(per_rank)
                                                     if q != me for a in e],
                     "all_gather": lambda arrays: [(a, n - 1) for a in arrays],
                     "all_reduce": lambda arrays, *_: [(a, n - 1) for a in arrays]}
        for name, sends in receivers.items():
            setattr(be, name, self._wrap(name, getattr(be, name), sends))
        if hasattr(be, "_send"):
            send = be._send

            def _send(q, arrays, *args, **kwargs):
                self.wire += sum(np.asarray(a).nbytes for a in arrays or [])
                return send(q, arrays, *args, **kwargs)
            be._send = _send
        else:
            pack = be.slabs.pack

            def _pack(arrays, *args, **kwargs):
                if arrays is not None and not kwargs.get("header_only"):
                    self.wire += sum(np.asarray(a).nbytes for a in arrays)
                return pack(arrays, *args, **kwargs)
            be.slabs.pack = _pack

    def _wrap(self, name, method, sends):
        def counted(*args, **kwargs):
            if self.depth == 0:
                for a, copies in sends(*args):
                    if a.dtype == np.uint16:
                        self.sent[name] += copies * a.nbytes
                    else:
                        self.control += copies * a.nbytes
            self.depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.depth -= 1
        return counted

    def close(self):
        for name in ("all_to_all", "all_gather", "all_reduce", "_send"):
            self.be.__dict__.pop(name, None)
        if hasattr(self.be, "slabs"):
            self.be.slabs.__dict__.pop("pack", None)


def _exact_and_counted(rt, dtype, op):
    """The result is the model's, bit for bit; the bytes sent are half of float32's."""
    n, me = rt.place.n_parallel, rt.place.rank
    be = rt.backend.host
    inputs = [_inputs(q) for q in range(n)]
    mine = [a.copy() for a in inputs[me]]
    counter = _Counter(be)
    try:
        got = compressed.all_reduce_16bit(be, mine, op, dtype, out=mine)
    finally:
        counter.close()
    for g, w, a in zip(got, _model(inputs, op, dtype), mine):
        assert g is a  # the inputs were their own outputs
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)
    # The elements this rank reduces (E of N): it sends the others' parts of
    # its values, 2(N - E) bytes, then its reduced part to each, 2E(n - 1).
    # A float32 reduce-scatter and all-gather sends 4(N - E) + 4E(n - 1).
    sizes = [int(np.prod(s)) for s in SHAPES]
    total = sum(sizes)
    e_me = sum(hi - lo for _, lo, hi in parts.byte_parts([np.empty(s, np.uint16) for s in sizes],
                                                   n)[me])
    data = counter.sent["all_to_all"] + counter.sent["all_gather"]
    assert data == 2 * (total - e_me) + 2 * e_me * (n - 1)
    assert counter.sent["all_to_all"] == 2 * (total - e_me)
    # The shapes (int64) to each other rank; float16's largest magnitudes.
    shapes = 8 * (1 + sum(1 + len(s) for s in SHAPES))
    peaks = 8 * len(SHAPES) if dtype == "float16" else 0
    assert counter.control == (shapes + peaks) * (n - 1)
    if hasattr(be, "_send"):
        # Messages: what the interface says, nothing more, and at most half
        # of what the float32 all_reduce of the same arrays sends.
        assert counter.wire == data + counter.control
        counter = _Counter(be)
        try:
            be.all_reduce([a.astype(np.float32) for a in inputs[me]], op)
        finally:
            counter.close()
        assert data <= counter.wire / 2
    else:
        # Slabs: this rank's values for the others once, its reduced part
        # once (each rank reads its own from there); the shapes once per
        # other rank, the largest magnitudes once.
        assert counter.wire == 2 * total + shapes * (n - 1) + peaks


def _float32_sum_would_differ(rt, dtype):
    """1 + 2^-9 (bfloat16) or 1 + 2^-12 (float16) on every rank: each addend rounds to 1."""
    n = rt.place.n_parallel
    x = 1.0 + (2.0 ** -9 if dtype == "bfloat16" else 2.0 ** -12)
    a = np.full(100_003, x, np.float32)
    got = compressed.all_reduce_16bit(rt.backend.host, [a], "sum", dtype)[0]
    assert np.float32(x) * n != n  # the float32 sum
    np.testing.assert_array_equal(got, np.full(a.size, n, np.float32))


def _all_to_all(rt):
    n, me = rt.place.n_parallel, rt.place.rank
    per_rank = [[np.full(q + 2 + me, 10 * me + q, np.int32), np.arange(q, dtype=np.uint16)]
                for q in range(n)]
    got = rt.backend.all_to_all(per_rank)
    assert len(got) == n
    for q, entry in enumerate(got):
        np.testing.assert_array_equal(entry[0], np.full(me + 2 + q, 10 * q + me, np.int32))
        np.testing.assert_array_equal(entry[1], np.arange(me, dtype=np.uint16))


def _shapes_differ(rt, dtype):
    a = np.ones((4, 3) if rt.place.rank == 1 else (3, 4), np.float32)
    compressed.all_reduce_16bit(rt.backend.host, [a], "sum", dtype)


@pytest.fixture
def start(forked, monkeypatch):
    monkeypatch.setitem(COMMANDS, TEST_CMD, COMMANDS[TEST_CMD]._replace(run=_run_test_fn))

    def _start(backend, n):
        monkeypatch.setenv("SYNK_BACKEND", backend)
        forked(n)
        rt = get_runtime()

        def run(fn, *args):
            return run_command(rt, TEST_CMD, (fn, args), local=lambda seq: fn(rt, *args))
        return run
    return _start


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("backend", ["shm", "zmq"])
def test_values_travel_in_16_bits_and_half_the_bytes(start, backend, n):
    run = start(backend, n)
    run(_all_to_all)
    for dtype in ("bfloat16", "float16"):
        run(_float32_sum_would_differ, dtype)
        for op in ("sum", "avg"):
            run(_exact_and_counted, dtype, op)


@pytest.mark.parametrize("backend", ["shm", "zmq"])
def test_shapes_that_differ_fail_on_every_rank(start, backend):
    run = start(backend, 3)
    for dtype in compressed.DTYPES:
        with pytest.raises(ValueError, match="differ across ranks"):
            run(_shapes_differ, dtype)
    run(_exact_and_counted, "bfloat16", "sum")  # still usable


# ---- through synk.all_reduce on shared variables ---------------------------------------
@pytest.fixture(params=["shm", "zmq"])
def backend(request, monkeypatch):
    monkeypatch.setenv("SYNK_BACKEND", request.param)
    return request.param


def _setup(n, big=50_001):
    v = pytensor.shared(np.zeros(big, "float32"), name="v")
    m = pytensor.shared(np.zeros((3, 4)), name="m")  # float64
    i = pytensor.shared(np.zeros(3, "int32"), name="i")
    synk.function([], v.sum() + m.sum() + i.sum(), mode="FAST_COMPILE")
    synk.distribute()
    return v, m, i


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_all_reduce_of_shared_variables_matches_the_model(forked, backend, n, dtype):
    forked(n)
    v, m, _ = _setup(n)
    rng = np.random.default_rng(n)
    vals = [rng.normal(size=50_001).astype("float32") for _ in range(n)]
    mats = [rng.normal(size=(3, 4)) * 1e3 for _ in range(n)]
    for r in range(n):
        synk.set_value(r, [v, m], [vals[r], mats[r]])
    synk.all_reduce([v, m], op="avg", dtype=dtype)
    want_v, want_m = _model([[x, y] for x, y in zip(vals, mats)], "avg", dtype)
    for r in range(n):
        got_v = synk.get_value(r, v)
        assert got_v.dtype == np.float32
        np.testing.assert_array_equal(got_v, want_v)
        np.testing.assert_array_equal(synk.get_value(r, m), want_m)
    # Within two roundings of the exact average (relative to the largest value).
    np.testing.assert_allclose(want_v, np.mean(vals, axis=0),
                               atol=3 * EPS[dtype] * np.max(np.abs(vals)), rtol=0)


def test_float16_neither_overflows_nor_underflows(forked):
    forked(3)
    v, m, _ = _setup(3, big=4)
    for r in range(3):
        synk.set_value(r, v, np.array([60000.0, -60000.0, 30000.0, 0.0], "float32") * (r + 1))
    synk.all_reduce(v, op="avg", dtype="float16")  # a float16 sum would reach 360000
    np.testing.assert_allclose(synk.get_value(1, v), [120000.0, -120000.0, 60000.0, 0.0],
                               rtol=2 * EPS["float16"])
    for r in range(3):
        synk.set_value(r, v, np.array([3e-6, 1e-7, 5e-8, 0.0], "float32"))
    synk.all_reduce(v, op="sum", dtype="float16")  # below float16's normal range unscaled
    np.testing.assert_allclose(synk.get_value(2, v), [9e-6, 3e-7, 1.5e-7, 0.0],
                               rtol=2 * EPS["float16"])


def test_conversions_round_as_ml_dtypes_and_numpy():
    bits = np.random.default_rng(0).integers(0, 2 ** 32, size=1 << 20, dtype=np.uint64)
    edges = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x477FF000, 0x477FEFFF,
             0x33000000, 0x33000001, 0x387FFFFF, 0x38800000, 0x3F808000, 0x3F818000, 1]
    x = np.concatenate([bits, np.array(edges, np.uint64)]).astype(np.uint32).view(np.float32)
    for dtype in compressed.DTYPES:
        k = compressed.kernels(dtype)
        small = compressed.small_dtype(dtype)
        got = k.down(x, np.float32(1.0), np.empty(x.size, np.uint16))
        with np.errstate(over="ignore", invalid="ignore"):
            want = x.astype(small)
        nan = np.isnan(x)
        np.testing.assert_array_equal(got[~nan], want[~nan].view(np.uint16))
        assert np.isnan(got[nan].view(small).astype(np.float32)).all()
        every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
        up = np.empty(every.size, np.float32)
        k.up(every, np.float32(1.0), up)
        want_up = every.view(small).astype(np.float32)
        finite = ~np.isnan(want_up)
        np.testing.assert_array_equal(up[finite], want_up[finite])
        assert np.isnan(up[~finite]).all()


def test_misuse_is_refused_before_any_rank_runs(forked):
    forked(2)
    v, m, i = _setup(2, big=4)
    with pytest.raises(ValueError, match="'bfloat16' or 'float16'"):
        synk.all_reduce(v, op="sum", dtype="int8")
    with pytest.raises(ValueError, match="op 'sum' or 'avg'"):
        synk.all_reduce(v, op="max", dtype="float16")
    with pytest.raises(TypeError, match="compresses floats"):
        synk.all_reduce(i, op="sum", dtype="float16")
    synk.all_reduce(v, op="sum", dtype="bfloat16")  # still usable


def test_train_function_with_compressed_all_reduce(forked):
    from synkhronos.extensions import layers as L
    from synkhronos.extensions import train

    forked(2)
    x, y = pt.matrix("x"), pt.ivector("y")
    d = L.Dense(5, 3, rng=np.random.default_rng(0), init="glorot")
    loss = L.softmax_cross_entropy(d(x), y).mean()
    step = train.make_train_function(loss, d.params, x, y, update_rule="sgd",
                                     update_kwargs={"learning_rate": 0.1},
                                     all_reduce_dtype="bfloat16", mode="FAST_COMPILE")
    xs, ys = pt.matrix("xs"), pt.ivector("ys")
    ds = L.Dense(5, 3, rng=np.random.default_rng(0), init="glorot")
    serial = train.make_serial_train_function(L.softmax_cross_entropy(ds(xs), ys).mean(),
                                              ds.params, xs, ys, update_rule="sgd",
                                              update_kwargs={"learning_rate": 0.1},
                                              mode="FAST_COMPILE")
    synk.distribute()
    rng = np.random.default_rng(1)
    x_data = rng.normal(size=(30, 5)).astype("float32")
    y_data = rng.integers(0, 3, size=30).astype("int32")
    for _ in range(5):
        np.testing.assert_allclose(step(x_data, y_data), serial(x_data, y_data), rtol=2e-2)
    np.testing.assert_allclose(d.W.get_value(), ds.W.get_value(), atol=2e-2)
    assert step.all_reduce_dtype == "bfloat16"
