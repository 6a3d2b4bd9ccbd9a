"""sharedvars: finding variables by object or name, checking ranks and values, and writing
results into a variable without aliasing what the caller or a backend still owns.

No processes: a stand-in runtime holds what ``distribute()`` records (the
variables, their ids, ``max_n_var``, the device-held ones).
"""

import os
import types

import numpy as np
import pytensor
import pytest

from synkhronos.inputs.rank_rows import RowIndex, RowRange
from synkhronos.variables import access
from synkhronos.runtime.state import Config, Placement, Runtime


def _runtime(shareds, n_parallel=3, max_n_var=1000):
    """A real Runtime, with no processes behind it."""
    rt = Runtime(Config(master_pid=os.getpid(), max_n_var=max_n_var),
                 Placement(rank=0, n_parallel=n_parallel, master_rank=0, local_index=0,
                           n_local=n_parallel, leader=0))
    rt.registry.shareds = list(shareds)
    rt.registry.shared_ids = {id(v): i for i, v in enumerate(shareds)}
    return rt


@pytest.fixture
def vs():
    """Three distributed variables (two named "b"), one a stranger to distribute()."""
    a = pytensor.shared(np.zeros(3), name="a")
    b1 = pytensor.shared(np.zeros((2, 2)), name="b")
    b2 = pytensor.shared(np.zeros(4, dtype="float32"), name="b")
    stranger = pytensor.shared(np.zeros(3), name="s")
    return types.SimpleNamespace(a=a, b1=b1, b2=b2, stranger=stranger,
                                 rt=_runtime([a, b1, b2]))


# ---- which variables -------------------------------------------------------------------------

def test_resolve_by_variable_and_name(vs):
    rt = vs.rt
    assert access.resolve(rt, vs.a, "all_reduce") == ([0], True)
    assert access.resolve(rt, "a", "all_reduce") == ([0], True)
    assert access.resolve(rt, [vs.b2, "a"], "all_reduce") == ([2, 0], False)
    assert access.resolve(rt, (vs.b1,), "all_reduce") == ([1], False)   # a tuple is a list


def test_resolve_refuses_what_it_cannot_name_exactly(vs):
    rt = vs.rt
    with pytest.raises(ValueError, match="all_reduce: shared_vars is empty"):
        access.resolve(rt, [], "all_reduce")
    with pytest.raises(ValueError, match="not used by any function given to distribute"):
        access.resolve(rt, vs.stranger, "all_reduce")
    with pytest.raises(ValueError, match="no shared variable named 'zz'"):
        access.resolve(rt, "zz", "all_reduce")
    with pytest.raises(ValueError, match="2 shared variables are named 'b'; pass the variable"):
        access.resolve(rt, "b", "all_reduce")
    with pytest.raises(TypeError, match="got ndarray"):
        access.resolve(rt, np.zeros(3), "broadcast")
    with pytest.raises(TypeError, match="got int"):
        access.resolve(rt, [vs.a, 3], "broadcast")


def test_resolve_refuses_a_variable_twice_unless_allowed(vs):
    with pytest.raises(ValueError, match="appears twice"):
        access.resolve(vs.rt, [vs.a, "a"], "broadcast")
    assert access.resolve(vs.rt, [vs.a, "a"], "gather", unique=False) == ([0, 0], False)


def test_resolve_names_max_n_var(vs):
    rt = _runtime([vs.a, vs.b1, vs.b2], max_n_var=2)
    with pytest.raises(ValueError, match="3 shared variables exceed max_n_var=2"):
        access.resolve(rt, [vs.a, vs.b1, vs.b2], "all_reduce")
    assert access.resolve(rt, [vs.a, vs.b1], "all_reduce") == ([0, 1], False)


def test_resolve_refuses_a_shared_variable_that_is_not_a_tensor():
    gen = pytensor.shared(np.random.default_rng(0), name="gen")
    rt = _runtime([gen])
    with pytest.raises(TypeError, match="not a tensor shared variable"):
        access.resolve(rt, gen, "broadcast")
    with pytest.raises(TypeError, match="not a tensor shared variable"):
        access.resolve(rt, "gen", "broadcast")


# ---- ranks and values ----------------------------------------------------------------------

def test_check_rank(vs):
    for rank in (0, 2, np.int64(1), np.uint8(2)):
        got = access.check_rank(vs.rt, rank, "get_value")
        assert got == int(rank) and type(got) is int
    for bad in (True, np.bool_(False), 1.0, "1", None):
        with pytest.raises(TypeError, match="get_value: rank must be an int"):
            access.check_rank(vs.rt, bad, "get_value")
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=r"range\(n_parallel=3\); got"):
            access.check_rank(vs.rt, bad, "get_value")


def test_value_list():
    assert access.value_list(7, 1, True, "broadcast") == [7]
    assert access.value_list((1, 2), 2, False, "broadcast") == [1, 2]
    with pytest.raises(ValueError, match=r"one value per shared variable \(2\); got 3"):
        access.value_list([1, 2, 3], 2, False, "broadcast")
    with pytest.raises(ValueError, match=r"\(2\); got ndarray"):
        access.value_list(np.zeros(2), 2, False, "broadcast")


def test_condition_casts_only_without_loss(vs):
    got = access.condition_value(vs.rt, vs.a, np.array([1, 2, 3], dtype=np.int32), "broadcast")
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match="needs dtype float32; got float64"):
        access.condition_value(vs.rt, vs.b2, np.zeros(4), "broadcast")
    with pytest.raises(TypeError, match="needs ndim 1"):
        access.condition_value(vs.rt, vs.a, np.zeros((3, 1)), "broadcast")


