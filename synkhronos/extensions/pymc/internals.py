"""Everything the integration needs from PyMC's (and nutpie's) internals, in one place.

Supported: PyMC 5.27-5.28 with the PyTensor each pins (2.36, 2.38), and PyMC 6.x
(PyTensor 3.x, ArviZ 1); nutpie 0.15+ (PyMC 6 asks for 0.16.10+).
``tests/extensions/test_pymc_internals.py`` checks every name used here against the
installed versions (``make test`` runs it on PyMC 5.28 and 6.x, ``make
test-pymc-versions`` on 5.27).  What we rely on:

- ``pm.sample`` asks ``model.logp_dlogp_function(ravel_inputs=True, ...)``
  for the NUTS step's (logp, dlogp) (``init_nuts``); PyMC's leapfrog reads
  ``_pytensor_function``, ``_raveled_inputs``, ``dtype`` and
  ``_extra_vars_shared`` of what it returns.  ``driving()`` hands it
  ``LogpDlogp`` for the duration of one ``pm.sample`` call, on this model only.
- ``pm.sample(cores=1)`` runs its chains through
  ``pymc.sampling.mcmc._sample_many``; ``driving()`` swaps in one that runs
  every chain's ``_sample`` at once (greenlets of the calling thread, each on
  a copy of the step), their progress through ``progress_manager.update``.
- ``pm.sample(nuts_sampler="nutpie")`` calls ``nutpie.compile_pymc_model``;
  ``driving()`` makes it return a ``nutpie.compiled_pyfunc.from_pyfunc``
  model on the data-parallel (logp, dlogp).  nutpie runs ``cores`` chains at
  once: PyMC 5 passes ``nuts_sampler_kwargs`` on to ``nutpie.sample``, PyMC 6
  passes ``cores`` itself (``sample_kwargs()``).
- PyMC 6 samples with nutpie when not told otherwise, where nutpie
  (``mcmc.NUTPIE_INSTALLED``, ``mcmc._nutpie_meets_min_version``) and the
  mode's linker allow it; ``nuts_sampler()`` makes the same choice.
- ``pm.sample`` runs parallel chains through ``mcmc._mp_sample`` (processes)
  and external samplers through ``mcmc._sample_external_nuts`` (nutpie's
  threads); ``warn_when_pinned()`` wraps both, once, to warn when they would
  start on a synkhronos master pinned to one core.
- ``crossover`` times ``model.logp_dlogp_function(ravel_inputs=True)``'s
  ``_pytensor_function`` as one of pm.sample's chains would call it
  (``serial_logp_dlogp()``); where it does not split, ``serving()`` hands
  that very function to pm.sample's NUTS step (its ``trust_input`` set, as
  the step sets it), which then compiles nothing of its own.
- nutpie compiles the model in Numba whatever PyTensor's default: for it,
  ``serial_logp_dlogp()`` passes ``mode=`` through ``logp_dlogp_function``
  to PyTensor, and each draw's expansion goes through
  ``pm.pytensorf.compile(..., mode=)`` (``sampler_mode()``), each falling
  back to the default where Numba cannot compile it.
- PyMC 6 returns ArviZ 1's ``DataTree``, PyMC 5 an ``InferenceData``: what
  ``pm.sample`` returns is returned as it is.

Over 400 lines: one job, every PyMC and nutpie internal the integration touches, for
both lines of PyMC, kept together so that a new release is checked in one place.
"""

import contextlib
import copy
import functools
import inspect
import logging
import os
import threading
import warnings

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
from pymc.initial_point import make_initial_point_fn
from pymc.pytensorf import rewrite_pregrad as _rewrite_pregrad
from pymc.sampling import mcmc

from ... import compat
from ...runtime.process_setup import trim_heap

logger = logging.getLogger(__name__)

SUPPORTED_PYMC = (((5, 27), (5, 28)), ((6, 0), (6, 99)))
"""The supported (major, minor) ranges, inclusive.  PyMC 5.25 and 5.26 pin PyTensor 2.31 and
2.35, below synkhronos's 2.36 (compat.MIN_PYTENSOR)."""


