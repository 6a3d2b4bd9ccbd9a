"""What synkhronos/extensions/pymc/internals.py needs from PyMC and nutpie, on the installed versions.

Runs without a synkhronos runtime: a stand-in for DataParallelModel
evaluates PyMC's own serial (logp, dlogp) through the same Batcher, so
``pm.sample`` runs the threaded chains, the NUTS hook and the nutpie hook
exactly as ``dp.sample`` does.  ``make test-pymc-versions`` runs this file
(and the PyMC tests) on every supported PyMC.
"""

import inspect
import os
import subprocess
import sys
import types

import numpy as np
import pytest

pm = pytest.importorskip("pymc", reason="PyMC is not installed (pip install -e '.[pymc]')")

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.graph.replace import clone_replace  # noqa: E402
from pymc.sampling import mcmc  # noqa: E402

from synkhronos.extensions.pymc import internals  # noqa: E402
from synkhronos.extensions.pymc.batching import Batcher  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_pymc_version_supported():
    assert internals.is_supported(internals.pymc_version()), pm.__version__
    assert internals.is_supported((5, 27)) and internals.is_supported((6, 4))
    assert not internals.is_supported((5, 26)) and not internals.is_supported((7, 0))


def test_names_the_hooks_use():
    params = inspect.signature(mcmc._sample).parameters
    for name in ("chain", "rng", "start", "draws", "step", "trace", "tune", "progress_manager"):
        assert name in params, name
    assert "progress_manager" not in inspect.signature(mcmc._sample_many).parameters
    assert internals.progress_manager_class() is not None
    assert hasattr(mcmc, "default_progress_theme")
    assert "model.logp_dlogp_function(" in inspect.getsource(mcmc.init_nuts)
    assert "logp_dlogp_func" in inspect.signature(pm.NUTS.__init__).parameters or \
        "logp_dlogp_func" in inspect.getsource(pm.step_methods.arraystep.GradientSharedStep)
    from pymc.step_methods.hmc import integration
    src = inspect.getsource(integration.CpuLeapfrogIntegrator.__init__)
    assert "_pytensor_function" in src and "_raveled_inputs" in src
    # dp.sample's default chains: pm.sample's own rule, on the CPU count PyMC's sample reads.
    src = inspect.getsource(mcmc.sample)
    assert "cores = min(4, _cpu_count())" in src and "chains = max(2, cores)" in src
    from pymc.sampling import parallel
    assert mcmc._cpu_count is parallel._cpu_count
    assert internals.default_chains() == max(2, min(4, parallel._cpu_count()))
    if internals.pymc_version() >= (6, 0):
        # PyMC 6's choice of sampler (internals.nuts_sampler makes the same).
        assert isinstance(mcmc.NUTPIE_INSTALLED, bool) and callable(mcmc._nutpie_meets_min_version)
        assert "can_use_nutpie" in src and "cores=cores" in inspect.getsource(mcmc._sample_external_nuts)
        from pymc.pytensorf import resolve_backend_compile_kwargs  # noqa: F401
    try:
        from nutpie import compile_pymc
    except ImportError:
        return
    assert callable(compile_pymc._prepare_dims_and_coords)


def _stand_in(model):
    """What internals.driving reads from a DataParallelModel, on PyMC's serial functions."""
    value_vars = model.value_vars
    point = model.initial_point()
    shapes = [tuple(np.shape(point[v.name])) for v in value_vars]
    x = pt.dvector("x")
    replace, lo = {}, 0
    for v, shape in zip(value_vars, shapes):
        size = int(np.prod(shape, dtype=int))
        replace[v] = x[lo:lo + size].reshape(shape)
        lo += size
    logp = clone_replace(model.logp(), replace=replace)
    fn = pytensor.function([x], [logp, pytensor.grad(logp, x)])

    def evaluate(P):
        out = [fn(p) for p in P]
        return np.array([o[0] for o in out]), np.stack([o[1] for o in out])

    dp = types.SimpleNamespace(model=model, batcher=Batcher(evaluate), dtype=np.dtype("float64"),
                               value_names=[v.name for v in value_vars], value_shapes=shapes, size=lo)

    def unravel(q):
        out, lo = {}, 0
        for name, shape in zip(dp.value_names, shapes):
            size = int(np.prod(shape, dtype=int))
            out[name] = q[lo:lo + size].reshape(shape)
            lo += size
        return out
    dp.unravel = unravel
    return dp


