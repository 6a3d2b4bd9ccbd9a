"""Which PyTensor mode a model's rank graph runs fastest in, measured on a rank's share of its rows.

No one mode wins for every model: on a logistic regression of 581,012 rows x
55 covariates a rank's (logp, dlogp) ran 5x faster in C (the cvm linker: BLAS's
gemv, fused loops) than in Numba, and on a radon-style model, indexed per
row, 4.8x faster in Numba (issue 47, bench/pymc_calls.py --parts ratio).  So
where ``data_parallel(mode=None)``, the first data-parallel evaluation
compiles the one-position graph in each mode, times it on as many rows as
one rank holds, near the model's mode (``trials.settled``: a row's cost
moves with the position), and keeps the faster; only that mode's functions are then
built on the ranks.  The master compiles the first mode while a child
process compiles the others on the ranks' cores, idle then, the master taking
its share of them once its own is compiled; the two then time them in turns,
swapping cores (``trials``).  A mode whose graph Numba could compile only in
object mode simply measures slow.  Where the first mode already runs in less
than ``SMALL_S`` on a rank's rows, it is kept and the child is stopped: a
faster mode could not save what compiling it costs (unless Numba runs an op of
it in object mode: then every mode is measured).

JAX (XLA's CPU code) is measured too where JAX is installed and no JAX
backend has started in the master: XLA vectorises the transcendental
functions a likelihood spends its rows on, and a logistic regression's
data-parallel call at 10^5 rows ran 2.0x faster in JAX than in Numba (PyMC
6.4, bench/pymc_calls.py --parts ratio, bench/RESULTS.md).  A started backend
owns threads that a forked process lacks, so the workers, forked from the
master, could not run it, and the child measuring aside could not either (then
the master measures JAX itself).  A mode whose graph does not compile (an op
PyTensor's JAX backend lacks) is left out, and said so at debug level.

A measurement is kept on disk (``KEPT`` in PyTensor's compile
directory, where PyTensor keeps its compiled code), keyed by the graph, the
rows a rank holds, the modes, the PyTensor and Numba versions and the CPU, so
that the same model started again compiles only the mode kept: the loser's
compile and the timing were 0.2-0.7 s of a warm start (and several seconds of
a cold one).  Delete the file to measure again.
"""

import importlib.util
import logging
import math
import mmap
import os
import warnings

import numpy as np

from ...functions.measures import MeasureFile, digest, graph_text
from ...runtime.devices import jax_initialised
from . import internals, rowsums, scalars, trials

logger = logging.getLogger(__name__)

CLEAR_WIN = 0.9
"""Another mode than the first is kept only where its graph ran in at most this share of the
first's time: closer, the timing's spread decides, and the first (Numba) is the quicker to
start from warm caches (each rank loads PyTensor's cache of C modules at its first C call)."""


SMALL_S = 50e-6
"""A rank graph whose first mode runs in less than this on a rank's rows keeps that mode, the
others not compiled: another could save at most this much a call (1 s over 20,000 calls),
where compiling it costs seconds cold.  The eight schools (4 rows a rank) and a logistic
regression (500) compiled C in 8.3 and 8.2 s, JAX in 1.1 and 0.9 s, beside Numba's 5.1
and 7.0 s, and both ran slower than Numba's 10 and 25 us: C 14 and 34 us, JAX 53 and
56 (PyMC 6.4, Intel Xeon VM, 2026-12-06, bench/HISTORY.md)."""

SMALL_RUN_S = 2.0
"""Where the run's length is known (``dp.sample``: its calls of the one-position graph), a
first mode whose calls would take less than this over the whole run keeps that mode, the
others not measured: another mode could save at most this (it would have to run in no
time), while measuring them delayed the first call by 1.5-3 s at 10^5 rows (the child
compiling C and JAX on the ranks' core, 3.5-5.9 s of work beside the rank's own build:
a robust regression on PyMC 5.28, Numba's call 199 us, 1.7 s over 200 + 200 draws;
bench/HISTORY.md, 2026-12-08).  Not kept on disk: a longer run measures them."""

