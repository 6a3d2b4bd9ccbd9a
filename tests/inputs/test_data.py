"""Data (synk.data): construction, shared-memory life cycle, indexing, and what workers see."""

import math
import os

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(90)


def _exists(seg_name):
    return os.path.exists("/dev/shm/" + seg_name.lstrip("/"))


def _my_segments():
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"synk_{os.getpid()}_")]


def test_data_before_fork_raises_state_error():
    with pytest.raises(synk.SynkStateError, match="fork"):
        synk.data(np.zeros(3))
    with pytest.raises(RuntimeError):
        synk.data(dtype="float32", ndim=1)


def test_construction_and_attributes(forked, rng):
    forked(2)
    x = rng.standard_normal((5, 3))

    d = synk.data(x, name="xs")
    assert isinstance(d, synk.Data)
    assert d.dtype == np.float64 and d.ndim == 2 and d.shape == (5, 3) and d.size == 15
    assert d.name == "xs" and d.minibatch is False
    assert len(d) == 5
    assert d.alloc_size == 15
    assert isinstance(d.data, np.ndarray)
    np.testing.assert_array_equal(d.data, x)
    assert not np.shares_memory(d.data, x)           # copied into shared memory
    x[0, 0] = 99.0
    assert d[0, 0] != 99.0

    # dtype and ndim from a variable; no memory until a value or shape comes.
    v = pt.ftensor3("v")
    e = synk.data(var=v, minibatch=True)
    assert e.dtype == np.float32 and e.ndim == 3 and e.minibatch is True
    assert e.data is None and e.shape is None and e.alloc_size == 0 and e.size == 0

    # dtype and ndim given directly, with a shape: allocated, right shape.
    f = synk.data(dtype="int32", ndim=2, shape=(4, 2))
    assert f.dtype == np.int32 and f.shape == (4, 2) and f.alloc_size == 8

    # shape alone implies ndim; dtype still needed.
    g = synk.data(dtype=np.int16, shape=[3])
    assert g.ndim == 1 and g.shape == (3,)

    # a list value: dtype and ndim from numpy.asarray, or from dtype=.
    h = synk.data([[1, 2], [3, 4]])
    assert h.ndim == 2 and h.dtype == np.asarray([[1, 2]]).dtype
    k = synk.data([1, 2, 3], dtype="float32")
    assert k.dtype == np.float32
    np.testing.assert_array_equal(k.data, [1.0, 2.0, 3.0])

    # a 0-d value
    s = synk.data(np.float64(2.5))
    assert s.ndim == 0 and s.shape == () and s[()] == 2.5
    with pytest.raises(TypeError):
        len(s)

    # oversize: the allocation grows by the factor, the array keeps its shape.
    o = synk.data(x, oversize=1.5)
    assert o.shape == (5, 3) and o.alloc_size == math.ceil(15 * 1.5)
    o2 = synk.data(var=pt.dmatrix(), shape=(4, 4), oversize=2)
    assert o2.alloc_size == 32


def test_values_follow_pytensors_casting_rule(forked):
    forked(1)
    # lossless casts are silent; Python values convert when no value changes
    a = synk.data(np.arange(3, dtype=np.int8), dtype="int64")
    assert a.dtype == np.int64 and a.data.tolist() == [0, 1, 2]
    assert synk.data([1, 2], dtype="float32").data.tolist() == [1.0, 2.0]
    assert synk.data([0.5], dtype="float32").dtype == np.float32   # floats to floatX
    with pytest.raises(TypeError, match="data: input_data needs dtype int32; its values change"):
        synk.data([1.5, 2], dtype="int32")
    assert synk.data([1.5, 2], dtype="int32", force_cast=True).data.tolist() == [1, 2]
    # only numeric dtypes
    with pytest.raises(TypeError, match="numeric"):
        synk.data(["a", "bb"])