def pymc_version():
    """The installed PyMC as (major, minor)."""
    parts = pm.__version__.split(".")
    return int(parts[0]), int(parts[1])


def is_supported(version):
    """Whether PyMC ``version`` (major, minor) lies in one of ``SUPPORTED_PYMC``'s ranges."""
    return any(lo <= tuple(version[:2]) <= hi for lo, hi in SUPPORTED_PYMC)


def nuts_sampler(name, kwargs):
    """The NUTS implementation ``pm.sample(nuts_sampler=name, **kwargs)`` runs: "pymc" or another.

    PyMC 5 runs its own unless told.  PyMC 6 runs nutpie when it is
    installed (and new enough, else it warns and runs its own), the mode
    compiles with Numba or JAX, and no argument asks for PyMC's own sampler
    (``init``, ``trace``, ``callback``, per-chain ``initvals``,
    ``return_inferencedata=False``); a data-parallel model has no step of
    its own and only continuous variables, so NUTS alone samples it.
    """
    if name is not None or pymc_version() < (6, 0):
        return "pymc" if name is None else name
    from pytensor.compile.mode import get_mode
    from pytensor.link.jax.linker import JAXLinker
    from pytensor.link.numba.linker import NumbaLinker
    from pymc.pytensorf import resolve_backend_compile_kwargs

    initvals = kwargs.get("initvals")
    compile_kwargs = resolve_backend_compile_kwargs(kwargs.get("backend"),
                                                    dict(kwargs.get("compile_kwargs") or {}))
    usable = (mcmc.NUTPIE_INSTALLED and kwargs.get("init", "auto") == "auto"
              and kwargs.get("return_inferencedata", True) and kwargs.get("trace") is None
              and kwargs.get("callback") is None and (initvals is None or isinstance(initvals, dict))
              and isinstance(get_mode(compile_kwargs.get("mode")).linker, NumbaLinker | JAXLinker))
    if usable and not mcmc._nutpie_meets_min_version():
        warnings.warn(f"pymc requires nutpie>={'.'.join(map(str, mcmc.NUTPIE_MIN_VERSION))}. "
                      "Falling back to the pymc NUTS sampler. Upgrade with `pip install -U nutpie`",
                      UserWarning, stacklevel=4)
        usable = False
    return "nutpie" if usable else "pymc"


def sample_kwargs(name, chains, kwargs, at_once=True):
    """``pm.sample``'s arguments that make every chain of sampler ``name`` run at once here.

    PyMC's own NUTS: ``cores=1`` (its chains in ``_sample_many``, which
    ``driving()`` replaces).  nutpie: ``chains`` threads, so that their
    requests meet in one call; PyMC 5 passes ``nuts_sampler_kwargs`` on to
    ``nutpie.sample``, PyMC 6 its own ``cores``.  PyMC 6 would raise the BLAS
    threads to ``cores`` while sampling: ``blas_cores=None`` keeps this
    process at the one thread its rank has.  ``at_once=False`` (nutpie on
    PyMC's serial function, which serves one call at a time): one chain after
    the other, since threads would only take turns at its lock (splines, 500 +
    500 draws, 2 chains: 3.9-4.1 s against 5.3-7.8 on PyMC 6.4, 9.3 against
    19.2 on 5.28; bench/HISTORY.md, 2026-12-05).

    Returns:
        A copy of ``kwargs`` with those arguments set.
    """
    kwargs = dict(kwargs)
    threads = chains if at_once else 1
    if name != "nutpie":
        kwargs["cores"] = 1
    elif pymc_version() >= (6, 0):
        kwargs["cores"] = threads
        kwargs.setdefault("blas_cores", None)
    else:
        kwargs["cores"] = 1
        nsk = dict(kwargs.pop("nuts_sampler_kwargs", None) or {})
        nsk.setdefault("cores", threads)
        kwargs["nuts_sampler_kwargs"] = nsk
    return kwargs


def serial_logp_dlogp(model, mode=None):
    """PyMC's own (logp, dlogp), compiled as ``pm.sample`` compiles its NUTS step's.

    Args:
        mode: the PyTensor mode it compiles in; None: PyTensor's default, as
            ``pm.sample``'s NUTS takes it (``sampler_mode``).

    Returns:
        The ``ValueGradFunction``; its ``_pytensor_function`` takes a flat vector.
    """
    f = model.logp_dlogp_function(ravel_inputs=True, **({} if mode is None else {"mode": mode}))
    f.set_extra_values({})
    return f


