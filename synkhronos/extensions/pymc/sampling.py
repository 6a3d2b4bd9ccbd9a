"""PyMC's own calls on a DataParallelModel: ``sample`` (pm.sample with every chain's (logp, dlogp)
in one data-parallel call) and ``find_map`` (pm.find_MAP's optimisation on it)."""

import logging
import numbers
import warnings

import numpy as np
import pymc as pm

from . import crossover, internals, master_cores

logger = logging.getLogger(__name__)

SAMPLERS = ("pymc", "nutpie")


def sample(dp, draws, tune, chains, nuts_sampler, random_seed, **kwargs):
    """Run ``pm.sample`` on ``dp.model`` with ``dp``'s (logp, dlogp); see ``DataParallelModel.sample``."""
    where = "DataParallelModel.sample"
    if nuts_sampler is not None and nuts_sampler not in SAMPLERS:
        raise ValueError(f"{where}: nuts_sampler must be 'pymc', 'nutpie' or None (as pm.sample "
                         f"chooses); got {nuts_sampler!r}")
    if kwargs.get("step") is not None:
        raise ValueError(f"{where}: step= is not supported: the data-parallel (logp, dlogp) "
                         "drives NUTS (pass NUTS's arguments, e.g. target_accept=, instead)")
    if chains is None:
        chains = internals.default_chains()
    if not isinstance(chains, int) or chains < 1:
        raise ValueError(f"{where}: chains must be a positive int; got {chains!r}")
    model = kwargs.pop("model", None)
    if model is not None and model is not dp.model:
        warnings.warn(f"{where}: model= ignored: dp samples the model it was built on "
                      "(dp.model); build data_parallel(other_model) before synk.distribute() "
                      "to sample another", UserWarning, stacklevel=3)
    cores = kwargs.pop("cores", None)
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, numbers.Integral)
                              or cores < 1):
        raise ValueError(f"{where}: cores must be a positive int or None; got {cores!r}")
    cores = None if cores is None else int(cores)
    nuts_sampler = internals.nuts_sampler(nuts_sampler, kwargs)
    if nuts_sampler == "nutpie":
        try:
            import nutpie  # noqa: F401
        except ImportError as exc:
            raise ImportError(f"{where}: nuts_sampler='nutpie' needs nutpie: "
                              "pip install -e '.[nutpie]'") from exc
    if tune is not None:   # None: pm.sample's own default (1000; PyMC 6 may choose)
        kwargs["tune"] = tune
    dp.batcher.reset()
    decision = dp.decision = crossover.decide(dp, nuts_sampler, chains, cores, draws, tune)
    dp.separate_calls = decision.separate
    if decision.reason == "measured" and not decision.split:
        logger.warning(decision.describe())
    else:
        logger.info(decision.describe())
    if not decision.split:
        if decision.callback:
            # nutpie's chains call PyMC's compiled function back, as the split's callback,
            # one chain after the other (the function serves one call at a time).
            serial = crossover.serial_function(dp, nuts_sampler).fn
            kwargs = internals.sample_kwargs(nuts_sampler, chains, kwargs, at_once=False)
            with master_cores.released(), internals.driving_serial(dp, serial):
                return pm.sample(draws, chains=chains, random_seed=random_seed,
                                 nuts_sampler=nuts_sampler, model=dp.model, **kwargs)
        # The chains on the cores synkhronos was given, as the prediction took them (PyMC's
        # own default counts half the CPUs, taking the rest for hardware threads).
        kwargs["cores"] = decision.cores
        with master_cores.released():
            if nuts_sampler == "nutpie":   # nutpie compiles its own; PyMC's is not needed
                return pm.sample(draws, chains=chains, random_seed=random_seed,
                                 nuts_sampler=nuts_sampler, model=dp.model, **kwargs)
            # PyMC's NUTS runs the function the decision compiled (a kept decision: now).
            with internals.serving(dp.model, crossover.serial_function(dp, nuts_sampler).fn):
                return pm.sample(draws, chains=chains, random_seed=random_seed,
                                 nuts_sampler=nuts_sampler, model=dp.model, **kwargs)
    if cores is not None:
        warnings.warn(f"{where}: cores={cores} ignored: the {chains} chain(s) run in this "
                      "process, every step of all of them one call over the ranks, "
                      "and the ranks use the cores (synk.fork(n) sets how many)",
                      UserWarning, stacklevel=3)
    kwargs = internals.sample_kwargs(nuts_sampler, chains, kwargs)
    with internals.driving(dp, nuts_sampler):
        return pm.sample(draws, chains=chains, random_seed=random_seed,
                         nuts_sampler=nuts_sampler, model=dp.model, **kwargs)


def find_map(dp, start, method, return_raw, include_transformed, maxeval, **kwargs):
    """Maximise ``dp``'s log-density as ``pm.find_MAP`` does; see ``DataParallelModel.find_map``."""
    from scipy.optimize import minimize

    if dp.map_fns is None:
        dp.map_fns = internals.map_functions(dp.model, dp.value_names, dp.value_shapes, dp.dtype)
    jac_fn, expand = dp.map_fns

    def objective(x):
        lp, g = dp.logp_dlogp(x)
        jlp, jg = jac_fn(np.asarray(x, dtype=dp.dtype))
        return -float(lp - jlp), -np.asarray(g - jg, dtype=np.float64)

    x0 = (dp.initial_x() if start is None
          else dp.ravel({**dp.model.initial_point(), **start}).astype(np.float64))
    options = dict(kwargs.pop("options", None) or {})
    options.setdefault("maxiter", maxeval)
    res = minimize(objective, x0, jac=True, method=method, options=options, **kwargs)
    point = expand(dp.unravel(res.x.astype(dp.dtype)), include_transformed)
    return (point, res) if return_raw else point