def test_construction_errors(forked):
    forked(1)
    rt = get_runtime()
    with pytest.raises(TypeError, match="dtype and ndim"):
        synk.data()
    with pytest.raises(TypeError, match="dtype and ndim"):
        synk.data(dtype="float32")
    with pytest.raises(TypeError, match="dtype and ndim"):
        synk.data(ndim=2)
    # a value of another dtype than the variable's
    with pytest.raises(TypeError, match="force_cast"):
        synk.data(np.zeros((2, 2)), var=pt.fmatrix())
    with pytest.raises(TypeError, match="force_cast"):
        synk.data(np.zeros(3, dtype=np.int64), dtype="float32")
    d = synk.data(np.arange(4.0).reshape(2, 2), var=pt.fmatrix(), force_cast=True)
    assert d.dtype == np.float32
    np.testing.assert_array_equal(d.data, [[0, 1], [2, 3]])
    # dtype and var disagreeing, ndim disagreeing
    with pytest.raises(TypeError, match="dtype"):
        synk.data(var=pt.fmatrix(), dtype="float64")
    with pytest.raises(TypeError, match="ndim"):
        synk.data(var=pt.fmatrix(), ndim=3)
    with pytest.raises(TypeError, match="ndim"):
        synk.data(np.zeros(3, dtype=np.float32), var=pt.fmatrix())

    with pytest.raises(TypeError, match="var"):
        synk.data(var=3)
    with pytest.raises(ValueError, match="oversize"):
        synk.data(np.zeros(3), oversize=3)
    with pytest.raises(ValueError, match="oversize"):
        synk.data(np.zeros(3), oversize=0.5)
    with pytest.raises(ValueError, match="max_dim"):
        synk.data(dtype="float32", ndim=17)
    with pytest.raises(TypeError, match="dtype"):
        synk.data(np.array(["a", "b"], dtype=object))
    # a failed data() leaves nothing registered behind
    assert list(rt.registry.datas.values()) == [d]


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(shape=(2.5, 3)), TypeError, "data: shape must be a list or tuple of ints"),
    (dict(shape=(3.0, 3)), TypeError, "data: shape"),
    (dict(shape="ab"), TypeError, "data: shape"),
    (dict(shape=[float("nan"), 3]), TypeError, "data: shape"),
    (dict(shape=(True, 3)), TypeError, "data: shape"),
    (dict(shape=5), TypeError, "data: shape"),
    (dict(shape=(2, -1)), ValueError, "data: shape entries must be >= 0"),
    (dict(shape=(2, 3), ndim=3), ValueError, "data: shape must have 3 entries"),
    (dict(shape=(2,), var=pt.fmatrix()), ValueError, "data: shape must have 2 entries"),
    (dict(value=[[1.5]], force_cast="no"), TypeError, "data: force_cast"),
    (dict(value=[[1.5]], force_cast=1), TypeError, "data: force_cast"),
    (dict(value=[[1.5]], minibatch="no"), TypeError, "data: minibatch"),
    (dict(value=[[1.5]], name=7), TypeError, "data: name"),
    (dict(shape=(2,), ndim=1.0), TypeError, "data: ndim"),
    (dict(shape=(2,), ndim=True), TypeError, "data: ndim"),
    (dict(shape=(2,), dtype="nope"), TypeError, "data: dtype"),
    (dict(value=[[1, 2], [3]]), TypeError, "data: value does not convert"),
])
def test_data_arguments_are_checked_by_name(forked, kwargs, exc, words):
    forked(1)
    rt = get_runtime()
    kwargs.setdefault("dtype", "float32")
    with pytest.raises(exc, match=words):
        synk.data(**kwargs)
    assert len(rt.registry.datas) == 0
    assert synk.data(shape=np.array([2, 3]), dtype="float32").shape == (2, 3)


def test_flags_of_set_value_are_bools(forked):
    forked(1)
    d = synk.data(np.zeros(3, "int64"))
    with pytest.raises(TypeError, match="set_value: force_cast"):
        d.set_value(np.full(3, 1.5), force_cast="no")
    with pytest.raises(TypeError, match="condition_data: force_cast"):
        d.condition_data(np.ones(3), force_cast="yes")
    np.testing.assert_array_equal(d.data, np.zeros(3))
    d.set_value(np.full(3, 1.5), force_cast=np.True_)
    np.testing.assert_array_equal(d.data, np.ones(3))


def test_a_data_id_in_use_is_refused(forked):
    forked(2)
    x = pt.dvector("x")
    f = synk.function([x], (x.sum(), "sum"))
    synk.distribute()
    d = synk.data(np.arange(4.0))
    with pytest.raises(ValueError, match=f"Data: ID {d._ID} is in use"):
        synk.Data(d._ID, "float64", 1)
    with pytest.raises(TypeError, match="Data: ID must be an int"):
        synk.Data(1.0, "float64", 1)
    with pytest.raises(TypeError, match="Data: minibatch"):
        synk.Data(10 ** 6, "float64", 1, minibatch="no")
    assert f(d) == 6.0                               # the original still works everywhere
    # A Data made directly on a fresh id works, and data() skips the ids it takes.
    rt = get_runtime()
    mine = synk.Data(next(rt.counter) + 1, "float64", 1)   # the id data() draws next
    mine.set_value(np.ones(3))
    e = synk.data(np.full(2, 5.0))
    assert e._ID != mine._ID
    assert (f(mine), f(e), f(d)) == (3.0, 10.0, 6.0)


