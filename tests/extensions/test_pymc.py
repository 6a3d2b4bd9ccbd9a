"""PyMC models, data-parallel: logp, dlogp and posteriors equal PyMC's own on the whole data.

Expectations come from PyMC itself (``model.compile_logp()``,
``compile_dlogp()``, ``pm.find_MAP``, serial ``pm.sample``), never from
synkhronos.  Four models on synthetic data (tests/helpers/pymc_models.py:
radon multilevel, negative-binomial GLM, censored survival with pm.Censored,
pm.CustomDist and pm.Potential, Student-t with dims), on 2 ranks and on 2
simulated machines; tests/test_pymc_terms.py has the cases that used to be
silently wrong.  Skipped where PyMC is not installed.
"""

import os
import re
import threading
import time
import types

import numpy as np
import pytest

pm = pytest.importorskip("pymc", reason="PyMC is not installed (pip install -e '.[pymc]')")

import arviz as az  # noqa: E402
import pytensor  # noqa: E402

import synkhronos as synk  # noqa: E402
from helpers import pymc_models  # noqa: E402
from synkhronos.extensions import pymc as synk_pymc  # noqa: E402
from synkhronos.extensions.pymc import crossover  # noqa: E402
from synkhronos.extensions.pymc import decision as decision_mod  # noqa: E402
from synkhronos.extensions.pymc import draws  # noqa: E402
from synkhronos.extensions.pymc import internals  # noqa: E402

# PyMC graphs compile to C on PyTensor 2.x: a cold cache makes the first build slow.
pytestmark = pytest.mark.timeout(300)

N_ROWS = 301          # no rank count here divides it
DRAWS = 300


@pytest.fixture(autouse=True)
def _decisions_kept_aside(tmp_path, monkeypatch):
    """Each test's measured decisions are kept in a file of its own: none reads another
    run's (test_crossover_keeps_a_measured_decision tests the file); every mode is
    measured, however small the graph (test_a_small_graph_keeps_its_first_mode)."""
    from synkhronos.extensions.pymc import modes
    from synkhronos.functions.measures import MeasureFile
    monkeypatch.setattr(decision_mod, "KEPT", MeasureFile("decisions.json", str(tmp_path)))
    # These tests' graphs are small: every mode measured all the same (SMALL_S's own test).
    monkeypatch.setattr(modes, "SMALL_S", 0.0)


def _points(model, rng, k=2):
    """A few random points in the transformed space, away from the initial point."""
    start = model.initial_point()
    return [{name: np.asarray(v + rng.normal(scale=0.5, size=np.shape(v)), dtype=v.dtype)
             for name, v in start.items()} for _ in range(k)]


def _assert_grad_close(g, ref):
    """A gradient equals PyMC's up to rounding at the scale of its largest entry.

    An entry that is a small sum of large terms of both signs (0.02 from terms
    near 100) differs from PyMC's by the rounding of those terms once the sum
    runs in another order: Numba (as PyTensor compiles it, with reassociation
    allowed) and every split over ranks do.
    """
    ref = np.asarray(ref)
    scale = max(1.0, float(np.max(np.abs(ref)))) if ref.size else 1.0
    np.testing.assert_allclose(g, ref, rtol=1e-9, atol=1e-9 * scale)


# -- misuse without a runtime -------------------------------------------------------------------
def test_needs_fork_first_and_says_so():
    model = pymc_models.negbin(20)
    with pytest.raises(synk.SynkStateError, match=r"data_parallel\(\) needs synk.fork\(\)"):
        synk_pymc.data_parallel(model)


# -- the four models on 2 ranks -----------------------------------------------------------------
@pytest.fixture(scope="module")
def env(runtime_keeper):
    """Fork 2 ranks, build every model's data-parallel functions, distribute once."""
    with pytensor.config.change_flags(floatX="float64"):
        e = types.SimpleNamespace()
        e.models = {k: f(N_ROWS) for k, f in pymc_models.MODELS.items()}
        # The radon model again, its graphs compiled in the mode that is not the default.
        e.other_mode = "CVM" if synk_pymc.model.DEFAULT_MODE == "NUMBA" else "NUMBA"

        def build():
            # split=True: the sampling tests here sample data-parallel, whatever the
            # measured crossover says of these small models (test_crossover_* test that).
            e.dps = {k: synk_pymc.data_parallel(m, split=True) for k, m in e.models.items()}
            e.other = synk_pymc.data_parallel(e.models["radon"], mode=e.other_mode,
                                              name="pymc_other_mode", split=True)
            e.auto = synk_pymc.data_parallel(e.models["negbin"], name="pymc_auto")

        with runtime_keeper.distributed(2, build):
            yield e


@pytest.mark.parametrize("name", list(pymc_models.MODELS))
def test_logp_and_dlogp_equal_pymc(env, name):
    model, dp = env.models[name], env.dps[name]
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    points = _points(model, np.random.default_rng(11), k=3)
    for point in points:
        np.testing.assert_allclose(dp.logp(point), logp(point), rtol=1e-10)
        _assert_grad_close(dp.dlogp(point), dlogp(point))
    # Several positions in one call: each row is PyMC's value at that position.
    logps, grads = dp.logp_dlogp_many(np.stack([dp.ravel(p) for p in points]))
    for point, lp, g in zip(points, logps, grads):
        np.testing.assert_allclose(lp, logp(point), rtol=1e-10)
        _assert_grad_close(g, dlogp(point))


def test_the_other_mode_equals_pymc(env):
    model, dp = env.models["radon"], env.other
    assert dp.mode == env.other_mode
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    points = _points(model, np.random.default_rng(12), k=3)
    for point in points:
        lp, g = dp.logp_dlogp(point)
        np.testing.assert_allclose(lp, logp(point), rtol=1e-10)
        _assert_grad_close(g, dlogp(point))
    logps, grads = dp.logp_dlogp_many(np.stack([dp.ravel(p) for p in points]))
    for point, lp, g in zip(points, logps, grads):
        np.testing.assert_allclose(lp, logp(point), rtol=1e-10)
        _assert_grad_close(g, dlogp(point))


def test_the_faster_mode_is_measured_and_only_it_is_built(env, caplog):
    """mode=None: the first evaluation times the rank's graph in each mode on a rank's rows and
    keeps the faster; the other mode's functions are never built, here or on the ranks."""
    import logging

    model, dp = env.models["survival"], env.dps["survival"]
    with caplog.at_level(logging.INFO, logger="synkhronos"):
        lp, g = dp.logp_dlogp(dp.initial_x())
    assert dp.mode in synk_pymc.model.MODES, dp.mode
    np.testing.assert_allclose(lp, model.compile_logp()(model.initial_point()), rtol=1e-10)
    for mode, fns in dp._calls.ways.items():
        built = [type(f.spec.fn).__name__ != "Deferred" for f in fns]
        # The kept mode's graphs at many positions are built if another test called them.
        assert built[0] if mode == dp.mode else not any(built), (mode, built)
    if caplog.records:   # said once, where this test made the first evaluation
        said = [r.getMessage() for r in caplog.records if "graph runs in" in r.getMessage()]
        assert said == [] or dp.mode in said[0], said


def test_fastest_mode_keeps_the_faster():
    """Of two modes, the one whose graph runs faster on a rank's share of the rows is kept:
    here C code against PyTensor's Python linker over 60 elementwise steps."""
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    from synkhronos.extensions.pymc import modes

    X, p = pt.matrix("X", dtype="float64"), pt.vector("p", dtype="float64")
    out = X * p
    for i in range(60):
        out = pt.tanh(out + i) * p
    out = out.sum(axis=0)
    rows = np.random.default_rng(0).normal(size=(400, 3))
    best, seconds = modes.fastest([X], p, out, [rows], np.ones(3), 2,
                                  {"PY": Mode(linker="py", optimizer=None), "CVM": "CVM"})
    assert best == "CVM" and seconds["CVM"] < seconds["PY"], seconds
    # Within the timing's spread the first mode stays (modes.CLEAR_WIN).
    assert modes.kept({"NUMBA": 10e-6, "CVM": 9.5e-6}) == "NUMBA"
    assert modes.kept({"NUMBA": 10e-6, "CVM": 8e-6}) == "CVM"
    assert modes.kept({"NUMBA": 8e-6, "CVM": 10e-6}) == "NUMBA"


class _RefusingLinker(pytensor.link.basic.PerformLinker):
    """A backend lacking an op of the graph (as PyTensor's JAX backend lacks some)."""

    def make_all(self, *args, **kwargs):
        raise NotImplementedError("no implementation of this op here")


@pytest.mark.parametrize("aside", [False, True], ids=["master", "child"])
def test_a_mode_that_does_not_compile_is_left_out(tmp_path, monkeypatch, aside):
    """A mode whose graph does not compile is no candidate, measured by the master or by the
    child aside: the others decide, and it is not kept as a figure."""
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    from synkhronos.extensions.pymc import modes, trials
    from synkhronos.functions.measures import MeasureFile

    had = os.sched_getaffinity(0)
    cores = sorted(trials.unpinned_cores())
    if aside and len(cores) < 2:
        pytest.skip("needs two cores: one for the master, one for the child")
    monkeypatch.setattr(modes, "KEPT", MeasureFile("modes.json", str(tmp_path)))
    monkeypatch.setattr(trials, "unpinned_cores", lambda: set(cores) if aside else had)
    X, p = pt.matrix("X", dtype="float64"), pt.vector("p", dtype="float64")
    out = (pt.tanh(X * p) * p).sum(axis=0)
    rows = np.random.default_rng(0).normal(size=(400, 3))
    ways = {"CVM": "CVM", "BROKEN": Mode(linker=_RefusingLinker(), optimizer=None),
            "PY": Mode(linker="py", optimizer=None)}
    if aside:
        os.sched_setaffinity(0, cores[:1])          # as fork() pins the master
    try:
        best, seconds = modes.fastest([X], p, out, [rows], np.ones(3), 2, ways)
    finally:
        os.sched_setaffinity(0, had)
    assert set(seconds) == {"CVM", "PY"} and best in seconds, seconds
    assert modes.fastest([X], p, out, [rows], np.ones(3), 2, ways) == (best, seconds)  # kept