def sampler_mode(sampler):
    """The PyTensor mode ``sampler`` compiles PyMC's model in, or None for PyTensor's default.

    nutpie compiles the model with Numba whatever PyTensor's default, so
    where that default is another (PyTensor 2.x: C), PyMC's own function
    timed for nutpie and run under it on the callback is compiled in Numba
    too: radon's call at 10^5 rows on PyMC 5.28 took 391 us in Numba, 726 in
    C (bench/pymc_gallery.py --parts e2e, 2026-12-06; docs/pymc.md).
    """
    if sampler == "nutpie" and compat.default_linker() != "numba":
        return "NUMBA"
    return None


def serial_call(fn):
    """``serial_logp_dlogp``'s function of a flat vector, as PyMC's leapfrog calls it."""
    return fn._pytensor_function


@contextlib.contextmanager
def serving(model, fn):
    """Within: ``pm.sample`` on ``model`` takes ``fn`` (``serial_logp_dlogp``'s) for its NUTS step.

    Only where the step asks for what ``fn`` is: the gradient of every value
    variable, raveled, compiled without other arguments (PyMC 5.28 would
    compile it again; PyMC 6 keeps a cache of its own, which this bypasses).
    """
    original = model.logp_dlogp_function
    names = [v.name for v in model.value_vars]

    def logp_dlogp_function(grad_vars=None, *args, ravel_inputs=None, dtype=None,
                            initial_point=None, **kwargs):
        whole = grad_vars is None or [v.name for v in grad_vars] == names
        if whole and ravel_inputs and not args and not kwargs and dtype in (None, fn.dtype):
            return fn
        return original(grad_vars, *args, ravel_inputs=ravel_inputs, dtype=dtype,
                        initial_point=initial_point, **kwargs)

    model.logp_dlogp_function = logp_dlogp_function
    try:
        yield
    finally:
        del model.logp_dlogp_function


def default_chains():
    """The chains ``pm.sample`` runs when not told: ``max(2, cores)``, cores ``min(4, CPUs)``."""
    from pymc.sampling.parallel import _cpu_count
    return max(2, min(4, _cpu_count()))


def scales_rows(rv):
    """Whether PyMC scales ``rv``'s logp by ``total_size / (its rows)`` on axis 0.

    PyMC 5.27-5.28 wrap an observed variable given ``total_size`` in a
    ``MinibatchRandomVariable`` whose inputs after the variable are the
    total sizes per axis (``NoneConst`` where none).
    """
    from pytensor.tensor.type_other import NoneConst

    node = rv.owner
    if node is None or type(node.op).__name__ != "MinibatchRandomVariable":
        return False
    return len(node.inputs) > 1 and not NoneConst.equals(node.inputs[1])


def rewrite_pregrad(cost):
    """PyMC's rewrites before taking a gradient (as its ValueGradFunction does)."""
    return _rewrite_pregrad(cost)


def pymc_mode(model, fast=False, base=None):
    """The mode PyMC compiles with: failed parameter checks give -inf (or are removed).

    Args:
        fast: a mode that compiles quickly (Python linker), for one-off checks.
        base: the PyTensor mode to start from (a name such as "NUMBA", or a
            ``Mode``); None: PyTensor's default, as PyMC uses.
    """
    from pytensor.compile.mode import Mode, get_mode

    check = ("local_check_parameter_to_ninf_switch" if model.check_bounds
             else "local_remove_check_parameter")
    base = get_mode("FAST_COMPILE" if fast else base)
    linker = "py" if fast else base.linker
    return Mode(linker=linker, optimizer=base.provided_optimizer.including(check))