def test_set_value_length_shape_and_free_memory_in_the_master(forked, rng):
    forked(2)
    x = rng.standard_normal((6, 2))
    d = synk.data(x, oversize=2)
    assert d.alloc_size == 24
    seg = d._seg.name

    # same size, and growing within the allocation: no reallocation
    y = rng.standard_normal((10, 2))
    d.set_value(y)
    np.testing.assert_array_equal(d.data, y)
    assert d.shape == (10, 2) and d.alloc_size == 24 and d._seg.name == seg

    # a lossy cast needs force_cast, a lossless one is silent (PyTensor's rule);
    # a wrong ndim is a TypeError, as everywhere
    with pytest.raises(TypeError, match="set_value: input_data needs dtype float64; got complex128"):
        d.set_value(y.astype(np.complex128))
    np.testing.assert_array_equal(d.data, y)             # unchanged
    d.set_value(y.astype(np.complex128) + 0j, force_cast=True)
    np.testing.assert_array_equal(d.data, y)
    d.set_value(y.astype(np.float32))
    assert d.dtype == np.float64
    np.testing.assert_array_equal(d.data, y.astype(np.float32).astype(np.float64))
    with pytest.raises(TypeError, match="set_value: input_data needs ndim 2; got ndim 1"):
        d.set_value(np.zeros(4))
    with pytest.raises(ValueError, match="oversize"):
        d.set_value(y, oversize=2.5)

    # bigger than the allocation: reallocates, old segment unlinked
    z = rng.standard_normal((20, 2))
    d.set_value(z, oversize=1.5)
    assert d.alloc_size == 60 and d._seg.name != seg
    assert not _exists(seg) and _exists(d._seg.name)
    np.testing.assert_array_equal(d.data, z)

    # set_length keeps the rows that fit, in place and across a reallocation
    d.set_length(7)
    assert d.shape == (7, 2) and d.alloc_size == 60
    np.testing.assert_array_equal(d.data, z[:7])
    d.set_length(40)
    assert d.shape == (40, 2) and d.alloc_size == 80
    np.testing.assert_array_equal(d.data[:7], z[:7])
    with pytest.raises(ValueError, match="length"):
        d.set_length(-1)
    with pytest.raises(ValueError, match="length"):
        d.set_length(2.0)

    # set_shape keeps the leading items that fit
    d.set_value(np.arange(12.0).reshape(6, 2))
    d.set_shape((3, 2))
    np.testing.assert_array_equal(d.data, [[0, 1], [2, 3], [4, 5]])
    d.set_shape([2, 5])
    assert d.shape == (2, 5)
    np.testing.assert_array_equal(d.data.reshape(-1)[:6], np.arange(6.0))
    with pytest.raises(ValueError, match="entries"):
        d.set_shape((2, 2, 2))
    with pytest.raises(ValueError, match=">= 0"):
        d.set_shape((2, -2))
    with pytest.raises(TypeError, match="shape"):
        d.set_shape(5)

    # condition_data shows what set_value would store, and stores nothing
    before = d.data.copy()
    c = d.condition_data([[1, 2, 3]])
    assert c.dtype == np.float64 and c.shape == (1, 3)
    c = d.condition_data(np.ones((2, 3), dtype=np.int64), force_cast=True)
    assert c.dtype == np.float64
    assert d.condition_data(np.ones((2, 3), dtype=np.int64)).dtype == np.float64  # lossless
    with pytest.raises(TypeError, match="condition_data: input_data needs dtype float64; "
                                         "got complex64.*force_cast"):
        d.condition_data(np.ones((2, 3), dtype=np.complex64))
    with pytest.raises(TypeError, match="condition_data: input_data needs ndim 2"):
        d.condition_data(np.ones(3))
    np.testing.assert_array_equal(d.data, before)

    # free_memory drops the segment; set_value allocates again
    seg = d._seg.name
    d.free_memory()
    assert d.data is None and d.shape is None and d.alloc_size == 0
    assert not _exists(seg)
    with pytest.raises(ValueError, match="no memory"):
        d[0]
    d.free_memory()                               # twice is harmless
    d.set_value(x)
    np.testing.assert_array_equal(d.data, x)
    assert d.alloc_size == x.size

    # a Data without memory can take a shape later
    e = synk.data(var=pt.dvector())
    e.set_length(3)
    assert e.shape == (3,)