def test_a_measured_mode_is_kept_for_the_next_run(tmp_path, monkeypatch):
    """The same graph on as many rows is not measured again (nothing compiled, the figures
    of the first run); other rows, or another graph, are."""
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    from synkhronos.extensions.pymc import modes, trials
    from synkhronos.functions.measures import MeasureFile

    monkeypatch.setattr(modes, "KEPT", MeasureFile("modes.json", str(tmp_path)))
    # No core for a child measuring aside (the next test's): the master measures every mode.
    monkeypatch.setattr(trials, "unpinned_cores", lambda: os.sched_getaffinity(0))
    X, p = pt.matrix("X", dtype="float64"), pt.vector("p", dtype="float64")
    out = (pt.tanh(X * p) * p).sum(axis=0)
    rows = np.random.default_rng(0).normal(size=(400, 3))
    ways = {"PY": Mode(linker="py", optimizer=None), "CVM": "CVM"}
    first = modes.fastest([X], p, out, [rows], np.ones(3), 2, ways)
    compiled = []
    real = trials.pytensor.function
    monkeypatch.setattr(trials.pytensor, "function",
                        lambda *a, **k: compiled.append(1) or real(*a, **k))
    assert modes.fastest([X], p, out, [rows], np.ones(3), 2, ways) == first
    assert compiled == []
    modes.fastest([X], p, out, [rows[:100]], np.ones(3), 2, ways)     # other rows a rank
    assert len(compiled) == 2
    modes.fastest([X], p, out * 2, [rows], np.ones(3), 2, ways)       # another graph
    assert len(compiled) == 4
    (tmp_path / "modes.json").write_text("not json")                  # spoilt: measured again
    assert modes.fastest([X], p, out, [rows], np.ones(3), 2, ways)[0] == first[0]
    assert len(compiled) == 6


@pytest.fixture
def aside_cores(tmp_path, monkeypatch):
    """(this process's cores, the cores it had before a fork() pinned it) for a child that
    measures modes aside: the measurements kept in ``tmp_path``; skipped without two cores."""
    from synkhronos.extensions.pymc import modes, trials
    from synkhronos.functions.measures import MeasureFile

    had = os.sched_getaffinity(0)
    cores = sorted(trials.unpinned_cores())
    if len(cores) < 2:
        pytest.skip("needs two cores: one for the master, one for the child")
    monkeypatch.setattr(modes, "KEPT", MeasureFile("modes.json", str(tmp_path)))
    monkeypatch.setattr(trials, "unpinned_cores", lambda: set(cores))
    return had, cores


def test_a_small_graph_keeps_its_first_mode(tmp_path, monkeypatch, aside_cores):
    """A rank graph whose first mode runs in less than modes.SMALL_S keeps it: no other mode
    is compiled (the child measuring aside is stopped, and reaped), the figure is kept for
    the next run; above it every mode is measured."""
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    from synkhronos.extensions.pymc import modes, trials

    had, cores = aside_cores
    compiled, master = [], os.getpid()
    real = trials.pytensor.function

    def counted(*a, **k):        # the master's compiles, slow enough that the child has begun
        if os.getpid() == master:
            compiled.append(k.get("mode"))
            time.sleep(0.5)
        return real(*a, **k)
    monkeypatch.setattr(trials.pytensor, "function", counted)
    children, real_aside = [], trials.measure_aside

    def noted(*a):               # the child measuring aside, its pid noted
        helper = real_aside(*a)
        if helper is not None:
            children.append(helper.pid)
        return helper
    monkeypatch.setattr(trials, "measure_aside", noted)
    X, p = pt.matrix("X", dtype="float64"), pt.vector("p", dtype="float64")
    out = (pt.tanh(X * p) * p).sum(axis=0)
    rows = np.random.default_rng(0).normal(size=(400, 3))
    ways = {"CVM": "CVM", "PY": Mode(linker="py", optimizer=None)}
    fn, args = real([X, p], out, mode="CVM"), [rows[:200], np.ones(3)]
    fn(*args)                                   # compiled before it is timed
    small = trials.trial(fn, args, 0.05)
    monkeypatch.setattr(modes, "SMALL_S", 10 * small + 1e-4)
    os.sched_setaffinity(0, cores[:1])          # as fork() pins the master
    try:
        best, seconds = modes.fastest([X], p, out, [rows], np.ones(3), 2, ways)
    finally:
        os.sched_setaffinity(0, had)
    assert (best, list(seconds), compiled) == ("CVM", ["CVM"], ["CVM"])
    assert 0 < seconds["CVM"] < modes.SMALL_S
    assert len(children) == 1
    with pytest.raises(ChildProcessError):      # the child was stopped and reaped
        os.waitpid(children[0], os.WNOHANG)
    assert modes.fastest([X], p, out, [rows], np.ones(3), 2, ways) == (best, seconds)  # kept
    assert len(compiled) == 1
    # Above it (another graph, so nothing kept answers): both measured.
    monkeypatch.setattr(modes, "SMALL_S", small / 10)
    best, seconds = modes.fastest([X], p, out * 2, [rows], np.ones(3), 2, ways)
    assert set(seconds) == {"CVM", "PY"} and best == "CVM", seconds


def test_a_short_run_measures_no_other_mode(tmp_path, monkeypatch, aside_cores):
    """Where the run's calls are known (dp.sample's), a first mode whose calls would take less
    than modes.SMALL_RUN_S over the run keeps that mode, the others not measured, and nothing
    is kept on disk: a run of unknown length then measures every mode."""
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    from synkhronos.extensions.pymc import modes, trials

    had, cores = aside_cores
    compiled, master = [], os.getpid()
    real = trials.pytensor.function

    def counted(*a, **k):
        if os.getpid() == master:
            compiled.append(k.get("mode"))
        return real(*a, **k)
    monkeypatch.setattr(trials.pytensor, "function", counted)
    X, p = pt.matrix("X", dtype="float64"), pt.vector("p", dtype="float64")
    out = (pt.tanh(X * p) * p).sum(axis=0)
    rows = np.random.default_rng(0).normal(size=(400, 3))
    ways = {"CVM": "CVM", "PY": Mode(linker="py", optimizer=None)}
    fn, args = real([X, p], out, mode="CVM"), [rows[:200], np.ones(3)]
    fn(*args)
    small = trials.trial(fn, args, 0.05)
    monkeypatch.setattr(modes, "SMALL_S", small / 10)     # a call's own bound never met
    calls = int(modes.SMALL_RUN_S / (20 * small))         # the run's: 1/20 of the bound
    os.sched_setaffinity(0, cores[:1])
    try:
        best, seconds = modes.begin([X], p, out, [rows], np.ones(3), 2, ways,
                                    calls=calls).finish()
        assert (best, list(seconds), compiled) == ("CVM", ["CVM"], ["CVM"])
        best, seconds = modes.begin([X], p, out, [rows], np.ones(3), 2, ways).finish()
    finally:
        os.sched_setaffinity(0, had)
    assert set(seconds) == {"CVM", "PY"} and best == "CVM", seconds


class _PythonOnly(pytensor.graph.op.Op):
    """An op with no Numba implementation: Numba runs it in object mode (Python)."""

    def make_node(self, x):
        return pytensor.graph.basic.Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = np.tanh(inputs[0])


def test_a_small_graph_in_object_mode_measures_every_mode(tmp_path, monkeypatch):
    """However fast it runs, a first mode in which Numba runs an op in object mode is not
    kept unmeasured: the other modes are compiled and timed (and PyTensor's warning still
    reaches the user)."""
    import pytensor.tensor as pt

    from synkhronos.extensions.pymc import modes, trials
    from synkhronos.functions.measures import MeasureFile

    monkeypatch.setattr(modes, "KEPT", MeasureFile("modes.json", str(tmp_path)))
    monkeypatch.setattr(trials, "unpinned_cores", lambda: os.sched_getaffinity(0))
    monkeypatch.setattr(modes, "SMALL_S", 1.0)     # any graph is small
    X, p = pt.matrix("X", dtype="float64"), pt.vector("p", dtype="float64")
    rows = np.random.default_rng(0).normal(size=(40, 3))
    ways = {"NUMBA": "NUMBA", "CVM": "CVM"}
    best, seconds = modes.fastest([X], p, (pt.tanh(X * p) * p).sum(axis=0), [rows],
                                  np.ones(3), 2, ways)
    assert list(seconds) == ["NUMBA"]               # compiled: kept without C
    with pytest.warns(UserWarning, match=modes.OBJECT_MODE):
        best, seconds = modes.fastest([X], p, (_PythonOnly()(X * p) * p).sum(axis=0), [rows],
                                      np.ones(3), 2, ways)
    assert set(seconds) == {"NUMBA", "CVM"}, seconds