def _model():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(50, 2))
    with pytensor.config.change_flags(floatX="float64"):
        with pm.Model() as model:
            X_d = pm.Data("X", X)
            y_d = pm.Data("y", X @ np.array([1.0, -1.0]) + rng.normal(size=50))
            b = pm.Normal("b", 0, 1, shape=2)
            s = pm.HalfNormal("s", 1)
            pm.Deterministic("b_sum", b.sum())
            pm.Normal("y_obs", mu=X_d @ b, sigma=s, observed=y_d)
    return model


@pytest.mark.parametrize("sampler", ["pymc", "nutpie"])
def test_pm_sample_runs_every_chain_through_the_batcher(sampler):
    if sampler == "nutpie":
        pytest.importorskip("nutpie")
    model = _model()
    dp = _stand_in(model)
    kw = internals.sample_kwargs(sampler, 3, {"progressbar": False,
                                             "compute_convergence_checks": False})
    with internals.driving(dp, sampler):
        idata = pm.sample(100, tune=100, chains=3, random_seed=1, model=model,
                          nuts_sampler=sampler, **kw)
    assert idata.posterior.sizes["chain"] == 3 and idata.posterior.sizes["draw"] == 100
    assert {"b", "s", "b_sum"} <= set(idata.posterior.data_vars)
    np.testing.assert_allclose(idata.posterior["b_sum"], idata.posterior["b"].sum("b_dim_0"))
    assert dp.batcher.calls > 0 and dp.batcher.positions > 1.5 * dp.batcher.calls
    # The hooks are gone afterwards: PyMC's own functions again.
    assert "logp_dlogp_function" not in vars(model)
    assert mcmc._sample_many.__module__ == "pymc.sampling.mcmc"


def test_pymcs_nuts_never_imports_nutpie():
    """Importing nutpie (and the ArviZ it imports) takes 1.2 s on PyMC 6.4:
    dp.sample with PyMC's NUTS must not pay it."""
    pytest.importorskip("nutpie")
    code = (
        "import sys; sys.path.insert(0, {tests!r})\n"
        "import pymc as pm\n"
        "from synkhronos.extensions.pymc import internals\n"
        "from extensions.test_pymc_internals import _model, _stand_in\n"
        "model = _model(); dp = _stand_in(model)\n"
        "kw = internals.sample_kwargs('pymc', 2, {{'progressbar': False, "
        "'compute_convergence_checks': False}})\n"
        "with internals.driving(dp, 'pymc'):\n"
        "    pm.sample(5, tune=5, chains=2, random_seed=1, model=model, nuts_sampler='pymc', **kw)\n"
        "print('NUTPIE', 'nutpie' in sys.modules)\n"
    ).format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=200)
    assert "NUTPIE False" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("at_once", [False, True])
def test_nutpie_on_the_serial_function_runs_one_chain_after_the_other(at_once):
    """The callback way (nutpie on PyMC's own function, one call at a time): chains in turn,
    not threads taking turns at its lock; at_once=True (the batcher's way) runs them at once."""
    import threading

    pytest.importorskip("nutpie")
    model = _model()
    dp = _stand_in(model)
    call = internals.serial_call(internals.serial_logp_dlogp(model))
    threads = []
    # How the threads take turns afterwards is the scheduler's (CI saw A, B..., A...); that
    # both chains' threads are running at once is not: each one's first call waits for the other's.
    met = threading.Barrier(2, timeout=60)

    def recording(x):
        ident = threading.get_ident()
        if at_once and ident not in threads and len(set(threads)) < 2:
            threads.append(ident)
            met.wait()
        else:
            threads.append(ident)
        return call(x)

    kw = internals.sample_kwargs("nutpie", 2, {"progressbar": False,
                                               "compute_convergence_checks": False},
                                 at_once=at_once)
    with internals.driving_serial(dp, types.SimpleNamespace(_pytensor_function=recording)):
        idata = pm.sample(50, tune=50, chains=2, random_seed=1, model=model,
                          nuts_sampler="nutpie", **kw)
    assert idata.posterior.sizes["chain"] == 2 and idata.posterior.sizes["draw"] == 50
    switches = sum(a != b for a, b in zip(threads, threads[1:]))
    if at_once:
        assert len(set(threads)) == 2 and min(map(threads.count, set(threads))) > 50, switches
    else:
        assert switches <= 2, switches  # one thread, or a block of calls per chain