def test_numpy_indexing_get_and_set(forked, rng):
    forked(1)
    ref = rng.standard_normal((6, 4, 3))
    d = synk.data(ref)
    keys = [
        2, -1, (1, 2), (1, 2, 0), slice(1, 5), slice(None, None, -2), (Ellipsis, 1),
        (slice(None), [0, 3]), [4, 0, 0], np.array([5, 1]), ref[:, 0, 0] > 0,
        (ref > 0.5), (slice(1, 3), None, 2), np.s_[::2, 1:, ::-1],
    ]
    for k in keys:
        np.testing.assert_array_equal(d[k], ref[k])
    for k in keys:
        ref[k] = 7.0 if np.ndim(ref[k]) == 0 else rng.standard_normal(np.shape(ref[k]))
        d[k] = ref[k]
        np.testing.assert_array_equal(d.data, ref)
    d[...] = 0.0
    assert not d.data.any()
    # .data is the underlying array: writes through it are seen by d
    d.data[2, 2, 2] = 5.0
    assert d[2, 2, 2] == 5.0


@pytest.mark.parametrize("n", [2, 3])
def test_workers_see_values_and_reallocations(forked, rng, n):
    """Every change made in the master shows in the next call on every rank."""
    forked(n)
    x = pt.dmatrix("x")
    outs = [(x.sum(axis=0), "sum"), (x * 1, "gather"), (x.shape[0], None)]
    f = synk.function([x], outputs=outs)
    serial = pytensor.function([x], [o for o, _ in outs])
    synk.distribute()

    def check(d):
        want = d.data.copy()
        got = f(d)
        s = serial(want)
        np.testing.assert_allclose(got[0], s[0], rtol=1e-12)
        np.testing.assert_array_equal(got[1], want)
        assert [int(r) for r in got[2]] == [len(a) for a in np.array_split(want, n)]

    a = rng.standard_normal((7, 3))
    d = synk.data(a, oversize=2)
    check(d)
    d.set_value(rng.standard_normal((7, 3)))        # same size
    check(d)
    d.set_value(rng.standard_normal((12, 3)))       # grows within the allocation
    check(d)
    segs_before = set(_my_segments())
    d.set_value(rng.standard_normal((30, 3)))       # reallocates everywhere
    assert d._seg.name.lstrip("/") not in segs_before
    check(d)
    d.set_length(8)
    check(d)
    d.set_shape((9, 3))
    check(d)
    d[::2] = -d[::2]                                # writes through indexing
    check(d)
    d.data[3] = 100.0                               # and through .data
    check(d)
    d.free_memory()
    with pytest.raises(ValueError, match="no memory"):
        f(d)
    d.set_value(rng.standard_normal((5, 3)))
    check(d)
    # data made after distribute() work as well
    check(synk.data(rng.standard_normal((4, 3))))


def test_segments_unlinked_after_close(forked, rng):
    forked(2)
    ds = [synk.data(rng.standard_normal((10, 2))) for _ in range(3)]
    names = [d._seg.name for d in ds]
    assert all(_exists(nm) for nm in names)
    view = ds[0].data
    synk.close()
    assert not any(_exists(nm) for nm in names)
    assert _my_segments() == []
    # the master keeps reading what it held
    assert view.shape == (10, 2)
    np.testing.assert_array_equal(ds[1].data.shape, (10, 2))
    # but cannot allocate for a closed run
    with pytest.raises(RuntimeError):
        ds[2].set_value(np.zeros((100, 2)))


def test_views_held_across_a_reallocation_stay_valid(forked):
    """A view taken before a reallocation keeps its (old) memory mapped."""
    forked(2)
    d = synk.data(np.arange(6.0))
    old = d.data
    d.set_value(np.arange(100.0))                   # reallocates
    np.testing.assert_array_equal(old, np.arange(6.0))
    old[0] = 5.0                                    # the old memory, not the new
    assert d[0] == 0.0
    d.set_length(1000)                              # reallocates, keeping the rows
    np.testing.assert_array_equal(d[:100], np.arange(100.0))
    d.free_memory()
    np.testing.assert_array_equal(old[1:], np.arange(1.0, 6.0))