def test_the_other_modes_are_measured_by_a_child_on_the_ranks_cores(tmp_path, monkeypatch, aside_cores):
    """Where the ranks hold cores the master does not, the master compiles only the first
    mode; a child compiles the others there, and times them once the master's compile is
    done (trials.measure_aside): its figures decide."""
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    from synkhronos.extensions.pymc import modes, trials

    had, cores = aside_cores
    compiled, master = [], os.getpid()
    real = trials.pytensor.function

    def counted(*a, **k):        # the master's compiles (a child's are its own), slow enough
        if os.getpid() == master:   # that the child has begun the other mode
            compiled.append(1)
            time.sleep(1)
        else:                       # the child yields the ranks' cores to a rank's build
            (tmp_path / "nice").write_text(str(os.getpriority(os.PRIO_PROCESS, 0)))
        return real(*a, **k)
    monkeypatch.setattr(trials.pytensor, "function", counted)
    X, p = pt.matrix("X", dtype="float64"), pt.vector("p", dtype="float64")
    out = X * p
    for i in range(60):          # C's fused loop against the Python linker's 120 steps
        out = pt.tanh(out + i) * p
    out = out.sum(axis=0)
    rows = np.random.default_rng(0).normal(size=(400, 3))
    ways = {"PY": Mode(linker="py", optimizer=None), "CVM": "CVM"}
    os.sched_setaffinity(0, cores[:1])          # as fork() pins the master
    try:
        best, seconds = modes.fastest([X], p, out, [rows], np.ones(3), 2, ways)
    finally:
        os.sched_setaffinity(0, had)
    assert len(compiled) == 1                   # the master's PY; the child's CVM is not seen here
    assert set(seconds) == {"PY", "CVM"} and all(s > 0 for s in seconds.values())
    assert best == "CVM" and seconds["CVM"] < seconds["PY"]   # the child's figure, used
    assert int((tmp_path / "nice").read_text()) == min(
        19, os.getpriority(os.PRIO_PROCESS, 0) + trials.CHILD_NICE)
    # No child (fork() failed): the master measures both, and leaves no pipe open.
    (tmp_path / "modes.json").unlink()

    def no_fork():
        raise OSError("no fork")
    monkeypatch.setattr(trials, "fork_quietly", no_fork)
    fds = len(os.listdir("/proc/self/fd"))
    os.sched_setaffinity(0, cores[:1])
    try:
        assert modes.fastest([X], p, out, [rows], np.ones(3), 2, ways)[0] == "CVM"
    finally:
        os.sched_setaffinity(0, had)
    assert len(compiled) == 3 and len(os.listdir("/proc/self/fd")) == fds


def test_a_trial_waits_for_each_output_not_each_element():
    """``trials.done`` makes a function's outputs NumPy arrays (JAX returns before it has
    computed them): each output of a list once, and a function's one output (the joined
    graph's vector of logp and gradient) once as a whole, never element by element (10^4
    elements cost a call ten times the imputed values' graph itself)."""
    import pytensor
    import pytensor.tensor as pt

    from synkhronos.extensions.pymc import trials

    class Output:
        def __init__(self):
            self.asked = 0

        def __array__(self, dtype=None, copy=None):
            self.asked += 1
            return np.zeros(3)

        def __iter__(self):
            raise AssertionError("an output walked element by element")

    one, many = Output(), [Output(), Output()]
    trials.done(one)
    trials.done(many)
    assert one.asked == 1 and [o.asked for o in many] == [1, 1]

    class Walked(np.ndarray):
        def __iter__(self):
            raise AssertionError("an output walked element by element")

    x = pt.dvector("x")
    fn = pytensor.function([x], pt.concatenate([x.sum()[None], 2 * x]), mode="FAST_COMPILE")
    assert trials.trial(lambda a: fn(a).view(Walked), [np.ones(10_000)], 0.0) > 0


def test_the_master_compiles_the_modes_the_child_has_not_begun(tmp_path, monkeypatch, aside_cores):
    """Once its own mode is compiled, the master takes the modes the child has not begun
    (trials.Claims), never JAX (started in the master it would hang the workers forked
    later): the child takes JAX first; every mode is timed all the same."""
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    from synkhronos.extensions.pymc import modes, trials

    claims = trials.Claims(["CVM", "JAX", "PY"])
    assert claims.take(claims.MASTER) == "CVM" and claims.take(claims.CHILD) == "JAX"
    assert claims.take(claims.MASTER) == "PY" and claims.take(claims.MASTER) is None
    claims = trials.Claims(["CVM", "JAX"])
    assert claims.take(claims.CHILD) == "JAX" and claims.take(claims.CHILD) == "CVM"
    assert claims.take(claims.MASTER) is None

    had, cores = aside_cores
    master, log = os.getpid(), tmp_path / "compiled.log"
    real = trials.compiled

    def logged(inputs, position, output, mode, args, optional=False):
        with open(log, "a") as f:
            f.write(f"{'master' if os.getpid() == master else 'child'} {names[id(mode)]}\n")
        # the child's compile long, so the master takes the next; the master's first slow
        # enough that the child has begun one
        time.sleep(2 if os.getpid() != master else 1)
        return real(inputs, position, output, mode, args, optional)
    monkeypatch.setattr(trials, "compiled", logged)
    X, p = pt.matrix("X", dtype="float64"), pt.vector("p", dtype="float64")
    out = (pt.tanh(X * p) * p).sum(axis=0)
    rows = np.random.default_rng(0).normal(size=(400, 3))
    ways = {"CVM": "CVM", "PY": Mode(linker="py", optimizer=None),
            "PY2": Mode(linker="py", optimizer=None)}
    names = {id(m): name for name, m in ways.items()}
    os.sched_setaffinity(0, cores[:1])
    try:
        best, seconds = modes.fastest([X], p, out, [rows], np.ones(3), 2, ways)
    finally:
        os.sched_setaffinity(0, had)
    who = sorted(log.read_text().split("\n")[:-1])
    assert who == ["child PY", "master CVM", "master PY2"], who
    assert set(seconds) == {"CVM", "PY", "PY2"} and best == "CVM", seconds


def _slow_master_compile(monkeypatch):
    """The master's compiles take a second more: the child has begun CVM before the master
    could take it (``trials.Claims``)."""
    from synkhronos.extensions.pymc import trials

    real_compiled, master = trials.compiled, os.getpid()

    def slow_master(*a, **k):
        if os.getpid() == master:
            time.sleep(1)
        return real_compiled(*a, **k)
    monkeypatch.setattr(trials, "compiled", slow_master)


def test_the_child_and_the_master_time_their_modes_in_turns(tmp_path, monkeypatch, aside_cores):
    """The child's modes and the master's are timed round after round, one at a time
    (trials.ROUNDS), each keeping its least; a child that stops answering is killed and the
    master measures its modes itself."""
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    from synkhronos.extensions.pymc import modes, trials
    from synkhronos.runtime.liveness import pid_alive

    had, cores = aside_cores
    log = tmp_path / "rounds.log"
    real_trial, master = trials.trial, os.getpid()
    _slow_master_compile(monkeypatch)

    def logged(fn, args, seconds):     # the child's and the master's, in one file
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {sorted(os.sched_getaffinity(0))} start\n")
        try:
            return real_trial(fn, args, seconds)
        finally:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {sorted(os.sched_getaffinity(0))} end\n")
    monkeypatch.setattr(trials, "trial", logged)
    X, p = pt.matrix("X", dtype="float64"), pt.vector("p", dtype="float64")
    out = (pt.tanh(X * p) * p).sum(axis=0)
    rows = np.random.default_rng(0).normal(size=(400, 3))
    ways = {"PY": Mode(linker="py", optimizer=None), "CVM": "CVM"}
    os.sched_setaffinity(0, cores[:1])
    try:
        best, seconds = modes.fastest([X], p, out, [rows], np.ones(3), 2, ways)
    finally:
        os.sched_setaffinity(0, had)
    lines = [line.split(" ", 1) for line in log.read_text().split("\n")[:-1]]
    assert len(lines) == 4 * trials.ROUNDS, lines
    # a trial's start and end in one process on one core, then the other's: never both at once
    assert all(lines[i][0] == lines[i + 1][0] and lines[i][1].rsplit(" ", 1)[0]
               == lines[i + 1][1].rsplit(" ", 1)[0] for i in range(0, len(lines), 2)), lines
    turns = [(pid, where.rsplit(" ", 1)[0]) for pid, where in lines[::2]]
    by_child = [w for pid, w in turns if pid != str(os.getpid())]
    by_master = [w for pid, w in turns if pid == str(os.getpid())]
    assert turns[0][0] != str(os.getpid())                            # the child first
    assert all(turns[i][0] != turns[i + 1][0] for i in range(len(turns) - 1)), turns
    # each on both cores, one after the other: a core's slow spell slows both modes' figures
    assert len(by_child) == len(by_master) == trials.ROUNDS
    assert by_master[0] == str(cores[:1]) and by_child[0] != by_master[0], turns
    assert by_child[::2] == by_master[1::2] and by_master[::2] == by_child[1::2], turns
    assert set(seconds) == {"PY", "CVM"} and best == "CVM", seconds

    # A child that stops answering after its first round: killed; the master times it all.
    (tmp_path / "modes.json").unlink()
    monkeypatch.setattr(trials, "HELPER_WAIT_S", 3.0)
    real_round = trials.time_round

    def stuck(fns, args, best, cores=None):
        if os.getpid() != master and best:
            time.sleep(60)
        real_round(fns, args, best, cores)
    monkeypatch.setattr(trials, "trial", real_trial)
    monkeypatch.setattr(trials, "time_round", stuck)
    children = []
    real_aside = trials.measure_aside
    monkeypatch.setattr(trials, "measure_aside",
                        lambda *a: children.append(real_aside(*a)) or children[-1])
    fds = len(os.listdir("/proc/self/fd"))
    os.sched_setaffinity(0, cores[:1])
    t0 = time.monotonic()
    try:
        best, seconds = modes.fastest([X], p, out, [rows], np.ones(3), 2, ways)
    finally:
        os.sched_setaffinity(0, had)
    assert time.monotonic() - t0 < 30
    assert set(seconds) == {"PY", "CVM"} and best == "CVM", seconds
    assert not pid_alive(children[0].pid) and len(os.listdir("/proc/self/fd")) == fds