TIME_FIRST_S = 0.01
"""Seconds the first mode's graph is timed for, alone, to compare it with ``SMALL_S``."""


MODES_ENV = "SYNK_PYMC_MODES"
"""Names the modes measured, comma-separated (all of them where unset): a process that must
not start JAX (it forks later, as a test suite's does) leaves JAX out."""


def measurable(names):
    """Of ``names``, those measured: the ones ``SYNK_PYMC_MODES`` names (all where unset),
    and JAX only where it is installed and has not started a backend in this process (the
    workers, forked from it, would hang at their first JAX call)."""
    asked = os.environ.get(MODES_ENV, "").strip()
    if asked:
        wanted = {n.strip().upper() for n in asked.split(",") if n.strip()}
        if not wanted or not wanted <= set(names):
            raise ValueError(f"{MODES_ENV} must name modes among {', '.join(names)}, "
                             f"comma-separated; got {asked!r}")
        names = tuple(n for n in names if n in wanted)
    usable = tuple(n for n in names if n != "JAX"
                   or (importlib.util.find_spec("jax") is not None and not jax_initialised()))
    if not usable:
        logger.warning("pymc model: JAX, the one mode %s names, cannot run here (not installed, "
                       "or started before the workers were forked): the ranks run in NUMBA",
                       MODES_ENV)
    return usable or ("NUMBA",)


def rank_mode(model, name):
    """The PyTensor mode a rank's graph of ``model`` compiles in for mode ``name`` ("NUMBA",
    "CVM", "JAX"): PyMC's own (``internals.pymc_mode``), in Numba with a loop over rows and
    its sums in one pass under PyTensor 2 (``rowsums``) and the C library's ``log1p`` and
    kin as vectorised loops (``scalars``)."""
    return scalars.in_numba(rowsums.with_row_sums(internals.pymc_mode(model, base=name)))


def fastest(inputs, position, output, arrays, x, n_parts, modes, settle=False):
    """The name of the fastest of ``modes`` for ``output`` on a rank's rows (the first, unless
    another wins clearly: ``CLEAR_WIN``), and each one's seconds: ``begin(...).finish()``.

    Args:
        inputs: the graph's row inputs, ``arrays`` their values (every row).
        position: the graph's position input, ``x`` its value.
        output: the one-position graph.
        n_parts: how many ranks share the rows (each holds about 1 / n_parts of them).
        modes: mode name -> the PyTensor mode to compile in.
        settle: ``output`` is ``[logp, *gradient]`` (``graphs.joined``) and ``x`` the
            initial point: the modes are timed at a position near the mode instead
            (``trials.settled``, climbing on the first mode's graph on a rank's rows).
    """
    return begin(inputs, position, output, arrays, x, n_parts, modes).finish(settle=settle)


