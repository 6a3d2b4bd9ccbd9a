"""function() and distribute(): call order, build-time argument checks, shared variables."""

import os

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

import synkhronos as synk
from synkhronos.runtime.state import get_runtime

pytestmark = pytest.mark.timeout(90)


def test_function_and_distribute_need_fork():
    x = pt.dmatrix("x")
    with pytest.raises(synk.SynkStateError, match="fork"):
        synk.function([x], x.sum())
    with pytest.raises(RuntimeError, match="fork"):
        synk.distribute()


def test_call_order(forked, rng):
    forked(2)
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"))
    data = rng.standard_normal((5, 2))
    d = synk.data(data)
    with pytest.raises(synk.SynkStateError, match="distribute"):
        f(d)
    with pytest.raises(RuntimeError):
        f(d)
    synk.distribute()
    np.testing.assert_allclose(f(d), data.sum(axis=0), rtol=1e-12)
    with pytest.raises(synk.SynkStateError, match="distribute"):
        synk.function([x], x.sum())
    with pytest.raises(synk.SynkStateError, match="distribute"):
        synk.distribute()
    np.testing.assert_allclose(f(d), data.sum(axis=0), rtol=1e-12)
    synk.close()
    with pytest.raises(synk.SynkStateError, match="fork"):
        f(data)
    # A function of a closed run stays unusable after a new fork: build it again.
    forked(2)
    with pytest.raises(synk.SynkStateError):
        f(data)
    # and Data of the closed run is refused by the new run's functions
    g = synk.function([x], (x.sum(axis=0), "sum"))
    synk.distribute()
    with pytest.raises(ValueError, match="closed run"):
        g(d)
    np.testing.assert_allclose(g(data), data.sum(axis=0), rtol=1e-12)


def test_build_time_argument_checks(forked):
    forked(2)
    x, y = pt.dmatrix("x"), pt.dvector("y")
    s = pytensor.shared(np.zeros(2), name="s")
    t = pytensor.shared(np.zeros((3, 2)), name="t")
    bad = [
        (ValueError, "op", dict(inputs=[x], outputs=(x.sum(), "mean"))),
        (ValueError, "op", dict(inputs=[x], outputs=[x.sum(), (x.max(), "maximum")])),
        (ValueError, "op", dict(inputs=[x], updates=[(s, s + 1, "gather")])),
        (ValueError, "op", dict(inputs=[x], updates=[(s, s + 1, None)])),
        (ValueError, "sliceable_shareds", dict(inputs=[x], outputs=x.sum(),
                                               sliceable_shareds=[t])),
        (TypeError, "sliceable_shareds", dict(inputs=[x], outputs=x.sum(),
                                              sliceable_shareds=[y])),
        (TypeError, "inputs", dict(inputs="x", outputs=x.sum())),
        (TypeError, "inputs", dict(inputs=[np.zeros(2)], outputs=x.sum())),
        (TypeError, "shared", dict(inputs=[s], outputs=s.sum())),
        (TypeError, "bcast_inputs", dict(inputs=[x], bcast_inputs=5, outputs=x.sum())),
        (ValueError, "twice", dict(inputs=[x], bcast_inputs=[x], outputs=x.sum())),
        (TypeError, "output", dict(inputs=[x], outputs=[(x.sum(), "sum", 1)])),
        (TypeError, "outputs", dict(inputs=[x], outputs=3)),
        (TypeError, "update", dict(inputs=[x], updates=[(s,)])),
        (TypeError, "update", dict(inputs=[x], updates=[(x, x + 1)])),
        (TypeError, "updates", dict(inputs=[x], updates=5)),
    ]
    for exc, words, kwargs in bad:
        with pytest.raises(exc, match=words):
            synk.function(**kwargs)
    assert get_runtime().registry.functions == []             # nothing half-built was kept
    # The runtime is fine: good functions build, distribute and run.
    f = synk.function([x], outputs=(x.sum(axis=0), "sum"), sliceable_shareds=None)
    g = synk.function([x], outputs=x.sum() + t.sum(), sliceable_shareds=[t])
    h = synk.function([x], updates={s: s + x.sum(axis=0)})     # a dict of updates
    synk.distribute()
    data = np.arange(8.0).reshape(4, 2)
    np.testing.assert_allclose(f(data), data.sum(axis=0))
    rank_sums = [p.sum() for p in np.array_split(data, 2)]
    np.testing.assert_allclose(g(data), np.mean(rank_sums), rtol=1e-12)   # avg, equal rows
    assert h(data) == []
    np.testing.assert_allclose(s.get_value(), data[:2].sum(axis=0))