def test_settled_climbs_to_the_mode_and_keeps_the_best_finite_position():
    """trials.settled moves a position uphill to where a sampler's draws go: a least-squares
    log-density reaches NumPy's solution; off the support it keeps the best finite position
    met; out of time, the start; a float32 start stays float32."""
    from synkhronos.extensions.pymc import trials

    rng = np.random.default_rng(3)
    A, b = rng.normal(size=(50, 4)), rng.normal(size=50)

    def quadratic(x):
        r = A @ x - b
        return -0.5 * r @ r, -A.T @ r
    x0 = np.zeros(4)
    x = trials.settled(quadratic, x0)
    np.testing.assert_allclose(x, np.linalg.lstsq(A, b, rcond=None)[0], atol=1e-5)
    assert (x0 == 0).all()                                   # the start is not changed
    seen = []

    def edge(x):    # a log-density defined below 2 only, climbing towards 3
        seen.append(float(x[0]))
        return (-(x[0] - 3.0) ** 2, np.array([-2 * (x[0] - 3.0)])) if x[0] < 2 else (np.nan, x)
    x = trials.settled(edge, np.array([0.0]))
    assert x[0] == max(v for v in seen if v < 2) and x[0] > 0 and max(seen) >= 2, seen
    assert trials.settled(quadratic, np.ones(4), seconds=0.0).tolist() == [1.0] * 4
    out = trials.settled(quadratic, np.zeros(4, dtype="float32"))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np.linalg.lstsq(A, b, rcond=None)[0], atol=1e-3)


def _positions_logged(monkeypatch, log):
    """``trials.trial`` writes, for each timing, its process and position to ``log``."""
    from synkhronos.extensions.pymc import trials

    real_trial = trials.trial

    def logged(fn, args, seconds):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {' '.join(map(repr, np.asarray(args[-1]).tolist()))}\n")
        return real_trial(fn, args, seconds)
    monkeypatch.setattr(trials, "trial", logged)


def _joined_normal():
    """``(X, p, [logp, *dlogp])`` of a normal's rows ``X`` at ``p``: ``graphs.joined``'s layout."""
    import pytensor.tensor as pt

    X, p = pt.matrix("X", dtype="float64"), pt.vector("p", dtype="float64")
    lp = -0.5 * ((X - p) ** 2).sum()
    return X, p, pt.concatenate([lp[None], pytensor.grad(lp, p)])


def test_the_modes_are_timed_near_the_mode(tmp_path, monkeypatch, aside_cores):
    """With settle, the modes are timed (by the master and by the child aside) at the
    rank's log-density's mode, not at the initial point given; without, where given."""
    from pytensor.compile.mode import Mode

    from synkhronos.extensions.pymc import modes

    had, cores = aside_cores
    log, master = tmp_path / "where.log", os.getpid()
    _slow_master_compile(monkeypatch)
    _positions_logged(monkeypatch, log)
    X, p, out = _joined_normal()
    rows = np.random.default_rng(0).normal(loc=[1.0, -2.0, 0.5], size=(400, 3))
    ways = {"PY": Mode(linker="py", optimizer=None), "CVM": "CVM"}
    for settle, expected in ((True, rows[:200].mean(axis=0)), (False, np.ones(3))):
        log.unlink(missing_ok=True)
        (tmp_path / "modes.json").unlink(missing_ok=True)   # one key either way: measured again
        os.sched_setaffinity(0, cores[:1])
        try:
            modes.fastest([X], p, out, [rows], np.ones(3), 2, ways, settle=settle)
        finally:
            os.sched_setaffinity(0, had)
        where = [line.split(" ") for line in log.read_text().split("\n")[:-1]]
        assert {pid for pid, *_ in where} - {str(master)}, where        # the child timed too
        for pid, *x in where:
            np.testing.assert_allclose(np.array(x, dtype=float), expected, atol=1e-5)
    # A run that reads a kept decision (no position given, so settle) reads the modes a
    # measuring run kept at the decision's position: nothing timed again.
    log.unlink()
    os.sched_setaffinity(0, cores[:1])
    try:
        modes.fastest([X], p, out, [rows], np.ones(3), 2, ways, settle=True)
    finally:
        os.sched_setaffinity(0, had)
    assert not log.exists()


def test_the_modes_begun_early_compile_aside_until_finished_or_cancelled(tmp_path, monkeypatch,
                                                                         aside_cores):
    """``modes.begin`` starts the child compiling the other modes on the ranks' cores at once
    (``crossover.decide`` begins it before compiling PyMC's function): while the master does
    something else the child compiles its mode, and ``finish`` times every mode at the
    position it is given; ``cancel`` stops the child, leaving no process or pipe behind."""
    from pytensor.compile.mode import Mode

    from synkhronos.extensions.pymc import modes, trials

    had, cores = aside_cores
    log, master = tmp_path / "where.log", os.getpid()
    _positions_logged(monkeypatch, log)
    X, p, out = _joined_normal()
    rows = np.random.default_rng(0).normal(size=(400, 3))
    ways = {"PY": Mode(linker="py", optimizer=None), "CVM": "CVM"}
    fds = len(os.listdir("/proc/self/fd"))
    at = np.array([0.5, -1.0, 2.0])
    os.sched_setaffinity(0, cores[:1])          # as fork() pins the master
    try:
        measuring = modes.begin([X], p, out, [rows], np.ones(3), 2, ways)
        child = measuring.helper.pid
        deadline = time.monotonic() + 60
        # The master busy with its own work (PyMC's function, in a decision): the child
        # has taken the other mode, so the master finds none left to compile.
        while measuring.helper.claims._taken[0] != trials.Claims.CHILD:
            assert time.monotonic() < deadline, "the child never took its mode"
            time.sleep(0.05)
        assert measuring.helper.claims.take(trials.Claims.MASTER) is None
        best, seconds = measuring.finish(at)
    finally:
        os.sched_setaffinity(0, had)
    assert set(seconds) == {"PY", "CVM"} and all(s > 0 for s in seconds.values())
    where = [line.split(" ") for line in log.read_text().split("\n")[:-1]]
    assert {pid for pid, *_ in where} == {str(master), str(child)}, where
    for _, *x in where:
        np.testing.assert_array_equal(np.array(x, dtype=float), at)
    assert not os.path.exists(f"/proc/{child}")          # ended and reaped
    assert len(os.listdir("/proc/self/fd")) == fds
    # Given up (nothing evaluated after all): the child is stopped, nothing left open.
    (tmp_path / "modes.json").unlink()
    os.sched_setaffinity(0, cores[:1])
    try:
        measuring = modes.begin([X], p, out, [rows], np.ones(3), 2, ways)
    finally:
        os.sched_setaffinity(0, had)
    child = measuring.helper.pid
    measuring.cancel()
    measuring.cancel()
    assert not os.path.exists(f"/proc/{child}")
    assert len(os.listdir("/proc/self/fd")) == fds
    assert not (tmp_path / "modes.json").exists()        # nothing measured, nothing kept


def test_mode_is_checked_before_anything_is_built(env):
    with pytest.raises(ValueError, match=r"mode must be one of NUMBA, CVM"):
        synk_pymc.data_parallel(env.models["negbin"], mode="FAST")


def test_split_is_checked_before_anything_is_built(env):
    with pytest.raises(ValueError, match=r"split must be True .*, False .* or None .*; got 'yes'"):
        synk_pymc.data_parallel(env.models["negbin"], split="yes")
    with pytest.raises(ValueError, match=r"cores must be a positive int or None; got 0"):
        env.dps["negbin"].sample(10, tune=10, chains=1, cores=0, progressbar=False)


def test_crossover_rule():
    """pm.sample's chains each have a core and compile first; dp.sample's share this process."""
    own = crossover.SAMPLER_S["pymc"]
    # 2 chains on 2 cores, 1000 steps: pm.sample takes one call's time a step, dp.sample
    # one call at both positions (here 60 us) and both chains' own work.
    serial, parallel = crossover.predict("pymc", 2, 2, 1000, 100e-6, 0.5, 60e-6)
    assert serial == pytest.approx(0.5 + 1000 * (100e-6 + own))
    assert parallel == pytest.approx(1000 * (2 * own + 60e-6))
    # 4 chains on 2 cores: two rounds a step for pm.sample.
    serial, _ = crossover.predict("pymc", 4, 2, 1000, 100e-6, 0.0, 60e-6)
    assert serial == pytest.approx(2000 * (100e-6 + own))
    # nutpie's own work is less, the data-parallel callback's more; pm.sample's nutpie
    # compiles the model again (Numba), dp.sample's does not.
    serial, parallel = crossover.predict("nutpie", 1, 1, 10, 1e-3, 0.0, 0.5e-3)
    assert serial == pytest.approx(crossover.SAMPLER_COMPILE_S["nutpie"]
                                   + 10 * (1e-3 + crossover.SAMPLER_S["nutpie"]))
    assert parallel == pytest.approx(10 * (0.5e-3 + crossover.DP_NUTPIE_S))
    assert crossover.check_split(None) is None and crossover.check_split(False) is False
    # nutpie's own gradient runs in Numba: where the rank's graph was timed in both modes,
    # its call is PyMC's C call times their ratio, and the decision says so.
    assert crossover.numba_ratio({"NUMBA": 2e-4, "CVM": 8e-4}) == pytest.approx(0.25)
    assert crossover.numba_ratio({"NUMBA": 2e-4}) is None and crossover.numba_ratio({}) is None
    line = crossover.Decision(True, "measured", "nutpie", 2, 2, 2, 800e-6, 0.5, 100e-6, None,
                              9.0, 2.0, True, numba_ratio=0.25,
                              sampler_compile_s=crossover.SAMPLER_COMPILE_S["nutpie"]).describe()
    assert "a call 800 us, in nutpie's Numba 200 us, compiling 5.0 s" in line, line
    # The callback way costs 2 x (100 + 20) us a gradient for 2 chains, nutpie's own
    # compile 5 s and then 104 us a gradient on 2 cores: over 1000 draws nutpie's own wins
    # from 5 / (1000 x 136e-6) = 36.8 gradients a draw on.
    turns = crossover.callback_turns(1000, 2, 2, 100e-6)
    assert turns == pytest.approx(crossover.SAMPLER_COMPILE_S["nutpie"] / (
        1000 * (2 * (100e-6 + crossover.CALLBACK_S) - (100e-6 + crossover.SAMPLER_S["nutpie"]))))
    # One chain: 16 us more a gradient the callback way, so nutpie's own wins from 312.5 on.
    assert crossover.callback_turns(1000, 1, 1, 100e-6) == pytest.approx(312.5)