def begin(inputs, position, output, arrays, x, n_parts, modes, calls=None):
    """A ``Measuring`` of ``modes`` for ``output`` (``fastest``'s arguments): the child that
    compiles the other modes on the ranks' cores starts now, where anything is measured.
    ``calls``: how many times the run will call the graph, where known (``SMALL_RUN_S``)."""
    rows = max(1, -(-len(arrays[0]) // n_parts))
    # The position in memory shared with the child measuring aside: moved (finish's x, or
    # settle) after the fork, before the child's first turn.
    shared = np.frombuffer(mmap.mmap(-1, max(1, np.asarray(x).nbytes)), dtype=np.asarray(x).dtype,
                           count=np.size(x)).reshape(np.shape(x))
    shared[...] = x
    args = [np.asarray(a[:rows]) for a in arrays] + [shared]
    key = _key(output, args, modes)
    known = _cached(key) if key is not None else None
    helper = None
    if known is None:
        # JAX started here (an earlier model's ranks run in it): a forked child would hang in it.
        aside = {n: m for n, m in list(modes.items())[1:] if n != "JAX" or not jax_initialised()}
        helper = trials.measure_aside(inputs, position, output, aside, args)
    return Measuring(inputs, position, output, modes, rows, shared, args, key, known, helper,
                     calls)


class Measuring:
    """The modes of a rank's graph being measured: begun (``begin``: the child compiling the
    other modes aside, on the ranks' cores), then finished in the master (``finish``) or
    given up (``cancel``).

    Begun early, the child compiles while the master does something else of its own:
    ``crossover.decide`` begins it before compiling PyMC's function (a core's work for
    0.7-3.4 s at 10^5 rows: bench/HISTORY.md, 2026-12-07), so that the modes
    are compiled by then, not after it.
    """

    def __init__(self, inputs, position, output, modes, rows, shared, args, key, known, helper,
                 calls=None):
        self.inputs, self.position, self.output, self.modes = inputs, position, output, modes
        self.rows, self.shared, self.args, self.key = rows, shared, args, key
        self.known, self.helper = known, helper
        self.compiled = {}   # mode -> the function the master compiled and timed (finish)
        self.calls = calls   # the run's calls of the graph, where known (SMALL_RUN_S)

    def cancel(self):
        """Stop the child measuring aside, where any (nothing is measured)."""
        helper, self.helper = self.helper, None
        trials.stop(helper)

    def finish(self, x=None, settle=False):
        """The fastest mode's name and each mode's seconds (see ``fastest``), timed at ``x``
        where given, else at ``begin``'s position (``settle``: near the mode from there)."""
        if self.known is not None:
            best, seconds = self.known
            logger.info("pymc model: the ranks' graph runs in %s (%s on %d rows, measured by "
                        "an earlier run: %s)", best, ", ".join(f"{m} {s * 1e6:.0f} us"
                                                               for m, s in seconds.items()),
                        self.rows, cache_path())
            return best, seconds
        if x is not None:
            self.shared[...] = x
        helper, self.helper = self.helper, None
        inputs, position, output, modes, args = (self.inputs, self.position, self.output,
                                                 self.modes, self.args)
        first = next(iter(modes))
        fns, compile_s, failed = {}, {}, set()
        try:
            (fns[first], compile_s[first]), in_object_mode = _compiled_first(
                inputs, position, output, modes[first], args)
            if settle:
                self.shared[...] = trials.settled(_split(fns[first], args[:-1], self.shared.dtype),
                                                  self.shared)
            # Timed while the child may still compile beside it: slower, if anything.
            alone = (trials.trial(fns[first], args, TIME_FIRST_S)
                     if SMALL_S > 0 and len(modes) > 1 and not in_object_mode else math.inf)
            over_run = math.inf if self.calls is None else alone * self.calls
            if alone < SMALL_S or over_run < SMALL_RUN_S:
                trials.stop(helper)
                if alone < SMALL_S:
                    logger.info("pymc model: the ranks' graph runs in %s (%.1f us on %d rows, "
                                "less than the %.0f us where another mode could matter: no "
                                "other measured)", first, alone * 1e6, self.rows, SMALL_S * 1e6)
                    if self.key is not None:
                        _store(self.key, first, {first: alone})
                else:
                    logger.info("pymc model: the ranks' graph runs in %s (%.1f us on %d rows, "
                                "%.1f s over the run's %d calls, less than the %.0f s where "
                                "another mode could matter: no other measured)", first,
                                alone * 1e6, self.rows, over_run, self.calls, SMALL_RUN_S)
                self.compiled = fns
                return first, {first: alone}
            # Then what the child has not begun (never JAX: see trials.Claims).
            while helper is not None and (name := helper.claims.take(trials.Claims.MASTER)):
                built = trials.compiled(inputs, position, output, modes[name], args, optional=True)
                if built is None:
                    failed.add(name)
                else:
                    fns[name], compile_s[name] = built
        except BaseException:
            trials.stop(helper)
            raise
        seconds, by_child = trials.turns(helper, fns, args) if helper is not None else ({}, {})
        for name, (s, c) in by_child.items():
            seconds[name], compile_s[name] = s, c
        for name in failed:
            seconds[name], compile_s[name] = math.inf, math.nan
        late = {}
        for name, mode in modes.items():
            if name not in seconds and name not in fns:  # no child, or it failed: here, then
                built = trials.compiled(inputs, position, output, mode, args, optional=True)
                if built is None:
                    seconds[name], compile_s[name] = math.inf, math.nan
                else:
                    late[name], compile_s[name] = built
        self.compiled = {**fns, **late}
        if late or helper is None:   # the master's modes, all of them, in turns among themselves
            seconds.update(trials.turns(None, self.compiled, args)[0])
        for name in modes:
            logger.debug("pymc model: the ranks' graph in %s: %.1f us on %d rows (compiled in "
                         "%.2f s)", name, seconds[name] * 1e6, self.rows, compile_s[name])
        # A mode that did not compile is no candidate (nor kept as one).
        seconds = {name: seconds[name] for name in modes if math.isfinite(seconds[name])}
        best = kept(seconds)
        logger.info("pymc model: the ranks' graph runs in %s (%s on %d rows)", best,
                    ", ".join(f"{m} {s * 1e6:.0f} us" for m, s in seconds.items()), self.rows)
        if self.key is not None:
            _store(self.key, best, seconds)
        return best, seconds


OBJECT_MODE = "Numba will use object mode"
"""How PyTensor's warning begins where Numba runs an op of a graph in object mode (Python)."""


def _compiled_first(inputs, position, output, mode, args):
    """The first mode's function and its compile seconds (``trials.compiled``), and whether
    Numba runs an op of it in object mode: then the other modes are measured however fast
    it runs (object mode is never kept unmeasured where a compiled backend may run).
    PyTensor's warnings are passed on as they would have been."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        built = trials.compiled(inputs, position, output, mode, args)
    for w in said:   # under the filters outside, as if never caught
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    in_object_mode = any(str(w.message).startswith(OBJECT_MODE) for w in said)
    if in_object_mode:
        logger.debug("pymc model: the ranks' graph runs partly in Numba's object mode: "
                     "every mode measured")
    return built, in_object_mode


def _split(fn, rows, dtype):
    """``fn`` (a ``graphs.joined`` graph's function of ``rows`` and a position of ``dtype``)
    as a function of the position returning (logp, gradient)."""
    def logp_dlogp(x):
        out = np.asarray(fn(*rows, np.asarray(x, dtype=dtype)), dtype=np.float64).reshape(-1)
        return out[0], out[1:]
    return logp_dlogp


def kept(seconds):
    """The mode kept of ``{mode: seconds}``: the first, unless another ran in at most
    ``CLEAR_WIN`` of its time (then the fastest)."""
    first = next(iter(seconds))
    best = min(seconds, key=seconds.get)
    return best if seconds[best] <= CLEAR_WIN * seconds[first] else first


KEPT = MeasureFile("synkhronos_modes.json")
"""Where measurements are kept: PyTensor's compile directory (``measures``)."""


def cache_path():
    """Where measurements are kept: PyTensor's compile directory."""
    return KEPT.path()


def _key(output, args, modes):
    """What a measurement depends on, hashed: the graph as PyTensor prints it (its
    operations and types, not the rows' values), the arguments' shapes and types, the
    modes, the rule (timed near the mode: the decision's position or ``settle``'s, one
    key for both, so that a run reading a kept decision reads the modes it measured; each
    output waited for as a whole, ``trials.done``: a kept figure from before counted
    walking the gradient), the libraries that compile it and the CPU that runs it
    (``measures.digest``); None where the graph cannot be printed."""
    graph = graph_text(output)
    if graph is None:
        return None
    return digest(graph, [(np.shape(a), str(np.asarray(a).dtype)) for a in args],
                  sorted(str(m) for m in modes), "timed near the mode, outputs whole")


def _cached(key):
    """(best, seconds) measured by an earlier run, or None."""
    entry = KEPT.get(key)
    try:
        best, seconds = entry["best"], {m: float(s) for m, s in entry["seconds"].items()}
    except (TypeError, KeyError, AttributeError, ValueError):
        return None
    return (best, seconds) if best in seconds else None


def _store(key, best, seconds):
    """Keep a measurement."""
    KEPT.put(key, {"best": best, "seconds": seconds})
