"""DataParallelModel: a PyMC log-density and its gradient, summed over ranks, many positions a call.

The calls themselves (one position, or many vectorised, in a loop or one by one) are
``calls.Calls``'s job; this module builds the graphs, places the rows and
offers the PyMC-facing surface (evaluations, scatter, ravel and unravel,
find_map, sample).  Over 400 lines: one job, the object a PyMC user holds.  What could
change apart already lives apart (the terms and their checks in ``terms``,
``selections`` and ``rowcheck``, the graphs in ``graphs``, the calls in ``calls``, the
decision in ``crossover`` and ``decision``, sampling in ``sampling``); what stays is
the surface those share (its rows and their scatter, the flat position, the
evaluations), each a few lines over the state of its one instance.
"""

import importlib.util
import logging
import weakref

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk

from ... import compat
from . import calls as calls_mod
from . import branches, crossover, graphs, internals, modes, rowcheck, selections, terms
from .batching import Batcher

logger = logging.getLogger(__name__)


# The modes the ranks may compile in: unless told, the first data-parallel evaluation
# times the rank's graph in each and keeps the faster (modes.py).  Where the master does
# not hold the rows to time it on (several machines, rows given as synk.Data), Numba, as
# nutpie compiles: per row it ran PyMC's own graph and the rank's in 0.3-0.8x the time of C
# code on a logistic regression and a radon-style model at 10^5 rows (bench/pymc_calls.py
# --parts modes), though 5x slower on a dense one of 55 covariates (issue 47).  JAX is
# measured where it is installed (modes.measurable).
DEFAULT_MODE = "NUMBA"
MODES = ("NUMBA", "CVM", "JAX")


# pm.Data container -> a weak reference to the shared array it was given (DataParallelModel._point_at).
_POINTED = weakref.WeakKeyDictionary()


def _rank_mode(mode):
    """The PyTensor mode of the rank's graphs: a name from ``MODES`` or a ``Mode``; None
    to measure."""
    if mode is None or not isinstance(mode, str):
        return mode
    if mode.upper() not in MODES:
        raise ValueError(f"data_parallel: mode must be one of {', '.join(MODES)}, a PyTensor "
                         f"Mode or None; got {mode!r}")
    if mode.upper() == "JAX" and importlib.util.find_spec("jax") is None:
        raise ValueError("data_parallel: mode='JAX' needs jax installed (pip install "
                         "'synkhronos[jax]'); got mode='JAX' without it")
    return mode.upper()


def _is_jax(mode):
    """Whether ``mode`` (``_rank_mode``'s) compiles with JAX, whose jit needs every shape fixed
    (no rows picked by positions found at run time: ``branches``)."""
    return mode == "JAX" or "jax" in type(getattr(mode, "linker", None)).__name__.lower()