def _children():
    """This process's child processes' pids (Linux)."""
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return {int(pid) for pid in f.read().split()}


def test_crossover_samples_a_small_model_as_pm_sample_does(env, caplog, monkeypatch, tmp_path):
    """301 rows on 2 ranks over a long run: the call's fixed cost outweighs the rows, so
    dp.sample runs pm.sample itself (its chains on the cores the master had before fork),
    says so in one warning, and returns pm.sample's very draws; split=True / False override
    it.  PyMC's (logp, dlogp), compiled to time it, is the one pm.sample runs: PyMC
    compiles no other.  (LEAPFROGS makes this run long.)"""
    import logging
    import os

    monkeypatch.setattr(draws, "LEAPFROGS", 10_000)
    # PyMC's own work a step as a slow machine's (1 ms): whatever this machine times PyMC's
    # call at (a loaded one, over 88 us, would make 60 us of it worth a split at best).
    monkeypatch.setitem(crossover.SAMPLER_S, "pymc", 1e-3)

    model, dp = env.models["negbin"], env.auto
    compiled = []
    own = type(model).logp_dlogp_function

    def counted(self, *args, **kwargs):
        compiled.append(args)
        return own(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "logp_dlogp_function", counted)
    pinned = os.sched_getaffinity(0)
    kw = dict(tune=30, chains=2, random_seed=7, progressbar=False, nuts_sampler="pymc",
              compute_convergence_checks=False)
    workers = _children()
    with caplog.at_level(logging.WARNING, logger="synkhronos"):
        idata = dp.sample(30, **kw)
    assert dp.decision.split is False and dp.decision.reason == "measured", dp.decision
    assert dp.decision.parallel_run_s * crossover.GAIN >= dp.decision.serial_run_s
    # 2 chains of PyMC's own work a step against one and its call: not even a split at
    # its best would gain, so nothing was built for the ranks.
    assert dp.decision.predicted is True and dp.decision.callback is False, dp.decision
    assert len(compiled) == 1, compiled
    # Timed nearer the mode than the initial point, where the sampler's draws go.
    point = dp.unravel(dp.typical_x)
    assert model.compile_logp()(point) > model.compile_logp()(model.initial_point()) + 1.0
    said = [r.getMessage() for r in caplog.records if "would not gain" in r.getMessage()]
    assert len(said) == 1 and "split=True" in said[0], caplog.records
    assert dp.batcher.calls == 0
    assert os.sched_getaffinity(0) == pinned
    # The modes' child, begun with the decision, was stopped with nothing built.
    assert dp._measuring is None and not dp.built
    assert _children() == workers
    monkeypatch.setattr(type(model), "logp_dlogp_function", own)
    with model:
        ref = pm.sample(30, cores=1, **kw)
    for name in ("alpha", "b"):
        np.testing.assert_array_equal(idata.posterior[name].values, ref.posterior[name].values)
    try:
        dp.split = True
        dp.sample(10, **{**kw, "chains": 1})   # one chain: the graph distribute() compiled
        assert dp.decision.reason == "asked" and dp.batcher.calls > 0
        # A short run: a call per chain, no many-position graph compiled for it.  With
        # no sampler work of its own a split could gain at best: the decision times a call.
        dp.split = None
        monkeypatch.setattr(draws, "LEAPFROGS", 10)
        monkeypatch.setitem(crossover.SAMPLER_S, "pymc", 0.0)
        # The measured decision above may have timed the many-position graphs (on a slow
        # or cold machine): what this run does to them is compared with what it found.
        kept = dict(dp._calls._ways)
        dp.sample(10, **{**kw, "tune": 10})
        assert dp.decision.separate is True, dp.decision
        # Neither many-position graph ran in this run: no trial of them, nothing new kept.
        assert not dp._calls._trials and dp._calls._ways == kept
        # Their compile is taken as MANY_BUILDS first calls where that is more than the
        # fixed floor: with no floor, a first call of 1000 s still keeps the chains apart.
        monkeypatch.setattr(crossover, "MANY_COMPILE_S", 0.0)
        monkeypatch.setattr(dp._calls, "first_s", 1e3)
        dp.decisions.clear()
        monkeypatch.setattr(decision_mod.KEPT, "directory", str(tmp_path / "again"))  # none kept
        dp.sample(10, **{**kw, "tune": 10})
        assert dp.decision.kept is False, dp.decision
        assert dp.decision.separate is True, dp.decision
        assert not dp._calls._trials and dp._calls._ways == kept
        dp.split = False   # the branch the measured decision took, without measuring
        assert crossover.decide(dp, "pymc", 2, None, 30, 30) == crossover.Decision(
            False, "asked", "pymc", 2, crossover.sampling_cores(2, None), 2)
    finally:
        dp.split = None


@pytest.mark.parametrize("many_us", [3000.0, 1500.0])
def test_crossover_takes_a_call_per_chain_where_it_times_cheaper(env, monkeypatch, many_us):
    """Where the call at every chain's position was timed dearer than a call per chain (the
    gallery's logistic regression at 10^5 rows: 3.1 ms at 2 positions, 1.2 ms at one), the
    chains take a call each and the prediction counts that; else the one call."""
    dp = env.auto
    timed = iter([10e-3, 1e-3, many_us * 1e-6])   # PyMC's serial call, one position, two

    def fake_timed(call, seconds=crossover.TRIAL_S):
        call()
        return next(timed)
    monkeypatch.setattr(crossover, "_timed", fake_timed)
    monkeypatch.setattr(draws, "LEAPFROGS", 10)
    monkeypatch.setattr(crossover, "MANY_COMPILE_S", 0.0)
    monkeypatch.setattr(dp._calls, "first_s", 0.0)
    dp.decisions.clear()
    d = crossover.decide(dp, "pymc", 2, 2, 30, 30)
    steps, own = 60 * draws.LEAPFROGS, crossover.SAMPLER_S["pymc"]
    assert d.parallel_many_s == pytest.approx(many_us * 1e-6), d
    assert d.separate is (many_us > 2000.0), d
    assert d.parallel_run_s == pytest.approx(steps * (2 * own + min(many_us * 1e-6, 2e-3)))
    assert d.split is True, d
    dp.decisions.clear()


def test_a_draw_takes_more_gradients_where_a_position_has_many_numbers():
    """The prediction's gradients a draw: ``LEAPFROGS`` up to ``LEAPFROG_SIZE`` numbers a
    position, then growing as the size to the 1/4 (NUTS's step shrinks so): for the missing
    values' 9965 numbers within 10% of the 31 a draw nutpie took (bench/HISTORY.md)."""

    assert draws.draw_steps(1) == draws.draw_steps(draws.LEAPFROG_SIZE) \
        == draws.LEAPFROGS
    assert abs(draws.draw_steps(9965) - 31) < 3.1
    sizes = [10, 200, 10_000, 10**6]
    assert [draws.draw_steps(n) for n in sizes] == sorted(draws.draw_steps(n) for n in sizes)


def test_crossover_splits_only_where_a_step_gains_too(env, monkeypatch):
    """A split slower a step than nutpie's own compiled gradient, predicted to gain over the
    run only by nutpie's compile (5 s at 10 gradients a draw), is not taken, and the
    decision's line says why; a split faster a step is."""
    dp = env.auto
    monkeypatch.setattr(draws, "LEAPFROGS", 10)
    monkeypatch.setattr(crossover, "MANY_COMPILE_S", 0.0)
    monkeypatch.setattr(crossover, "numba_ratio", lambda seconds: None)
    monkeypatch.setattr(crossover, "sampling_cores", lambda chains, cores: 2)
    monkeypatch.setattr(dp._calls, "first_s", 0.0)
    monkeypatch.setattr(decision_mod, "kept", lambda *args: None)   # measured each time
    monkeypatch.setattr(decision_mod, "keep", lambda *args: None)
    for many_s, split in ((1.0e-3, False), (0.6e-3, True)):
        timed = iter([1e-3, 0.5e-3, many_s])   # PyMC's serial call, one position, two

        def fake_timed(call, seconds=crossover.TRIAL_S):
            call()
            return next(timed)
        monkeypatch.setattr(crossover, "_timed", fake_timed)
        dp.decisions.clear()
        d = crossover.decide(dp, "nutpie", 2, 2, 500, 500)
        steps = 1000 * draws.LEAPFROGS
        step = 2 * crossover.DP_NUTPIE_S + many_s
        own = 1e-3 + crossover.SAMPLER_S["nutpie"]
        assert not d.callback and d.leapfrogs is None, d
        assert d.steps_s == pytest.approx((step, own)), d
        assert d.parallel_run_s == pytest.approx(steps * step), d
        assert d.serial_run_s == pytest.approx(crossover.SAMPLER_COMPILE_S["nutpie"] + steps * own)
        assert d.parallel_run_s * crossover.GAIN < d.serial_run_s   # the run alone would split
        assert d.split is split, d
        assert ("it gains only on a short run" in d.describe()) is not split, d.describe()
    dp.decisions.clear()