class _Ran(Exception):
    pass


@pytest.mark.parametrize("kwargs", [{}, {"init": "adapt_diag"}, {"initvals": [{}, {}]},
                                    {"backend": "c"}, {"return_inferencedata": False},
                                    {"callback": lambda trace, draw: None}])
def test_the_default_sampler_is_pm_samples(monkeypatch, kwargs):
    """internals.nuts_sampler(None, ...) names what pm.sample itself would run."""
    model = _model()
    ran = []

    def external(*args, sampler, **kw):
        ran.append(sampler)
        raise _Ran

    def own(*args, **kw):
        ran.append("pymc")
        raise _Ran

    monkeypatch.setattr(mcmc, "_sample_external_nuts", external)
    monkeypatch.setattr(mcmc, "_sample_many", own)
    expected = internals.nuts_sampler(None, kwargs)
    kwargs = dict(kwargs)
    if "initvals" in kwargs:
        kwargs["initvals"] = [model.initial_point()] * 2
    with pytest.raises(_Ran), pytensor.config.change_flags(floatX="float64"):
        pm.sample(10, tune=10, chains=2, cores=1, model=model, progressbar=False, **kwargs)
    assert ran == [expected]
    if internals.pymc_version() >= (6, 0) and not kwargs:
        assert expected == ("nutpie" if mcmc.NUTPIE_INSTALLED else "pymc")


def test_total_size_is_found():
    rng = np.random.default_rng(0)
    with pytensor.config.change_flags(floatX="float64"):
        with pm.Model() as model:
            y_d = pm.Data("y", rng.normal(size=10))
            mu = pm.Normal("mu", 0, 1)
            scaled = pm.Normal("scaled", mu, 1, observed=y_d, total_size=1000)
            plain = pm.Normal("plain", mu, 1, observed=y_d)
            cols = pm.Normal("cols", mu, 1, observed=y_d, total_size=[None])
    assert internals.scales_rows(scaled)
    assert not internals.scales_rows(plain) and not internals.scales_rows(cols)
    assert [v.name for v in model.observed_RVs] == ["scaled", "plain", "cols"]


def test_the_worker_builds_the_first_mode_while_the_master_measures(forked, tmp_path,
                                                                       monkeypatch):
    """Measured afresh (nothing kept), the worker builds the first mode's one-position
    function while the master measures the modes (calls.measured, aside.build_while), and
    the master runs the function it measured for the mode kept (aside.adopt); logp and dlogp
    equal PyMC's.  A model whose mode an earlier one measured builds nothing ahead."""
    import synkhronos as synk
    from synkhronos.extensions import pymc as synk_pymc
    from synkhronos.extensions.pymc import calls, modes
    from synkhronos.functions.measures import MeasureFile

    monkeypatch.setattr(modes, "KEPT", MeasureFile("modes.json", str(tmp_path)))
    monkeypatch.setattr(modes, "SMALL_S", 1.0)   # the first mode kept: known which
    ahead, adopted = [], []
    real_build, real_adopt = calls.build_while, calls.adopt

    def build(fns, local):
        ahead.append([f.name for f in fns])
        return real_build(fns, local)

    def adopt(function, fn):
        adopted.append((function, fn))
        real_adopt(function, fn)
    monkeypatch.setattr(calls, "build_while", build)
    monkeypatch.setattr(calls, "adopt", adopt)
    model = _model()
    forked(2)
    with pytensor.config.change_flags(floatX="float64"):
        dps = [synk_pymc.data_parallel(model, name=name) for name in ("first", "again")]
    synk.distribute()
    point = model.initial_point()
    logp, dlogp = model.compile_logp(), model.compile_dlogp()
    for dp in dps:
        lp, g = dp.logp_dlogp(point)
        np.testing.assert_allclose(lp, logp(point), rtol=1e-10)
        np.testing.assert_allclose(g, dlogp(point), rtol=1e-9, atol=1e-12)
        assert dp.mode == dp.rank_modes[0], (dp.mode, dp.rank_modes)
    assert ahead == [["first"]]
    (function, fn), = adopted
    assert function.name == "first" and function.spec.fn is fn