class LogpDlogp:
    """What PyMC's NUTS reads from ``model.logp_dlogp_function()``: here, the batcher."""

    _raveled_inputs = True

    def __init__(self, batcher, dtype):
        self._batcher = batcher
        # PyMC's leapfrog calls _pytensor_function(q) at every step: the batcher itself,
        # no frame of ours in between.
        self._pytensor_function = batcher
        self.dtype = str(dtype)
        self._extra_vars_shared = {}
        self._extra_are_set = True
        self.trust_input = True

    def __call__(self, grad_vars, *, extra_vars=None):
        q = getattr(grad_vars, "data", grad_vars)
        if isinstance(q, (list, tuple)):
            q = q[0]
        return self._batcher(np.asarray(q, dtype=self.dtype))

    def set_extra_values(self, extra_vars):
        pass

    def get_extra_values(self):
        return {}


def _sample_many_together(batcher, model):
    """A ``_sample_many`` that runs every chain at once, each a greenlet on its own step copy."""

    def sample_many(*, draws, chains, traces, start, rngs, step, callback=None, **kwargs):
        # Copies made before any chain runs: each starts from the step's initial state,
        # as PyMC's sequential loop resets it; the model and the batcher stay shared.
        keep = {id(model): model, id(batcher): batcher}
        steps = [copy.deepcopy(step, memo=dict(keep)) for _ in range(chains)]
        manager = progress_manager_class()(
            step_method=step, chains=chains, draws=draws - kwargs.get("tune", 0),
            tune=kwargs.get("tune", 0), progressbar=kwargs.get("progressbar", True),
            progressbar_theme=kwargs.get("progressbar_theme", mcmc.default_progress_theme))

        def chain(i):
            return lambda: mcmc._sample(draws=draws, chain=i, start=start[i], step=steps[i],
                                        trace=traces[i], rng=rngs[i], callback=callback,
                                        progress_manager=manager, **kwargs)

        # What PyMC's set-up freed (initial points, traces compiled) goes back before the
        # chains' working set is made, and the chains' before PyMC converts the draws.
        trim_heap()
        with manager:
            errors, interrupted = batcher.run_together([chain(i) for i in range(chains)])
        trim_heap()
        if interrupted:
            logger.warning("sampling interrupted (KeyboardInterrupt): returning the draws made "
                           "so far (%s per chain)", [len(t) for t in traces])
            return
        first = next((e for e in errors if not _is_abort(e)), errors[0] if errors else None)
        if first is not None:
            raise first

    return sample_many


def progress_manager_class():
    """PyMC's progress bar manager for MCMC (5.28: MCMCProgressBarManager; 5.27: ProgressBarManager)."""
    return getattr(mcmc, "MCMCProgressBarManager", None) or mcmc.ProgressBarManager


def _is_abort(exc):
    from .batching import BatchAborted
    return isinstance(exc, BatchAborted)


_driving = [0]  # driving() contexts open: dp.sample's own calls never warn


def warn_when_pinned():
    """From now on, ``pm.sample`` warns where its chains would share a pinned master's core.

    A forked synkhronos master is pinned to one core (its ranks hold the
    others); PyMC's chain processes and nutpie's threads inherit that, so
    ``pm.sample`` called while forked would run every chain on one core.
    Installed once, by ``data_parallel()``; ``dp.sample`` is not affected.
    """
    if getattr(mcmc, "_synk_warns", False):
        return
    for name in ("_mp_sample", "_sample_external_nuts"):
        setattr(mcmc, name, _warns_pinned(getattr(mcmc, name)))
    mcmc._synk_warns = True