def test_crossover_keeps_a_measured_decision(env, monkeypatch):
    """The next run of the same model (a fresh set-up: nothing in memory) takes the decision
    its first run measured, timing and compiling nothing, and says so; another run's shape
    (chains, draws) or a damaged entry is measured afresh."""
    dp = env.auto
    dp.decisions.clear()
    first = crossover.decide(dp, "pymc", 2, 2, 30, 30)
    assert first.reason == "measured" and first.kept is False, first

    def no_timing(*args, **kwargs):
        raise AssertionError("measured again")
    monkeypatch.setattr(crossover, "_measured", no_timing)
    dp.decisions.clear()
    again = crossover.decide(dp, "pymc", 2, 2, 30, 30)
    assert again == crossover.dataclasses.replace(first, kept=True)
    assert "as an earlier run measured it" in again.describe()
    dp.decisions.clear()
    with pytest.raises(AssertionError, match="measured again"):
        crossover.decide(dp, "pymc", 1, 2, 30, 30)   # one chain: not measured yet
    with pytest.raises(AssertionError, match="measured again"):
        crossover.decide(dp, "pymc", 2, 2, 31, 30)
    good = crossover.dataclasses.asdict(first)
    assert decision_mod.read(good, "pymc", 2, 2, 2) == again
    for bad in ({**good, "split": 1}, {**good, "reason": "asked"}, {**good, "serial_s": "x"},
                {**good, "parallel_run_s": float("nan")}, {**good, "extra": 1}, {**good,
                "chains": 3}, [1, 2], None):
        assert decision_mod.read(bad, "pymc", 2, 2, 2) is None, bad
    dp.decisions.clear()


@pytest.mark.parametrize("fitted", [True, False])
def test_crossover_keeps_chains_apart_where_a_call_is_mostly_rows(env, monkeypatch, fitted):
    """One call at both chains' positions saves at most a call's fixed cost a step: where
    the call's chunks were timed and that is small (censored at 10^5 rows: a call 5.2 ms,
    its 2-position graphs compiled for seconds, then not kept), the chains take a call
    each and nothing more is compiled, however long the run; where nothing says what of
    the call is fixed, its whole time is taken as what one call could save."""
    from synkhronos.functions.pace import Fit

    dp = env.auto
    timed = iter([10e-3, 1e-3, 3e-3])   # PyMC's serial call, one position, two

    def fake_timed(call, seconds=crossover.TRIAL_S):
        call()
        return next(timed)
    fit = Fit(2, 5e-6, 1e-8) if fitted else None
    monkeypatch.setattr(type(dp), "chunk_fit", property(lambda self: fit))
    monkeypatch.setattr(crossover, "_timed", fake_timed)
    monkeypatch.setattr(draws, "LEAPFROGS", 100)   # 6000 steps: 6 s of calls per chain
    monkeypatch.setattr(dp._calls, "first_s", 0.0)
    dp.decisions.clear()
    try:
        d = crossover.decide(dp, "pymc", 2, 2, 30, 30)
    finally:
        dp.decisions.clear()
    steps, own = 60 * 100, crossover.SAMPLER_S["pymc"]
    fixed = crossover.CALL_S + 5e-6 + 1e-6
    assert d.separate is True and d.split is True, d
    assert d.parallel_run_s == pytest.approx(steps * (2 * own + 2e-3)), d
    if fitted:
        # 6000 x 9 us could not pay MANY_COMPILE_S: the 2-position graphs were not timed.
        assert d.parallel_many_s is None and d.fixed_s == pytest.approx(fixed), d
        assert next(timed) == 3e-3
        assert f"({fixed * 1e6:.0f} us of it fixed)" in d.describe()
    else:
        assert d.parallel_many_s == pytest.approx(3e-3) and d.fixed_s is None, d
        assert "fixed" not in d.describe()


def test_crossover_gives_nutpie_the_compiled_function(env, caplog, monkeypatch):
    """Where nutpie would compile the model again for longer than the run (a short run of a
    small model), dp.sample hands nutpie PyMC's compiled (logp, dlogp) instead, calls
    nothing data-parallel, compiles nothing of nutpie's, and samples pm.sample's posterior."""
    pytest.importorskip("nutpie")
    import logging

    import nutpie

    model, dp = env.models["negbin"], env.auto

    def refused(*args, **kwargs):
        raise AssertionError("nutpie compiled the model")

    kw = dict(tune=DRAWS, chains=2, random_seed=3, progressbar=False,
              compute_convergence_checks=False)
    # A split's gradient under nutpie dearer than it is: the way chosen here is the
    # callback's, whatever this machine's timings (test_crossover_rule tests the figures).
    monkeypatch.setattr(crossover, "DP_NUTPIE_S", 1e-3)
    monkeypatch.setattr(nutpie, "compile_pymc_model", refused)
    with caplog.at_level(logging.WARNING, logger="synkhronos"):
        idata = dp.sample(DRAWS, nuts_sampler="nutpie", **kw)
    monkeypatch.undo()
    assert dp.decision.split is False and dp.decision.callback is True, dp.decision
    said = [r.getMessage() for r in caplog.records if "would not gain" in r.getMessage()]
    assert len(said) == 1 and "nutpie on PyMC's compiled" in said[0], said
    assert dp.batcher.calls == 0
    assert idata.posterior.sizes["chain"] == 2 and idata.posterior.sizes["draw"] == DRAWS
    with model:
        ref = pm.sample(DRAWS, cores=1, nuts_sampler="nutpie", **{**kw, "random_seed": 4})
    assert set(idata.posterior.data_vars) == set(ref.posterior.data_vars)
    z = pymc_models.z_scores(idata, ref, [v.name for v in model.free_RVs])
    assert all(zm < 4.5 and zs < 4.5 for _, zm, zs in z), z


def test_nutpie_times_pymc_function_compiled_as_nutpie_compiles_it(env):
    """nutpie compiles the model in Numba, whatever PyTensor's default: the PyMC function a
    nutpie decision times (and the callback way runs) is compiled in Numba, the one PyMC's
    NUTS takes in PyTensor's default, and both give PyMC's logp and gradient."""
    from synkhronos import compat

    model, dp = env.models["negbin"], env.auto
    nut, own = crossover.serial_function(dp, "nutpie"), crossover.serial_function(dp, "pymc")

    def linker(serial):
        return type(internals.serial_call(serial.fn).maker.linker).__name__

    assert linker(nut) == "NumbaLinker"
    assert own.mode is None and (linker(own) == "NumbaLinker") == (compat.default_linker() == "numba")
    assert (nut is own) == (compat.default_linker() == "numba")
    # Whether a function needs the rank graph's Numba / C ratio to stand for nutpie's own:
    # only where it was not compiled with Numba (PyTensor 3's default is Numba).
    assert crossover.in_numba(nut)
    assert crossover.in_numba(own) == (compat.default_linker() == "numba")
    assert crossover.serial_function(dp, "nutpie") is nut   # compiled once
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    for point in _points(model, np.random.default_rng(13), k=2):
        for serial in (nut, own):
            lp, g = internals.serial_call(serial.fn)(dp.ravel(point))
            np.testing.assert_allclose(lp, logp(point), rtol=1e-10)
            _assert_grad_close(g, dlogp(point))


def test_nutpie_functions_fall_back_to_the_default_mode(env, monkeypatch):
    """Where nutpie's mode cannot compile PyMC's functions (here a mode PyTensor does not
    know), the decision's function and each draw's expansion compile in PyTensor's default
    instead, and give PyMC's values."""
    model, dp = env.models["radon"], env.dps["radon"]
    monkeypatch.setattr(internals, "sampler_mode", lambda sampler: "NOT_A_MODE")
    monkeypatch.setattr(dp, "serials", {})
    serial = crossover.serial_function(dp, "nutpie")
    assert serial.mode is None and dp.serials["NOT_A_MODE"] is serial
    point = model.initial_point()
    lp, g = internals.serial_call(serial.fn)(dp.ravel(point))
    np.testing.assert_allclose(lp, model.compile_logp()(point), rtol=1e-10)
    _assert_grad_close(g, model.compile_dlogp()(point))
    a = [v for v in model.unobserved_value_vars if v.name == "a"]
    fn, (values,) = internals._expand_function(model, a, [point[n] for n in dp.value_names])
    want = point["mu_a"] + np.exp(point["sigma_a_log__"]) * point["z_a"]
    np.testing.assert_allclose(values, want, rtol=1e-12)
    np.testing.assert_allclose(fn(*[point[n] for n in dp.value_names])[0], want, rtol=1e-12)


def test_nutpie_compiling_its_own_compiles_nothing_of_pymc(env, caplog, monkeypatch):
    """Where the decision (here one kept from an earlier run) is nutpie compiling its own,
    dp.sample runs pm.sample's nutpie and compiles no PyMC function for it: nutpie would
    not run it."""
    pytest.importorskip("nutpie")
    import logging

    dp = env.auto
    decision = crossover.Decision(False, "measured", "nutpie", 2, crossover.sampling_cores(2, None),
                                  2, 1e-3, 0.5, 1e-4, None, 10.0, 20.0, kept=True)
    monkeypatch.setattr(crossover, "decide", lambda *args: decision)

    def refused(dp):
        raise AssertionError("PyMC's function compiled")
    monkeypatch.setattr(crossover, "serial_function", refused)
    calls = dp.batcher.calls
    with caplog.at_level(logging.WARNING, logger="synkhronos"):
        idata = dp.sample(20, tune=20, chains=2, nuts_sampler="nutpie", random_seed=1,
                          progressbar=False, compute_convergence_checks=False)
    assert idata.posterior.sizes["chain"] == 2 and idata.posterior.sizes["draw"] == 20
    assert dp.batcher.calls == calls
    said = [r.getMessage() for r in caplog.records if "would not gain" in r.getMessage()]
    assert len(said) == 1 and "as an earlier run measured it" in said[0], said