def test_a_fixed_length_is_checked_for_whole_values_only():
    w = pytensor.shared(np.zeros((2, 3)), shape=(2, None), name="w")
    rt = _runtime([w])
    got = access.condition_value(rt, w, np.ones((2, 5)), "set_value")
    np.testing.assert_array_equal(got, np.ones((2, 5)))
    with pytest.raises(ValueError, match="fixed length 2 on axis 0; got shape \\(3, 3\\)"):
        access.condition_value(rt, w, np.ones((3, 3)), "set_value")
    # Rows of a value (scatter): the caller checks the rows it takes.
    assert access.condition_value(rt, w, np.ones((3, 3)), "scatter", whole=False).shape == (3, 3)


def test_select_resolves_and_checks_the_rows():
    v = pytensor.shared(np.zeros((10, 2)), name="v")
    assert access.select(RowRange("range", 2, None), 10, v, "gather") == ("range", 2, 10)
    assert access.select(None, 10, v, "gather") is None
    sel = RowIndex("index", np.array([9, 0, 3]))
    assert access.select(sel, 10, v, "gather") is sel
    with pytest.raises(ValueError, match="batch selects row 11 but the value for v has 10 rows"):
        access.select(RowRange("range", 0, 12), 10, v, "gather")
    with pytest.raises(ValueError, match="selects row 10"):
        access.select(RowIndex("index", np.array([1, 10])), 10, v, "gather")


# ---- writing values ------------------------------------------------------------------------

def test_writable_out_only_for_plain_host_storage(vs):
    rt, a = vs.rt, vs.a
    arr = access.raw(a)
    assert access.writable_out(rt, a) is arr
    assert access.writable_out(rt, a, np.float64) is arr
    assert access.writable_out(rt, a, np.float32) is None          # another dtype
    a.set_value(np.zeros((3, 2))[:, 0], borrow=True)                   # not contiguous
    assert access.writable_out(rt, a) is None
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    a.set_value(frozen, borrow=True)
    assert access.writable_out(rt, a) is None
    a.set_value(np.zeros(3))
    rt.registry.device_shareds.add(id(a))                                       # values on the device
    assert access.on_device(rt, a) and access.writable_out(rt, a) is None


def test_store_copies_into_the_variable_and_never_aliases_the_result(vs):
    rt, a = vs.rt, vs.a
    before = access.raw(a)
    result = np.array([1.0, 2.0, 3.0])
    access.store(rt, a, result)
    assert access.raw(a) is before                  # same shape and dtype: in place
    result[:] = -1                                      # the backend reuses its buffer
    np.testing.assert_array_equal(a.get_value(), [1.0, 2.0, 3.0])
    bigger = np.arange(5.0)
    access.store(rt, a, bigger)                     # another shape: a new array
    bigger[:] = -1
    np.testing.assert_array_equal(a.get_value(), np.arange(5.0))
    own = access.raw(a)
    access.store(rt, a, own[::-1])                  # overlaps the variable's own storage
    np.testing.assert_array_equal(a.get_value(), np.arange(5.0)[::-1])
    ints = np.array([7, 8], dtype=np.int64)
    access.store(rt, a, ints)                       # stored in the variable's dtype
    assert a.get_value().dtype == np.float64
    np.testing.assert_array_equal(a.get_value(), [7.0, 8.0])


def test_store_of_the_output_buffer_itself_is_already_done(vs):
    rt, a = vs.rt, vs.a
    out = access.writable_out(rt, a)
    out[:] = [4.0, 5.0, 6.0]                             # the backend wrote the result here
    access.store(rt, a, out, out)
    assert access.raw(a) is out
    np.testing.assert_array_equal(a.get_value(), [4.0, 5.0, 6.0])


def test_adopt_takes_a_backend_array_but_copies_the_users(vs):
    rt, a = vs.rt, vs.a
    handed = np.array([1.0, 1.0, 1.0])
    access.adopt(rt, a, handed)
    assert access.raw(a) is handed                  # no copy
    user = np.array([2.0, 2.0, 2.0])
    access.adopt(rt, a, user, user=user)
    assert access.raw(a) is not user
    user[:] = 0
    np.testing.assert_array_equal(a.get_value(), [2.0, 2.0, 2.0])
    same = access.raw(a)
    access.adopt(rt, a, same)
    assert access.raw(a) is same


def test_keep_adopts_on_the_host_and_leaves_device_values(vs):
    rt, a = vs.rt, vs.a
    buf = np.array([3.0, 3.0, 3.0])
    access.keep(rt, a, buf)
    assert access.raw(a) is buf
    rt.registry.device_shareds.add(id(a))
    access.keep(rt, a, np.zeros(3))                # a device variable keeps its own value
    assert access.raw(a) is buf


def test_small_helpers(vs):
    arr = access.raw(vs.a)
    assert access.get_array(vs.a) is arr           # a host value: no copy
    assert not access.on_device(vs.rt, vs.a)
    assert type(access.like(vs.rt, vs.a, [1.0, 2.0])) is np.ndarray
    assert access.ret([5], True) == 5
    assert access.ret([5, 6], False) == (5, 6)
    assert access.descs([np.zeros(2), 3.0]) == [None, None]   # arrays travel as values