def _warns_pinned(original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not _driving[0]:
            from ...runtime.state import get_runtime
            rt = get_runtime()
            cores = os.sched_getaffinity(0)
            if (rt is not None and not rt.closed and rt.is_master and len(cores) == 1
                    and (os.cpu_count() or 1) > 1):
                warnings.warn(
                    f"pm.sample() while synkhronos is forked: this process is pinned to core "
                    f"{min(cores)} (its ranks hold the others), so every chain would share that "
                    "core; sample with dp.sample() instead, or call synk.close() first",
                    UserWarning, stacklevel=4)
        return original(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def driving(dp, sampler):
    """Within: ``pm.sample`` on ``dp.model`` samples with ``dp``'s data-parallel (logp, dlogp);
    nutpie is patched only for ``sampler`` "nutpie" (importing it takes 1.2 s on PyMC 6.4)."""
    model, batcher = dp.model, dp.batcher
    original = model.logp_dlogp_function

    def logp_dlogp_function(grad_vars=None, *args, ravel_inputs=None, **kwargs):
        whole = grad_vars is None or [v.name for v in grad_vars] == dp.value_names
        if whole and ravel_inputs and not args:
            return LogpDlogp(batcher, dp.dtype)
        return original(grad_vars, *args, ravel_inputs=ravel_inputs, **kwargs)

    saved_many = mcmc._sample_many
    nutpie_mod, saved_compile = _nutpie_module() if sampler == "nutpie" else (None, None)
    model.logp_dlogp_function = logp_dlogp_function
    mcmc._sample_many = _sample_many_together(batcher, model)
    if nutpie_mod is not None:
        nutpie_mod.compile_pymc_model = lambda m, **kw: nutpie_model(dp, batcher, **kw)
    _driving[0] += 1
    try:
        yield
    finally:
        _driving[0] -= 1
        del model.logp_dlogp_function
        mcmc._sample_many = saved_many
        if nutpie_mod is not None:
            nutpie_mod.compile_pymc_model = saved_compile


@contextlib.contextmanager
def driving_serial(dp, fn):
    """Within: ``pm.sample(nuts_sampler="nutpie")`` on ``dp.model`` samples with ``fn``
    (``serial_logp_dlogp``'s), called back from nutpie's threads one at a time."""
    call, lock = fn._pytensor_function, threading.Lock()

    def logp_dlogp(x):
        # One PyTensor function's storage serves one call at a time; the copy outlives the next.
        with lock:
            lp, g = call(x)
            return lp, np.array(g, dtype=np.float64)

    nutpie_mod, saved_compile = _nutpie_module()
    nutpie_mod.compile_pymc_model = lambda m, **kw: nutpie_model(dp, logp_dlogp, **kw)
    _driving[0] += 1
    try:
        yield
    finally:
        _driving[0] -= 1
        nutpie_mod.compile_pymc_model = saved_compile


def _nutpie_module():
    try:
        import nutpie
    except ImportError:
        return None, None
    return nutpie, nutpie.compile_pymc_model


def _expand_function(model, remaining, values):
    """(The function of the value variables to ``remaining``, its values at ``values``),
    compiled as nutpie compiles the model (``sampler_mode``), else in PyTensor's default.

    Where PyTensor's default is C, its first C compile in a process reads the
    whole compile cache, most of that compile's time, where Numba's reads only
    what it compiles; the function runs about as fast either way (one-off
    probes on PyMC 5.28, bench/HISTORY.md 2026-12-06).
    """
    if not remaining:
        return None, []
    mode = sampler_mode("nutpie")
    if mode is not None:
        try:
            with model:
                fn = pm.pytensorf.compile(model.value_vars, remaining, on_unused_input="ignore",
                                          mode=mode)
            return fn, fn(*values)   # Numba compiles at the first call
        except Exception as exc:  # noqa: BLE001 - an op Numba cannot compile: the default
            logger.debug("nutpie: the expansion in %s failed (%r); in the default mode", mode, exc)
    with model:
        fn = pm.pytensorf.compile(model.value_vars, remaining, on_unused_input="ignore")
    return fn, fn(*values)


def nutpie_model(dp, batcher, var_names=None, initial_points=None, jitter_rvs=None,
                 default_initialization_strategy="support_point", **unused):
    """A nutpie model (``from_pyfunc``) on ``batcher``: ``dp``'s batched (logp, dlogp), or
    another callable from a flat float64 vector to (logp, gradient)."""
    from nutpie.compiled_pyfunc import from_pyfunc

    model = dp.model
    names, shapes = list(dp.value_names), list(dp.value_shapes)
    remaining = [v for v in model.unobserved_value_vars if v.name not in names]
    if var_names is not None:
        remaining = [v for v in remaining if v.name in set(var_names)]
    point = model.initial_point()
    expand_fn, rem_values = _expand_function(model, remaining, [point[n] for n in names])
    rem_shapes = [tuple(np.shape(v)) for v in rem_values]
    all_names = names + [v.name for v in remaining]
    all_shapes = shapes + rem_shapes
    if jitter_rvs is None and default_initialization_strategy == "support_point":
        jitter_rvs = set(model.free_RVs)
    ip_fn = make_initial_point_fn(model=model, overrides=initial_points,
                                  default_strategy=default_initialization_strategy,
                                  jitter_rvs=jitter_rvs, return_transformed=True)
    lock = threading.Lock()

    def initial_point(seed):
        with lock:
            p = ip_fn(seed)
        return np.concatenate([np.asarray(p[n], dtype=np.float64).ravel() for n in names])

    def make_logp():
        if np.dtype(dp.dtype) == np.float64:
            # nutpie's position is a float64 vector and our gradient a fresh float64
            # copy: nothing to convert at each step.
            def logp(x, **shared):
                lp, g = batcher(x)
                return float(lp), g
        else:
            def logp(x, **shared):
                lp, g = batcher(x)
                return float(lp), np.asarray(g, dtype=np.float64, order="C")
        return logp

    def make_expand(seed1, seed2, chain):
        def expand(x, **shared):
            p = dp.unravel(np.asarray(x, dtype=dp.dtype))
            values = [p[n] for n in names]
            # nutpie's chains call this from threads of their own, and one PyTensor
            # function's storage is not for two at once (a censored model's draws failed so).
            with lock:
                extra = expand_fn(*values) if remaining else []
                return {n: np.array(v, dtype=np.float64, order="C").reshape(s)
                        for n, v, s in zip(all_names, [*values, *extra], all_shapes)}
        return expand

    # The coordinates, dims and hidden transformed variables as nutpie's own PyMC model has
    # them: 0.16.10 moved the transformed values out of the posterior (reparameterized_names).
    from nutpie import compile_pymc as nutpie_pymc

    slices, lo = [], 0
    for shape in all_shapes:
        size = int(np.prod(shape, dtype=int))
        slices.append(slice(lo, lo + size))
        lo += size
    shape_info = (all_names, slices, all_shapes)
    extra = {}
    if "reparameterized_names" in inspect.signature(from_pyfunc).parameters:
        hidden = [model.rvs_to_values[rv].name for rv in model.free_RVs
                  if model.rvs_to_transforms.get(rv) is not None]
        dims, coords = nutpie_pymc._prepare_dims_and_coords(model, shape_info, hidden)
        extra["reparameterized_names"] = hidden
    else:
        dims, coords = nutpie_pymc._prepare_dims_and_coords(model, shape_info)
    return from_pyfunc(dp.size, make_logp, make_expand, [np.dtype("float64")] * len(all_names),
                       all_shapes, all_names, coords=coords, dims=dict(dims),
                       make_initial_point_fn=initial_point, **extra)


def map_functions(model, value_names, shapes, dtype):
    """For ``find_map``: the Jacobian terms (value, flat grad) and the point's expansion.

    ``pm.find_MAP`` maximises the log-density without the transforms'
    Jacobians; the data-parallel log-density has them (as NUTS needs), so
    find_map subtracts them: the difference of the priors with and without.
    """
    x = pt.vector("x", dtype=str(dtype))
    free = list(model.free_RVs)
    jac = model.logp(vars=free, jacobian=True, sum=True) - model.logp(vars=free, jacobian=False,
                                                                          sum=True)
    replace, lo = {}, 0
    for v, shape in zip(model.value_vars, shapes):
        size = int(np.prod(shape, dtype=int))
        part = x[lo:lo + size].reshape(shape) if shape else x[lo]
        replace[v] = part.astype(v.dtype)
        lo += size
    jac_x = compat.clone_replace(jac, replace=replace)
    grad = pytensor.grad(jac_x, x, disconnected_inputs="ignore")
    jac_fn = pytensor.function([x], [jac_x, grad], mode=pymc_mode(model))

    def expand(point, include_transformed):
        from pymc.util import get_default_varnames
        outs = get_default_varnames(model.unobserved_value_vars, include_transformed)
        values = model.compile_fn(inputs=model.value_vars, outs=outs)(point)
        return {v.name: value for v, value in zip(outs, values)}

    return jac_fn, expand