def test_nutpie_way_turns_on_the_gradients_a_draw_takes(env, monkeypatch):
    """Where the choice between nutpie on PyMC's compiled function and nutpie's own compile
    turns on the gradients a draw takes, a short nutpie run counts them, and the choice
    follows the count; where the run would be long against the sampling, or the choice
    does not turn on it, nothing is counted."""
    pytest.importorskip("nutpie")
    dp = env.auto
    counted = []
    own_count = draws.leapfrogs

    def counting(*args):
        counted.append(own_count(*args))
        return counted[-1]

    monkeypatch.setattr(draws, "leapfrogs", counting)
    monkeypatch.setattr(crossover, "DP_NUTPIE_S", 1e-3)   # no split: the two other ways
    try:
        monkeypatch.setattr(crossover, "callback_turns", lambda *a: 50.0)
        d = crossover.decide(dp, "nutpie", 2, None, 1000, 1000)
        assert len(counted) == 1 and d.leapfrogs == counted[0] and 1 <= d.leapfrogs <= 1023
        # The prediction as the decision states it, with the draws' count.
        steps = 2000 * d.leapfrogs
        callback = steps * 2 * (d.serial_s + crossover.CALLBACK_S)
        native, _ = crossover.predict("nutpie", 2, d.cores, steps, d.serial_s, 0.0, 0.0)
        assert d.callback == (callback < native), d
        assert "gradients a draw as counted" in d.describe()
        # 50 draws of nutpie against 2 x 100 of sampling: not worth a count.
        assert crossover.decide(dp, "nutpie", 2, None, 50, 50).leapfrogs is None
        # A choice that does not turn on the count (the callback way at any count).
        monkeypatch.setattr(crossover, "callback_turns", lambda *a: None)
        assert crossover.decide(dp, "nutpie", 2, None, 999, 999).leapfrogs is None
        assert len(counted) == 1
    finally:
        dp.decisions.clear()


def test_results_outlive_the_next_call(env):
    """The positions and outputs are buffers held for the run: what a call returned stays."""
    model, dp = env.models["survival"], env.dps["survival"]
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    p1, p2, p3, p4 = _points(model, np.random.default_rng(13), k=4)
    lp1, g1 = dp.logp_dlogp(p1)
    lp2, g2 = dp.logp_dlogp(p2)
    many1 = dp.logp_dlogp_many(np.stack([dp.ravel(p1), dp.ravel(p2)]))
    many2 = dp.logp_dlogp_many(np.stack([dp.ravel(p3), dp.ravel(p4)]))
    lp3, g3 = dp.batcher(dp.ravel(p3))     # what a sampler's lone chain calls
    np.testing.assert_allclose([lp1, lp2, lp3], [logp(p1), logp(p2), logp(p3)], rtol=1e-10)
    for g, p in ((g1, p1), (g2, p2), (g3, p3), (many1[1][0], p1), (many1[1][1], p2),
                 (many2[1][0], p3), (many2[1][1], p4)):
        _assert_grad_close(g, dlogp(p))
    np.testing.assert_allclose(many1[0], [logp(p1), logp(p2)], rtol=1e-10)


def test_many_positions_vectorised_in_a_loop_or_each_equal_pymc(env):
    """k positions run in one call, vectorised or in a loop of the one-position graph, or in a call
    each, whichever is faster on the model (tried at the first calls): every way gives PyMC's values."""
    model, dp = env.models["radon"], env.dps["radon"]
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    points = _points(model, np.random.default_rng(14), k=2)
    P = np.stack([dp.ravel(p) for p in points])
    dp._calls._ways.pop(2, None)

    def check():
        logps, grads = dp.logp_dlogp_many(P)
        for point, lp, g in zip(points, logps, grads):
            np.testing.assert_allclose(lp, logp(point), rtol=1e-10)
            _assert_grad_close(g, dlogp(point))

    for _ in range(len(synk_pymc.calls.WAYS) * synk_pymc.calls.TRIALS):
        check()
    assert dp._calls._ways[2] in synk_pymc.calls.WAYS and 2 not in dp._calls._trials
    for way in synk_pymc.calls.WAYS:
        dp._calls._ways[2] = way
        check()
    dp._calls._ways.pop(2)


def test_data_split_and_kept_whole(env):
    dp = env.dps["studentt_dims"]
    assert [c.name for c in dp.containers] == ["X", "y"]      # "scale" has other rows
    assert [c.name for c in dp.whole] == ["scale"]
    assert dp.n_rows == N_ROWS
    radon = env.dps["radon"]
    assert sorted(c.name for c in radon.containers) == ["county_idx", "floor", "log_radon"]


def _groups(idata):
    """The groups of ``pm.sample``'s result: ArviZ 1's DataTree (PyMC 6) or an InferenceData (PyMC 5)."""
    groups = idata.groups
    return {g.strip("/") for g in (groups() if callable(groups) else groups)} - {""}


# The hierarchical and the logistic model with both samplers, and as pm.sample chooses (None:
# PyMC 6 picks nutpie where it is installed, PyMC 5 its own NUTS).
SAMPLED = [("radon", "pymc"), ("radon", "nutpie"), ("logistic", "pymc"), ("logistic", "nutpie"),
           ("logistic", None), ("negbin", "pymc"), ("survival", "pymc"), ("studentt_dims", "nutpie")]


@pytest.mark.parametrize("name,sampler", SAMPLED)
def test_posterior_equals_serial_pm_sample(env, name, sampler, monkeypatch):
    if sampler == "nutpie":
        pytest.importorskip("nutpie")
    model, dp = env.models[name], env.dps[name]
    threads = set()

    def recorded(call):
        def wrapper(*args):
            threads.add(threading.get_ident())
            return call(*args)
        return wrapper

    monkeypatch.setattr(dp.batcher, "_evaluate", recorded(dp.batcher._evaluate))
    monkeypatch.setattr(dp.batcher, "_one", recorded(dp.batcher._one))
    idata = dp.sample(DRAWS, tune=DRAWS, chains=2, random_seed=5, nuts_sampler=sampler,
                      progressbar=False)
    if sampler == "pymc":
        # PyMC's chains run as greenlets: this thread made every call (one malloc arena).
        assert threads == {threading.get_ident()}, threads
    assert idata.posterior.sizes["chain"] == 2 and idata.posterior.sizes["draw"] == DRAWS
    # Every chain's request went into shared calls: two chains, fewer calls than positions.
    assert dp.batcher.positions > 1.3 * dp.batcher.calls, (dp.batcher.positions, dp.batcher.calls)
    with model:
        ref = pm.sample(DRAWS, tune=DRAWS, chains=2, cores=1, random_seed=6, progressbar=False,
                        compute_convergence_checks=False,
                        **({} if sampler is None else {"nuts_sampler": sampler}))
    # What pm.sample returns: the same type, groups and sample statistics.
    assert type(idata) is type(ref)
    assert _groups(idata) == _groups(ref) and {"posterior", "sample_stats"} <= _groups(idata)
    assert set(idata.sample_stats.data_vars) == set(ref.sample_stats.data_vars)
    assert set(idata.posterior.data_vars) == set(ref.posterior.data_vars)
    names = [v.name for v in model.free_RVs]
    z = pymc_models.z_scores(idata, ref, names)
    assert all(zm < 4.5 and zs < 4.5 for _, zm, zs in z), z
    if name == "radon":
        # The deterministic, expanded from each draw (nutpie: a function of ours), is
        # its formula at that draw.
        post = idata.posterior
        want = post["mu_a"] + post["sigma_a"] * post["z_a"]
        np.testing.assert_allclose(post["a"].values, want.values, rtol=1e-12, atol=1e-12)


def test_arviz_and_pymc_take_the_result(env):
    """What users do next with the result: az.summary, the log-likelihood and az.loo, and
    posterior predictive draws, on the installed PyMC and ArviZ."""
    model, dp = env.models["logistic"], env.dps["logistic"]
    idata = dp.sample(200, tune=200, chains=2, random_seed=8, nuts_sampler="pymc",
                      progressbar=False, compute_convergence_checks=False)
    summary = az.summary(idata, var_names=["a", "b"])
    assert len(summary) == 4 and np.all(np.isfinite(np.asarray(summary["mean"], dtype=float)))
    with model:
        idata = pm.compute_log_likelihood(idata, progressbar=False)
        ppc = pm.sample_posterior_predictive(idata, random_seed=9, progressbar=False)
    assert "log_likelihood" in _groups(idata)
    loo = az.loo(idata)
    assert np.isfinite(float(getattr(loo, "elpd", getattr(loo, "elpd_loo", np.nan))))
    y = ppc.posterior_predictive["y_obs"]
    assert y.sizes["chain"] == 2 and y.sizes["draw"] == 200 and y.shape[-1] == N_ROWS
    assert set(np.unique(np.asarray(y))) <= {0, 1}