def test_kwargs_pass_through_to_pytensor(forked, rng):
    forked(2)
    x = pt.dmatrix("x")
    f = synk.function([x], (x.sum(axis=0), "sum"), mode="FAST_COMPILE", name="fc")
    synk.distribute()
    assert f.name == "fc"
    data = rng.standard_normal((5, 3))
    np.testing.assert_allclose(f(data), data.sum(axis=0), rtol=1e-12)


def test_givens(forked, rng):
    forked(3)
    x = pt.dmatrix("x")
    w = pt.dvector("w")
    c = pytensor.shared(np.array([1.0, 2.0, 3.0]), name="c")
    f = synk.function([x], outputs=((x * w).sum(axis=0), "sum"), givens={w: c * 2})
    synk.distribute()
    data = rng.standard_normal((7, 3))
    np.testing.assert_allclose(f(data), (data * np.array([2.0, 4.0, 6.0])).sum(axis=0),
                               rtol=1e-12)


@pytest.mark.parametrize("n", [2, 3])
def test_shared_variables_stay_shared_between_functions_in_every_rank(forked, rng, n):
    forked(n)
    x = pt.dmatrix("x")
    s = pytensor.shared(np.zeros(3), name="s")
    other = pytensor.shared(np.ones(3), name="other")
    f_add = synk.function([x], updates=[(s, s + x.sum(axis=0))])
    f_read = synk.function([], outputs=[(s, None), (other, None)])
    f_both = synk.function([x], outputs=((s * other).sum(), None),
                           updates=[(other, other + 1)], on_unused_input="ignore")
    synk.distribute()
    data = rng.standard_normal((8, 3))
    f_add(synk.data(data))
    f_add(synk.data(data))
    parts = np.array_split(data, n)
    s_rank, other_rank = f_read()
    for r in range(n):
        np.testing.assert_allclose(s_rank[r], 2 * parts[r].sum(axis=0), rtol=1e-12)
        np.testing.assert_array_equal(other_rank[r], np.ones(3))
    # f_both reads the s that f_add wrote, and updates other, which f_read sees.
    got = f_both(synk.data(data))
    for r in range(n):
        np.testing.assert_allclose(got[r], (2 * parts[r].sum(axis=0)).sum(), rtol=1e-12)
    _, other_rank = f_read()
    for r in range(n):
        np.testing.assert_array_equal(other_rank[r], np.full(3, 2.0))
    # the master's own variables are those of its rank
    np.testing.assert_allclose(s.get_value(), 2 * parts[0].sum(axis=0), rtol=1e-12)


def test_distribute_carries_shared_values_set_before_it(forked):
    forked(3)
    s = pytensor.shared(np.zeros(2), name="s")
    f = synk.function([], outputs=(s, None))
    s.set_value(np.array([4.0, 5.0]))
    synk.distribute()
    for v in f():
        np.testing.assert_array_equal(v, [4.0, 5.0])
    # set_value after distribute() changes the master only
    s.set_value(np.array([7.0, 8.0]))
    got = f()
    np.testing.assert_array_equal(got[0], [7.0, 8.0])
    for v in got[1:]:
        np.testing.assert_array_equal(v, [4.0, 5.0])