class DataParallelModel:
    """The data-parallel log-density and gradient of one PyMC model.  Master only.

    Built by ``data_parallel(model)``.  Points are point dicts, as
    ``model.initial_point()`` returns them (value variables in the
    transformed space, e.g. ``sigma_log__``), or flat vectors in the order of
    ``value_names`` (see ``ravel``/``unravel``); gradients are flat in that
    order, as ``model.compile_dlogp()`` returns them.

    Attributes:
        model: the PyMC model.
        containers: what is split by rows: ``pm.Data`` containers, and NumPy arrays
            of the likelihood with one row per observation (``terms.Lifted``).
        whole: the containers every rank reads whole.
        n_rows: rows of the split data.
        value_names, size, dtype: the flat parameter vector.
        mode: the PyTensor mode the rank's graphs compile in ("NUMBA", "CVM", "JAX" or a
            ``Mode``); where ``data_parallel(mode=None)``, the fastest on this model,
            measured at the first data-parallel evaluation (None before).
        split: ``data_parallel``'s ``split`` (None: measured at the first ``sample``).
        decision: what the last ``sample`` chose (``crossover.Decision``), None before.
        serials: PyMC's own (logp, dlogp) (``crossover.Serial``) by mode, each compiled at
            the first decision that asks for it.
    """

    def __init__(self, model, data, unsplit, name, mode=None, split=None):
        try:
            synk.layout()
        except synk.SynkStateError:
            raise synk.SynkStateError("data_parallel() needs synk.fork() first") from None
        asked = _rank_mode(mode)
        self.split = crossover.check_split(split)
        self.decision = None     # what the last sample() chose (crossover.Decision)
        self.decisions = {}      # crossover.decide's, per rows, sampler, chains and cores
        self.serials = {}        # mode -> PyMC's own (logp, dlogp), compiled at a decision
        self.typical_x = None    # where the first decision timed its calls (trials.settled)
        self.run_calls = None    # the one-position graph's calls in the run dp.sample decides for
        self.model = model
        if not model.observed_RVs and not model.potentials:
            raise ValueError("data_parallel: the model has no likelihood (no observed "
                             "variables and no pm.Potential)")
        value_vars = list(model.value_vars)
        discrete = [v.name for v in value_vars
                    if not np.issubdtype(np.dtype(v.dtype), np.floating)]
        selections.refuse_discrete_imputed(model, discrete)
        if discrete:
            raise ValueError(
                f"data_parallel: free variables {discrete} are discrete, and NUTS (what "
                "dp.sample drives) needs the gradient of every free variable. Marginalize "
                f"them out (pymc_extras.marginalize(model, {discrete}) for a finite "
                "discrete variable, or sum over its values in a pm.Potential / pm.Mixture), "
                "or sample this model with pm.sample, whose compound steps (NUTS with "
                "Metropolis) take discrete variables, serially")
        point = self._point0 = model.initial_point()   # each initial_point() compiles a function
        self.value_names = [v.name for v in value_vars]
        self._shapes = [tuple(np.shape(point[n])) for n in self.value_names]
        self._sizes = [int(np.prod(s, dtype=int)) for s in self._shapes]
        self._dtypes = [np.dtype(v.dtype) for v in value_vars]
        self.dtype = np.result_type(*self._dtypes) if value_vars else np.dtype("float64")
        self.size = sum(self._sizes)

        given = data if isinstance(data, dict) else None
        all_terms = terms.model_terms(model)
        terms.refuse_random_draws(all_terms)
        plan = terms.choose(model, all_terms, list(given) if given else data, unsplit,
                            lift=not given, point=point)
        selections.refuse_imputed_reads(model, plan)
        terms.refuse_numpy_rows(model, plan)
        rowcheck.check_rows(model, plan, value_vars, self._check_point,
                            internals.pymc_mode(model, fast=True))
        self._plan = plan
        self.containers = plan.split
        self.whole = plan.whole
        self._given = terms.given_data(given, plan) if given else None
        self.n_rows = len(self._given[0]) if self._given else plan.n_rows

        # Whole containers: our own copies, so that the model's containers never
        # enter synkhronos's registry (and pm.set_data is seen and sent on).
        self._whole_copies = {c: pytensor.shared(np.array(c.get_value(borrow=True)), name=c.name)
                              for c in plan.whole}
        self._n_total = pytensor.shared(np.float64(self.n_rows), name="n_rows_total")
        inputs = self._inputs = graphs.row_inputs(plan.split)
        n_sym = pt.dscalar("n_total")
        split_exprs, whole_expr, frac = graphs.rank_terms(
            model, plan, inputs, self._whole_copies, n_sym,
            by_class=not self._given and not _is_jax(asked),
            sort=synk.layout().n_machines == 1)   # a chunked call then balances the ranks
        logp = graphs.rank_logp(split_exprs, whole_expr, frac, self.dtype)
        logp = compat.clone_replace(logp, replace={n_sym: self._n_total})
        self.rank_logp = logp    # what a rank's graphs are made from (decisions kept are keyed by it)
        # A lone position (one chain, find_map, logp_dlogp) runs PyMC's own graph on the
        # rank's rows; several run either the graph vectorised over them or a loop of the
        # one-position graph, whichever this model runs faster (calls.Calls).
        position = pt.vector("position", dtype=self.dtype)
        positions = pt.matrix("positions", dtype=self.dtype)
        measured = asked is None and not self._given and synk.layout().n_machines == 1
        names = modes.measurable(MODES) if measured else [DEFAULT_MODE if asked is None else asked]
        if measured and branches.picks_rows(logp):   # JAX's jit cannot: not compiled in vain
            names = tuple(n for n in names if n != "JAX") or (DEFAULT_MODE,)
        rank_modes = {m: modes.rank_mode(model, m) for m in names}
        self.rank_modes = tuple(names)   # the modes its graphs may run in (asked, or measured)
        try:
            ways = calls_mod.register(inputs, position, positions, logp, value_vars,
                                      self._shapes, internals.rewrite_pregrad, rank_modes, name)
        except synk.SynkStateError as exc:
            raise synk.SynkStateError(f"data_parallel() must come after synk.fork() and "
                                      f"before synk.distribute() ({exc})") from None

        def begin():
            # A list, as the one-position function's outputs: the master keeps the function
            # measured for the mode kept (calls.measured).
            one = [graphs.joined(logp, value_vars, self._shapes, position,
                                 pregrad=internals.rewrite_pregrad)]
            rows = [d.data for d in self._data]
            return modes.begin(inputs, position, one, rows, self.initial_x().astype(self.dtype),
                               synk.layout().n_parallel, rank_modes, calls=self.run_calls)

        def fastest():
            measuring, self._measuring = self._measuring or begin(), None
            # Timed where the sampler's draws go: the decision's position, else near the mode.
            given = self.typical_x is not None
            return calls_mod.measured(ways, measuring,
                                      self.typical_x.astype(self.dtype) if given else None,
                                      settle=not given)
        self._begin = begin if measured else None
        self._measuring = None       # the modes' measuring, begun early (begin_measuring)
        self._data = None
        self._scattered = False      # scatter() done once (the first evaluation does it)
        self._seen = {}
        self._n_sent = self.n_rows   # the value distribute() sends
        if not self._given and synk.layout().n_machines == 1:
            # On one machine the rows go into shared memory now, before distribute()
            # starts the workers, and the model's containers then hold the shared
            # arrays: the master's own copy is freed, and the workers, forked from it,
            # never map it (one copy of the rows, not two).  scatter() sends the rest.
            self._data = self._shared_rows()
        self._calls = calls_mod.Calls(ways, self.size, self.dtype,
                                      held=synk.layout().n_machines == 1,
                                      fastest=fastest if measured else None)
        self.batcher = Batcher(self._calls.many, one=self._calls.one)
        self.map_fns = None          # find_map's (sampling.find_map), built at its first call
        logger.info("pymc model: %d value variables (%d numbers), %s split by rows (%d), "
                    "%s whole; terms split %s, whole %s", len(value_vars), self.size,
                    [c.name for c in plan.split], self.n_rows, [c.name for c in plan.whole],
                    [t.name for t in plan.split_terms], [t.name for t in plan.whole_terms])

    @property
    def built(self):
        """Whether the ranks' graph was built (a data-parallel evaluation ran)."""
        return self._calls.built

    def begin_measuring(self):
        """Start measuring the ranks' graph's modes, where its first evaluation would: the
        child compiling the other modes aside starts now (``modes.Measuring``), and that
        evaluation finishes it.  ``end_measuring`` stops it where nothing is evaluated."""
        if self._begin is not None and self._measuring is None and self._calls.mode is None:
            self._measuring = self._begin()

    def end_measuring(self):
        """Stop a measuring begun early and not finished (nothing evaluated after all)."""
        measuring, self._measuring = self._measuring, None
        if measuring is not None:
            measuring.cancel()

    @property
    def mode(self):
        """The mode the rank's graphs run in; None until the first evaluation measured it."""
        return self._calls.mode

    @property
    def mode_seconds(self):
        """{mode: seconds} the rank's one-position graph took on a rank's rows where the
        mode was measured (``modes.fastest``), else empty."""
        return dict(self._calls.mode_seconds)

    @property
    def first_call_s(self):
        """Seconds the first data-parallel call at one position took (each rank compiling its
        graph), or None where none was the first evaluation."""
        return self._calls.first_s

    @property
    def chunk_fit(self):
        """How the one-position call's rows were cut into chunks where timed (a
        ``Function.chunk_fit``: each chunk's fixed cost beside its rows), else None."""
        return self._calls.fn1.chunk_fit if self._calls.built else None

    @property
    def given(self):
        """Whether the rows came as ``synk.Data`` (``data=`` a dict): only the ranks hold them."""
        return bool(self._given)

    @property
    def separate_calls(self):
        """Whether several positions go in a call each, no many-position graph compiled
        (``crossover.Decision.separate``, set by each ``sample``)."""
        return self._calls.separate

    @separate_calls.setter
    def separate_calls(self, flag):
        self._calls.separate = bool(flag)

    @property
    def value_shapes(self):
        """The shape of each value variable, in ``value_names`` order (the flat vector's parts)."""
        return [tuple(s) for s in self._shapes]

    # -- data -------------------------------------------------------------------------------
    def _check_point(self, i):
        """The i-th point the row check tries: the initial point, then jittered ones."""
        point = self._point0
        if i == 0:
            return point
        rng = np.random.default_rng(i)
        return {k: np.asarray(v + rng.uniform(-1, 1, size=np.shape(v)), dtype=np.asarray(v).dtype)
                for k, v in point.items()}

    def scatter(self):
        """Put the rows of the split containers in shared memory, once.  Master only.

        Called by the first evaluation if you have not; call it again after
        ``pm.set_data`` (an evaluation that finds changed data raises
        ``SynkStateError`` until you do; ``sample()`` and ``find_map()`` call it).

        Raises:
            SynkStateError: before ``synk.distribute()``.
        """
        if self._given:
            self._data = self._given
        else:
            values = [c.get_value(borrow=True) for c in self.containers]
            if self._data is None:
                self._data = self._shared_rows()
            else:
                for d, c, v in zip(self._data, self.containers, values):
                    if v is not d.data and not isinstance(c, terms.Lifted):  # pm.set_data
                        d.set_value(v)
                        self._point_at(c, d)
            self.n_rows = len(values[0])
        changed = [(copy, c.get_value(borrow=True)) for c, copy in self._whole_copies.items()
                   if self._seen and self._seen.get(c) is not c.get_value(borrow=True)]
        if changed:
            synk.broadcast([cp for cp, _ in changed], [v for _, v in changed])
        if self._n_sent != self.n_rows:
            synk.broadcast(self._n_total, np.float64(self.n_rows))
            self._n_sent = self.n_rows
        self._seen = {c: c.get_value(borrow=True) for c in [*self.containers, *self.whole]}
        self._calls.reset(self._data)  # the balance between the ways moves with the rows
        self._scattered = True

    def _shared_rows(self):
        """A Data per split container, holding its rows; on one machine the container then holds its array."""
        out = []
        for c, inp in zip(self.containers, self._inputs):
            d = synk.data(c.get_value(borrow=True), var=inp, name=f"pymc:{c.name}")
            self._point_at(c, d)
            out.append(d)
        return out

    def _point_at(self, container, d):
        """On one machine: ``container`` holds ``d``'s shared array, its own copy freed.

        Not if it already holds another DataParallelModel's (of the same model): that
        one would see its rows changed.
        """
        if synk.layout().n_machines != 1 or isinstance(container, terms.Lifted):
            return  # a lifted array stays a constant of the model's graph
        held = _POINTED.get(container)
        if held is not None and held() is container.get_value(borrow=True):
            return
        arr = d.data
        container.set_value(arr, borrow=True)
        _POINTED[container] = weakref.ref(arr)

    def _stale(self):
        """Names of containers changed (pm.set_data) since the last scatter()."""
        if self._given:
            return []
        return [c.name for c in (*self.containers, *self.whole)
                if self._seen.get(c) is not c.get_value(borrow=True)]

    def _ready(self, where):
        if not self._scattered:
            self.scatter()
            return
        stale = self._stale()
        if stale:
            raise synk.SynkStateError(
                f"{where}: pm.Data {stale} changed (pm.set_data) since dp.scatter(); the ranks "
                "still hold the old rows. Call dp.scatter() to send the new ones")

    def logp_dlogp_many(self, positions):
        """Return ``(logps, grads)`` at many positions (a k x size matrix), in one call where
        that measured faster than a call at each.

        Each row of the result equals ``model.compile_logp()`` /
        ``model.compile_dlogp()`` at that position on the whole data set.
        """
        P = np.asarray(positions, dtype=self.dtype)
        if P.ndim != 2 or P.shape[1] != self.size:
            raise ValueError(f"logp_dlogp_many: positions must have shape (k, {self.size}); "
                             f"got {P.shape}")
        self._ready("DataParallelModel.logp_dlogp_many")
        return self._calls.many(P)

    def logp_dlogp(self, point):
        """Return ``(logp, dlogp)`` at ``point`` (a point dict or flat vector), one call."""
        x = self._flat(point)
        self._ready("DataParallelModel.logp_dlogp")
        return self._calls.one(x)

    def logp(self, point):
        """Return the log-density at ``point``; equals ``model.compile_logp()(point)``."""
        return self.logp_dlogp(point)[0]

    def dlogp(self, point):
        """Return the flat gradient at ``point``; equals ``model.compile_dlogp()(point)``."""
        return self.logp_dlogp(point)[1]

    def neg_logp_dlogp(self, x):
        """Return ``(-logp, -dlogp)`` as float64: ``scipy.optimize.minimize(..., jac=True)``."""
        lp, g = self.logp_dlogp(x)
        return -float(lp), -np.asarray(g, dtype=np.float64)

    # -- points -----------------------------------------------------------------------------
    def ravel(self, point):
        """Return the flat vector of a point dict (keys: ``value_names``)."""
        missing = [n for n in self.value_names if n not in point]
        if missing:
            raise ValueError(f"point lacks value variables {missing}")
        if not self.value_names:
            return np.zeros(0, self.dtype)
        return np.concatenate([np.asarray(point[n], dtype=self.dtype).ravel()
                               for n in self.value_names])

    def unravel(self, x):
        """Return the point dict of a flat vector."""
        x = np.asarray(x)
        if x.shape != (self.size,):
            raise ValueError(f"x must have shape ({self.size},); got {x.shape}")
        out, lo = {}, 0
        for n, shape, size, dtype in zip(self.value_names, self._shapes, self._sizes,
                                         self._dtypes):
            out[n] = x[lo:lo + size].reshape(shape).astype(dtype)
            lo += size
        return out

    def initial_x(self):
        """Return the model's initial point (as ``data_parallel()`` found it) as a flat float64 vector."""
        return self.ravel(self._point0).astype(np.float64)

    def _flat(self, point):
        if isinstance(point, dict):
            return self.ravel(point)
        x = np.asarray(point, dtype=self.dtype)
        if x.shape != (self.size,):
            raise ValueError(f"x must have shape ({self.size},); got {x.shape}")
        return x

    # -- PyMC's own calls -------------------------------------------------------------------
    def find_map(self, start=None, method="L-BFGS-B", return_raw=False, include_transformed=True,
                 maxeval=5000, **kwargs):
        """Find the maximum a posteriori point as ``pm.find_MAP`` does, data-parallel.

        Like ``pm.find_MAP``, it maximises the log-density without the
        Jacobians of the transforms and returns the point with every
        unobserved variable (transformed ones too unless told otherwise).

        Args:
            start: a point dict (value variables) to start from; default the
                model's initial point.
            method: a gradient-based ``scipy.optimize.minimize`` method.
            return_raw: also return scipy's ``OptimizeResult``.
            include_transformed: include the transformed variables (``sigma_log__``).
            maxeval: most evaluations (``options["maxiter"]`` unless given).
            **kwargs: passed on to ``scipy.optimize.minimize``.

        Returns:
            The point dict, or ``(point, OptimizeResult)`` with ``return_raw``.
        """
        from .sampling import find_map

        self._refresh("DataParallelModel.find_map")
        return find_map(self, start, method, return_raw, include_transformed, maxeval, **kwargs)

    def _refresh(self, where):
        if not self._scattered or self._stale():
            self.scatter()

    def sample(self, draws=1000, *, tune=None, chains=None, nuts_sampler=None, random_seed=None,
               **kwargs):
        """Sample the posterior as ``pm.sample`` does, every chain in one data-parallel call per step.

        Takes the installed ``pm.sample``'s arguments and returns what it
        returns (PyMC 6: an ArviZ ``DataTree``; PyMC 5: an
        ``arviz.InferenceData``), with the same groups, sample statistics,
        convergence checks and progress bar.  The chains run together in this
        process (PyMC's NUTS: greenlets of the calling thread; nutpie: its
        threads); each step of every chain is one call over all ranks.  As
        ``pm.sample``: ``chains`` defaults to ``max(2, min(4, CPUs))``, PyMC 6
        picks nutpie where it is installed and the mode allows it, and Ctrl-C
        stops the chains and returns the draws made so far (PyMC's NUTS).
        ``cores=`` and ``model=`` (other than ``dp.model``) are ignored with a
        warning saying why.

        Unless ``data_parallel(split=...)`` said, the first call of a set-up
        predicts the run split and not (``crossover``) and, where splitting
        would not gain, runs ``pm.sample`` itself on PyMC's (logp, dlogp)
        compiled for the prediction (its chains on the cores this process
        had before ``fork()``, or ``cores=``; with nutpie, nutpie on that
        function where that beats nutpie compiling its own), saying so in
        one warning; ``dp.decision`` holds the choice.

        ``dp.batcher.calls`` and ``dp.batcher.positions`` count the data-parallel
        calls and the positions they evaluated since this call began (reset by
        each ``sample``).

        Args:
            tune: tuning steps; None: ``pm.sample``'s default.
            chains: chains to run; None: as ``pm.sample``.
            nuts_sampler: ``"pymc"`` (PyMC's NUTS), ``"nutpie"`` (needs nutpie) or
                None: as the installed ``pm.sample`` chooses.
            **kwargs: any other ``pm.sample`` argument (``init``, ``target_accept``,
                ``var_names``, ``idata_kwargs``, ``backend``, ``nuts``...).

        Raises:
            ValueError: a sampler other than "pymc" or "nutpie", or a ``step``.
            ImportError: nutpie asked for and not installed.
        """
        from .sampling import sample

        self._refresh("DataParallelModel.sample")
        return sample(self, draws=draws, tune=tune, chains=chains, nuts_sampler=nuts_sampler,
                      random_seed=random_seed, **kwargs)