def test_sample_defaults_warnings_and_counters_as_pm_sample(env):
    """chains as pm.sample's default; cores= and model= warned about, saying why; the batcher
    counts one sample() call: every gradient NUTS took (its n_steps and each draw's start)."""
    import multiprocessing

    dp = env.dps["negbin"]
    dp.sample(10, tune=10, chains=1, random_seed=2, progressbar=False, nuts_sampler="pymc",
              compute_convergence_checks=False)
    with pytest.warns(UserWarning) as warned:
        idata = dp.sample(30, tune=20, cores=3, model=env.models["radon"], random_seed=3,
                          progressbar=False, compute_convergence_checks=False,
                          discard_tuned_samples=False, nuts_sampler="pymc")
    text = " ".join(str(w.message) for w in warned)
    assert "cores=3 ignored: the 2 chain(s) run in this process" in text, text
    assert "model= ignored: dp samples the model it was built on" in text, text
    # pm.sample's rule (pymc/sampling/mcmc.py: cores = min(4, CPUs), chains = max(2, cores),
    # CPUs counted as half the hardware threads; test_pymc_internals checks that source).
    assert idata.posterior.sizes["chain"] == max(2, min(4, multiprocessing.cpu_count() // 2))
    assert idata.posterior.sizes["draw"] == 30 and set(idata.posterior) >= {"b", "alpha"}
    # PyMC's NUTS evaluates once at each draw's start (integrator.compute_state) and once a
    # leapfrog step (n_steps); the count holds this call's only (the first call's not added).
    n_steps = int(idata.warmup_sample_stats["n_steps"].sum() + idata.sample_stats["n_steps"].sum())
    chains = idata.posterior.sizes["chain"]
    expected = n_steps + (20 + 30) * chains
    assert expected <= dp.batcher.positions <= expected + 2 * chains, (expected,
                                                                         dp.batcher.positions)
    assert dp.batcher.calls < dp.batcher.positions


def test_pm_sample_while_forked_warns_its_chains_would_share_a_core(env):
    """pm.sample's chain processes inherit the forked master's one core: it says so, naming
    dp.sample; the draws still come; dp.sample itself does not warn."""
    import os
    import warnings

    import pymc as pm

    if len(os.sched_getaffinity(0)) != 1 or (os.cpu_count() or 1) < 2:
        pytest.skip("the master is not pinned here (more ranks than cores)")
    model, dp = env.models["negbin"], env.dps["negbin"]
    with pytest.warns(UserWarning, match=r"pm.sample\(\) while synkhronos is forked: this process "
                      r"is pinned to core \d+ .* sample with dp.sample\(\)"):
        idata = pm.sample(5, tune=5, chains=2, cores=2, model=model, random_seed=5,
                          progressbar=False, compute_convergence_checks=False)
    assert idata.posterior.sizes["chain"] == 2 and idata.posterior.sizes["draw"] == 5
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dp.sample(5, tune=5, chains=2, random_seed=6, progressbar=False,
                  compute_convergence_checks=False)
    assert not [w for w in seen if "while synkhronos is forked" in str(w.message)]


def test_ctrl_c_returns_the_draws_so_far(env):
    """Ctrl-C during dp.sample (SIGINT to this process) stops the chains and returns the draws
    made, as pm.sample does; the runtime keeps working."""
    import os
    import signal

    model, dp = env.models["negbin"], env.dps["negbin"]

    def callback(trace, draw):
        if draw.chain == 0 and draw.draw_idx == 60:
            os.kill(os.getpid(), signal.SIGINT)

    # As in a terminal: a run started in the background (`cmd &` from a script) inherits
    # SIGINT ignored, and Python then keeps it ignored (the test failed so, twice).
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        idata = dp.sample(400, tune=20, chains=2, random_seed=4, progressbar=False,
                          callback=callback, compute_convergence_checks=False)
    finally:
        signal.signal(signal.SIGINT, old)
    assert 20 <= idata.posterior.sizes["draw"] < 400, idata.posterior.sizes
    assert np.all(np.isfinite(idata.posterior["b"].values))
    point = _points(model, np.random.default_rng(8), k=1)[0]
    np.testing.assert_allclose(dp.logp(point), model.compile_logp()(point), rtol=1e-10)


def test_find_map_is_pm_find_map(env):
    model, dp = env.models["radon"], env.dps["radon"]
    point = dp.find_map()
    ref = pm.find_MAP(model=model, progressbar=False)
    assert set(point) == set(ref)
    for k in ref:
        np.testing.assert_allclose(point[k], ref[k], rtol=1e-4, atol=1e-4, err_msg=k)
    raw, res = dp.find_map(include_transformed=False, return_raw=True)
    assert "sigma_a_log__" not in raw and res.success


def test_set_data_without_scatter_is_caught(env):
    model, dp = env.models["negbin"], env.dps["negbin"]
    old = model["y"].get_value()
    point = model.initial_point()
    try:
        with model:
            pm.set_data({"y": np.random.default_rng(3).poisson(2.0, size=N_ROWS)})
        with pytest.raises(synk.SynkStateError, match=r"\['y'\].*dp.scatter\(\)"):
            dp.logp(point)
        dp.scatter()
        np.testing.assert_allclose(dp.logp(point), model.compile_logp()(point), rtol=1e-10)
    finally:
        with model:
            pm.set_data({"y": old})
        dp.scatter()
    np.testing.assert_allclose(dp.logp(point), model.compile_logp()(point), rtol=1e-10)


def test_the_model_holds_the_shared_rows_not_a_copy(env):
    """On one machine the split containers hold the shared-memory arrays the ranks read (the
    master keeps no copy of its own), with the same rows, so PyMC's own functions on the model
    still give their values; a second data_parallel on the same model leaves them with the
    first's; pm.set_data then scatter() points them at the new rows in shared memory."""
    model, dp = env.models["negbin"], env.dps["negbin"]
    assert dp.containers
    with pytensor.config.change_flags(floatX="float64"):
        ref = pymc_models.negbin(N_ROWS)      # the same rows, never made data-parallel
    for c, d in zip(dp.containers, dp._data):
        held = c.get_value(borrow=True)
        assert held is d.data and not held.flags.owndata
        np.testing.assert_array_equal(held, ref[c.name].get_value())
    for point in _points(model, np.random.default_rng(17), k=2):
        lp = model.compile_logp()(point)
        np.testing.assert_allclose(lp, ref.compile_logp()(point), rtol=1e-12)
        np.testing.assert_allclose(dp.logp(point), lp, rtol=1e-10)
        _assert_grad_close(dp.dlogp(point), ref.compile_dlogp()(point))
    radon, other = env.dps["radon"], env.other
    for c, d in zip(radon.containers, radon._data):
        assert c.get_value(borrow=True) is d.data
    assert all(o is not d for o, d in zip(other._data, radon._data))
    point = model.initial_point()
    old = model["y"].get_value()
    new = np.random.default_rng(5).poisson(2.0, size=N_ROWS)
    try:
        with model:
            pm.set_data({"y": new})
        dp.scatter()
        y = model["y"]
        d = dp._data[[c.name for c in dp.containers].index("y")]
        assert y.get_value(borrow=True) is d.data
        np.testing.assert_array_equal(d.data, new)
        with ref:
            pm.set_data({"y": new})
        np.testing.assert_allclose(dp.logp(point), ref.compile_logp()(point), rtol=1e-10)
    finally:
        with model:
            pm.set_data({"y": old})
        dp.scatter()


# -- data produced where it is used, on simulated machines --------------------------------------
def _cluster_run(n_machines, local):
    import os

    from helpers.cluster_jobs import TESTS, assert_nothing_left, machines, mpirun

    script = os.path.join(TESTS, "helpers", "cluster_pymc.py")
    with machines(n_machines) as m:
        rc, out, _ = mpirun(m, n_machines, [script, str(local)], timeout=280)
        assert rc == 0 and "ALL OK" in out, out
        assert f"MACHINES {n_machines}\n" in out and "OK logp\n" in out, out
        assert_nothing_left(m, out, "cluster_pymc.py")


def _why_no_cluster():
    from helpers.cluster_jobs import why_no_mpi
    return why_no_mpi()


@pytest.mark.timeout(300)
def test_sample_on_two_simulated_machines():
    why = _why_no_cluster()
    if why:
        pytest.skip(why)
    _cluster_run(2, 1)


def test_demo_runs_small():
    """demos/pymc/map_regression.py end to end, on a few rows (its figures are not checked)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "demos/pymc/map_regression.py", "--family", "poisson",
                           "--rows", "3000", "--features", "3", "--evals", "2", "--rounds", "1",
                           "--n-parallel", "2"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "synkhronos, 2 ranks" in proc.stdout and "evaluations/s" in proc.stdout
    diff = float(proc.stdout.rsplit("MAP estimates:", 1)[1].split()[0])
    assert diff < 1e-6


def _same_bits(kind, ranks):
    """tests/helpers/same_bits.py on this machine: ``({ranks: hash}, means of the last run)``."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "tests/helpers/same_bits.py", kind,
                           ",".join(map(str, ranks))], cwd=root, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    return _bits(proc.stdout), json.loads(proc.stdout.rsplit("MEANS ", 1)[1].splitlines()[0])


def _bits(out):
    return {int(r): h for r, h in re.findall(r"^BITS (\d+) (\w+)$", out, re.M)}


SAME_DRAWS_MODELS = [("logistic", [0.3, 0.8, -0.5]),  # a, b
                     ("radon", [0.8, 0.975])]  # b; mu: 0.5 + 0.05 x mean group


@pytest.mark.parametrize("kind, means", SAME_DRAWS_MODELS)
def test_the_same_draws_on_any_number_of_ranks(kind, means):
    """dp.sample with a fixed seed: bit-identical draws on 1, 2, 3 and 4 ranks (chunked calls)."""
    hashes, got = _same_bits(kind, (1, 2, 3, 4))
    assert len(hashes) == 4 and len(set(hashes.values())) == 1, hashes
    # The draws are the model's: near the coefficients the rows were made from.
    np.testing.assert_allclose(got, means, atol=0.25)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", [k for k, _ in SAME_DRAWS_MODELS])
def test_the_same_draws_on_two_simulated_machines(kind):
    """dp.sample with a fixed seed on 2 machines x 1 rank: the draws of 1 rank on one machine."""
    why = _why_no_cluster()
    if why:
        pytest.skip(why)
    from helpers.cluster_jobs import assert_nothing_left, machines, mpirun

    one, _ = _same_bits(kind, (1,))
    with machines(2) as m:
        rc, out, _ = mpirun(m, 2, ["helpers/same_bits.py", kind, "1"], timeout=280)
        assert rc == 0 and "ALL OK" in out and "MACHINES 2\n" in out, out
        assert _bits(out) == one, (out, one)
        assert_nothing_left(m, out, "same_bits.py")