def test_distribute_with_no_functions_and_one_rank(forked, rng):
    forked(1)
    synk.distribute()
    forked_rt = get_runtime()
    assert forked_rt.registry.distributed
    d = synk.data(rng.standard_normal((3, 2)))     # data after distribute()
    assert d.shape == (3, 2)


def _uss_mib(pid):
    """Memory only process ``pid`` holds (USS), from /proc/<pid>/smaps_rollup."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = dict(line.split()[:2] for line in f if line.endswith("kB\n"))
    return (int(fields["Private_Clean:"]) + int(fields["Private_Dirty:"])) / 1024


@pytest.mark.parametrize("backend", ["shm", "zmq"])
def test_workers_start_again_from_the_master_on_one_machine(forked, rng, monkeypatch, backend):
    # shm: distribute() starts the workers again from the master, which holds the
    # compiled functions; zmq (per-process links) keeps its workers and pickles them.
    monkeypatch.setenv("SYNK_BACKEND", backend)
    forked(3)
    rt = get_runtime()
    before = {r: p for r, p in rt.processes.procs.items()}
    a, b = rng.standard_normal((10, 2)), rng.standard_normal((7, 2))
    d_a = synk.data(a)                      # Data made before distribute() ...
    d_b = synk.data(b[:3])
    d_b.set_length(7, oversize=2)           # ... grown (a new segment) ...
    d_b.data[:] = b
    dropped = synk.data(np.ones((4, 2)))    # ... and dropped (its id travels to the workers)
    del dropped
    x = pt.dmatrix("x")
    w = pytensor.shared(np.array([1.5, -2.0]), name="w")
    f = synk.function([x], [((x * w).sum(axis=0), "sum"), (x.max(), "max")],
                      updates=[(w, w * 2)])
    synk.distribute()
    after = rt.processes.procs
    if backend == "shm":
        assert all(not p.is_alive() for p in before.values())
        assert all(after[r].pid != p.pid for r, p in before.items())
    else:
        assert all(after[r] is p for r, p in before.items())
    for data, rows, kw in ((d_a, a, {}), (d_b, b, {}), (d_a, a[[9, 0, 4, 4]], {"batch": [9, 0, 4, 4]})):
        w_now = w.get_value()
        got = f(data, **kw)
        np.testing.assert_allclose(got[0], (rows * w_now).sum(axis=0), rtol=1e-12)
        assert got[1] == rows.max()
    assert [v.tolist() for v in synk.gather(w)] == [[12.0, -16.0]] * 3
    if backend == "shm":
        # Each worker shares the master's compiled code: what it holds alone is what its
        # own calls wrote (a pickled function compiled in every worker: 60-70 MiB here).
        assert max(_uss_mib(p.pid) for p in after.values()) < 32


def test_compiled_code_is_ready_before_the_workers_start(forked, rng):
    numba = pytest.importorskip("numba")  # noqa: F841 - the Numba linker's own dependency
    forked(2)
    x, i = pt.dmatrix("x"), pt.ivector("i")
    s = pytensor.shared(np.float32(0.5), name="s")
    f = synk.function([x], bcast_inputs=[i], outputs=[((x[:, 0] * s).sum() + i.sum(), "sum")],
                      mode="NUMBA")
    synk.distribute()
    jit = f.spec.fn.vm.jit_fn
    assert len(jit.signatures) == 1         # compiled in the master, before the fork
    data = rng.standard_normal((9, 2))
    for kw in ({}, {"batch": [1, 5, 2]}, {"batch": slice(2, 8)}):
        rows = data[kw["batch"]] if kw else data
        got = f(synk.data(data), np.arange(3, dtype="int32"), **kw)[0]
        np.testing.assert_allclose(got, (rows[:, 0] * 0.5).sum() + 2 * 3, rtol=1e-6)
    assert len(jit.signatures) == 1         # and the calls used those very types


def test_a_function_built_at_its_first_call(forked, rng):
    """build.function_at_first_call: nothing compiled before its first call, then as function()."""
    from synkhronos.functions.build import function_at_first_call
    from synkhronos.functions.deferred import Deferred

    forked(2)
    x = pt.dmatrix("x")
    s = pytensor.shared(np.float64(0.5), name="s_deferred")
    f = function_at_first_call([x], outputs=[((x * s).sum(), "sum")], name="later")
    g = synk.function([x], outputs=[((x - s).sum(), "sum")])   # shares s with f
    assert type(f.spec.fn) is Deferred and f.name == "later"
    assert f.spec.fn.get_shared() == [s]
    synk.distribute()
    assert type(f.spec.fn) is Deferred            # distribute() built nothing
    data = rng.standard_normal((9, 3))
    for _ in range(2):
        np.testing.assert_allclose(f(synk.data(data))[0], (data * 0.5).sum(), rtol=1e-12)
    assert type(f.spec.fn) is not Deferred
    synk.broadcast(s, np.float64(2.0))            # one variable in every rank, both functions
    np.testing.assert_allclose(f(synk.data(data))[0], (data * 2.0).sum(), rtol=1e-12)
    np.testing.assert_allclose(g(synk.data(data))[0], (data - 2.0).sum(), rtol=1e-12)
    # Updates cannot wait: such a graph is built at once, as function() builds it.
    synk.close()
    forked(1)
    u = pytensor.shared(np.float64(0.0), name="u")
    h = function_at_first_call([x], outputs=[(x.sum(), "sum")], updates=[(u, u + 1)])
    assert type(h.spec.fn) is not Deferred


_BUILT_AT = []


def _squares_noting_the_post(x):
    """The outputs of the next test's lazy function; in the master, notes the last command
    posted as the graph is made (picklable)."""
    rt = get_runtime()
    if rt.is_master:
        _BUILT_AT.append(rt.control.seq)
    return [(x ** 2).sum(axis=0)]


@pytest.mark.parametrize("over", [False, True], ids=["a-core-each", "more-ranks-than-cores"])
def test_where_each_rank_has_a_core_the_master_builds_with_the_ranks(forked, rng, over):
    """kept.builds_together: a function built at its first call is built by the master once
    that call is posted, while the ranks build theirs, where each rank has a core; with more
    ranks than cores, before posting it (the ranks then load the code it compiled)."""
    from synkhronos.functions.build import function_at_first_call
    from synkhronos.functions.deferred import Lazy

    n = len(os.sched_getaffinity(0)) + 1 if over else 2
    forked(n)
    x = pt.dmatrix("x")
    _BUILT_AT.clear()
    f = function_at_first_call([x], outputs=[(pt.dvector(), "sum")], name="together",
                               lazy=Lazy(_squares_noting_the_post, (x,), [x]))
    synk.distribute()
    data = rng.standard_normal((3 * n + 1, 2))
    d = synk.data(data)
    before = get_runtime().control.seq
    np.testing.assert_allclose(f(d)[0], (data ** 2).sum(0), rtol=1e-12)
    assert _BUILT_AT == [before if over else before + 1]
    np.testing.assert_allclose(f(synk.data(data[:5]))[0], (data[:5] ** 2).sum(0), rtol=1e-12)
    assert len(_BUILT_AT) == 1


def _squares_noted(x, where):
    """The outputs of the next test's lazy function: each process notes its build in the
    folder ``where`` (picklable)."""
    with open(os.path.join(where, f"built-{get_runtime().place.rank}"), "a") as f:
        f.write("built\n")
    return [(x ** 2).sum(axis=0)]


@pytest.mark.parametrize("over", [False, True], ids=["a-core-each", "more-ranks-than-cores"])
def test_the_workers_build_ahead_while_the_master_works(forked, rng, tmp_path, over):
    """aside.build_while: each worker builds a function built at its first call while the
    master runs its own part, which sees them build; aside.adopt: the master runs a function
    it compiled itself; the first call then builds nothing again.  The master's own error is
    raised as it was, and the run goes on.  With more ranks than cores the master's part runs
    alone (the ranks load the master's code at the first call instead)."""
    import time

    from synkhronos.functions import aside
    from synkhronos.functions.build import function_at_first_call
    from synkhronos.functions.deferred import Deferred, Lazy

    n = len(os.sched_getaffinity(0)) + 1 if over else 2
    forked(n)
    x = pt.dmatrix("x")
    f, g = (function_at_first_call([x], outputs=[(pt.dvector(), "sum")], name=name,
                                   lazy=Lazy(_squares_noted, (x, str(tmp_path / name)), [x]))
            for name in ("f", "g"))
    (tmp_path / "f").mkdir()
    (tmp_path / "g").mkdir()
    synk.distribute()
    worker = tmp_path / "f" / "built-1"

    def local():
        end = time.monotonic() + 60
        while not over and not worker.exists() and time.monotonic() < end:
            time.sleep(0.01)
        return worker.exists()

    seq = get_runtime().control.seq
    assert aside.build_while([f], local) is not over
    assert get_runtime().control.seq == seq + (not over)      # one command, or none
    mine = pytensor.function([x], _squares_noted(x, str(tmp_path / "f")))
    aside.adopt(f, mine)
    data = rng.standard_normal((2 * n + 1, 3))
    np.testing.assert_allclose(f(synk.data(data))[0], (data ** 2).sum(0), rtol=1e-12)
    assert f.spec.fn is mine and mine.name == "f"
    built = sorted(p.name for p in (tmp_path / "f").iterdir())
    assert built == [f"built-{r}" for r in range(n)]
    assert all((tmp_path / "f" / b).read_text() == "built\n" for b in built)   # once each

    with pytest.raises(KeyError, match="mine"):
        aside.build_while([g], lambda: {}["mine"])
    assert type(g.spec.fn) is Deferred
    np.testing.assert_allclose(g(synk.data(data))[0], (data ** 2).sum(0), rtol=1e-12)
    assert all((tmp_path / "g" / b).read_text() == "built\n" for b in built)


def _cubes(x, s):
    """The outputs of test_outputs_made_at_the_first_call's lazy function (picklable)."""
    return [((x ** 3) * s).sum(axis=0)]


def test_outputs_made_at_the_first_call(forked, rng):
    """Lazy outputs: the graph itself is made at the first call, in each rank, from what it
    was given; its shared variables are the ranks' own (a broadcast reaches them)."""
    from synkhronos.functions.build import function_at_first_call
    from synkhronos.functions.deferred import Lazy

    forked(3)
    x = pt.dmatrix("x")
    s = pytensor.shared(np.float64(0.5), name="s_lazy")
    made = []

    def make(*args):
        made.append(args)
        return _cubes(*args)

    f = function_at_first_call([x], outputs=[(pt.dvector(), "sum")], name="lazy",
                               lazy=Lazy(make, (x, s), [s * 1]))
    assert f.spec.fn.get_shared() == [s] and not made
    with pytest.raises(ValueError, match="lazy outputs take no updates"):
        function_at_first_call([x], outputs=[(pt.dvector(), "sum")], updates=[(s, s + 1)],
                               lazy=Lazy(make, (x, s), [s]))
    synk.distribute()
    assert not made                                # distribute() made no graph
    data = rng.standard_normal((10, 2))            # 10 rows: 4, 3, 3 over the ranks
    np.testing.assert_allclose(f(synk.data(data))[0], (data ** 3 * 0.5).sum(0), rtol=1e-12)
    assert len(made) == 1                          # the master's, once
    synk.broadcast(s, np.float64(2.0))
    np.testing.assert_allclose(f(synk.data(data))[0], (data ** 3 * 2.0).sum(0), rtol=1e-12)
