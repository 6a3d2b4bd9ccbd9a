"""A DataParallelModel's data-parallel functions and calls: at one position, or at many,
vectorised, in a loop or one call each, in the mode measured fastest.

Several positions (the chains') go in one call, either through the graph
vectorised over them or through a loop of the one-position graph, or in a
call each: whichever this model runs faster at that k, measured on its
first calls.  ``crossover`` compares a call each with the others where it
decides; with ``split=True``, or in a cluster, nothing else does (the
missing values at 10^5 rows, 2 positions: vectorised 329 us, a loop 318, a
call each 356; bench/HISTORY.md, 2026-12-07).  Each
function is built (rewritten and compiled) at its first call, not in
``data_parallel()`` and ``distribute()``: ``dp.sample`` may find that
splitting would not gain (``crossover``), only several chains at once call
the graphs at many positions, and of the modes registered only the one
measured fastest (``modes``) is ever built on the ranks.
"""

import logging
import time

import numpy as np

import synkhronos as synk

import pytensor.tensor as pt

from ...functions.aside import adopt, build_while
from ...functions.build import function_at_first_call
from ...functions.deferred import Lazy
from . import graphs

logger = logging.getLogger(__name__)

# Runs of each way to evaluate k positions (vectorised, a loop, a call each) before keeping one.
TRIALS = 6
WAYS = ("vectorised", "loop", "each")


def register(inputs, position, positions, logp, value_vars, shapes, pregrad, modes, name):
    """The model's synkhronos functions: mode -> (one position, vectorised, loop).

    Each has one output (logp first, then the gradient): one reduction a
    call.  Their graphs are made from the rank's ``logp`` of ``value_vars``
    at their first call, in each process (``graphs.at_one``, ``graphs.many``,
    ``graphs.looped``).  ``modes`` maps a name to the PyTensor mode each
    compiles in; the first mode's functions take ``name`` itself.  Master
    only, before ``synk.distribute()``.
    """
    ways = {}
    for i, (key, mode) in enumerate(modes.items()):
        tag = f"_{key.lower()}" if i else ""
        ways[key] = tuple(
            function_at_first_call(inputs=inputs, bcast_inputs=[at],
                                   outputs=[(out(dtype=position.dtype), "sum")],
                                   name=f"{name}{tag}{suffix}", mode=mode,
                                   lazy=Lazy(make, args, [logp]), on_unused_input="ignore")
            for at, out, suffix, make, args in (
                (position, pt.vector, "", graphs.at_one,
                 (logp, value_vars, shapes, position, pregrad)),
                (positions, pt.matrix, "_many", graphs.many,
                 (logp, value_vars, shapes, positions, pregrad)),
                (positions, pt.matrix, "_loop", graphs.looped,
                 (logp, value_vars, shapes, position, positions, pregrad, mode))))
    return ways


def measured(ways, measuring, x, settle):
    """``measuring.finish(x, settle=settle)`` (a ``modes.Measuring`` of ``ways``' modes): the
    fastest mode and each mode's seconds.

    Where it measures now (nothing kept from an earlier run), the workers
    meanwhile build the first mode's one-position function (``build_while``),
    which the master compiles for the measuring on its own core: on two cores
    the first call compiled it again on both afterwards (censored data at
    10^5 rows, PyMC 5.28: 4.5 s).  The master's function of the mode kept is
    the one the measuring compiled, where it compiled it (``adopt``).
    """
    first = next(iter(ways))

    def finish():
        return measuring.finish(x, settle=settle)

    best, seconds = build_while([ways[first][0]], finish) if measuring.known is None else finish()
    fn = measuring.compiled.get(best)
    if fn is not None:
        adopt(ways[best][0], fn)
    return best, seconds


class Calls:
    """The calls of one model: ``one(x)`` and ``many(positions)``, each returning (logp, grad).

    On one machine the positions go into Data held for the run (one per
    batch size), written in place, so each call passes the very same Data:
    the call is then a kept one (no checks, nothing pickled).  In a cluster
    a write to a Data is mirrored by a command of its own: positions then
    travel inside the call as a NumPy input instead (``held`` False).
    """

    def __init__(self, ways, size, dtype, held, fastest=None):
        # mode -> (one position, vectorised, loop); with several, ``fastest()`` names the
        # one to keep and each mode's seconds, at the first evaluation.
        self.ways, self._fastest = ways, fastest
        self._built = False
        self.mode = self.fn1 = self.fn = self.fn_loop = None
        self.mode_seconds = {}   # mode -> seconds on a rank's rows, where measured
        self.first_s = None      # the first one-position call's seconds (its compiles)
        if fastest is None or len(ways) == 1:
            self._keep(next(iter(ways)))
        self.size, self.dtype = size, dtype
        self.data = None                   # the rows' Data (reset())
        self._held = {} if held else None  # k -> the positions' Data
        # Several positions as one call each at one position (no many-position graph
        # compiled): what crossover.decide sets where compiling would cost more than it saves.
        self.separate = False
        self.reset(None)

    @property
    def built(self):
        """Whether a data-parallel evaluation ran (and so built the one-position graph)."""
        return self._built

    def _keep(self, mode):
        self.mode = mode
        self.fn1, self.fn, self.fn_loop = self.ways[mode]

    def _first(self):
        """The first evaluation: keep the mode ``fastest()`` measures fastest, where several."""
        if self.mode is None:
            best, self.mode_seconds = self._fastest()
            self._keep(best)
        self._built = True

    def reset(self, data):
        """The rows are ``data`` now (a scatter): forget prepared arguments and measurements."""
        self.data = data
        self._args = {}          # k -> (the call's arguments, the array to write)
        self._ways = {}          # k -> the way kept at k positions (one of WAYS)
        self._trials = {}        # k -> {way: [seconds]} until known

    def _call_args(self, k):
        """The arguments of a call at ``k`` positions and the array the positions go into.

        ``k`` 0 stands for one position as a vector (the single-position function).
        """
        held = self._held
        shape = (k, self.size) if k else (self.size,)
        if held is None:
            # A cluster: a fresh array each call, sent inside the call.
            buf = np.empty(shape, self.dtype)
            return (*self.data, buf), buf
        d = held.get(k)
        if d is None:
            d = held[k] = synk.data(np.zeros(shape, self.dtype),
                                    name=f"pymc:position{'s' + str(k) if k else ''}")
        # The Data's own array (one machine: shared memory, writable), kept: a call
        # writes the positions into it and passes the same Data.
        args = self._args[k] = (*self.data, d), d.data
        return args

    def one(self, x):
        """(logp, grad) at one position ``x`` (a vector): one data-parallel call."""
        args = self._args.get(0)
        if args is None or self._held is None:
            args = self._call_args(0)
        args[1][...] = x
        if self._built:
            out = self.fn1(*args[0])[0]
        else:
            self._first()
            t0 = time.perf_counter()
            out = self.fn1(*args[0])[0]
            self.first_s = time.perf_counter() - t0
        # The output is a fresh array at every call (combined over the ranks), so the
        # gradient, a view of it, outlives the next call as a sampler needs.
        return out[0], out[1:]

    def many(self, positions):
        """(logps, grads) at ``positions`` (k vectors or a k x size matrix).

        One call of the graph vectorised over the k positions, or of a loop
        of the one-position graph, or a call at each position, whichever
        this model runs faster at k: vectorising a model's gradient can cost
        several times more per position than PyMC's own graph (the radon
        model's indexing, 4-6x), a loop's positions add up their gradients'
        outputs in every chunk, and batching must never cost more than
        running the chains one by one.  The first calls at each k try every way.
        """
        k = len(positions)
        if k == 1 or self.separate:
            return self._each(positions)
        if not self._built:
            self._first()
        way = self._ways.get(k)
        if way is not None:
            return self._run(way, positions)
        return self._trial(k, positions)

    def _each(self, positions):
        out = [self.one(x) for x in positions]
        return np.array([lp for lp, _ in out]), np.stack([g for _, g in out])

    def _run(self, way, positions):
        if way == "each":
            return self._each(positions)
        return self._many(self.fn if way == "vectorised" else self.fn_loop, positions)

    def _many(self, fn, positions):
        """One call of ``fn`` (vectorised or the loop) at k positions."""
        k = len(positions)
        args = self._args.get(k)
        if args is None or self._held is None:
            args = self._call_args(k)
        buf = args[1]
        for i, x in enumerate(positions):
            buf[i] = x
        # A fresh array at every call (combined over the ranks): each chain keeps its row.
        both = fn(*args[0])[0]
        return both[:, 0], both[:, 1:]

    def _trial(self, k, positions):
        """Evaluate by the way tried least so far; once each has run ``TRIALS`` times, keep
        the fastest (the first run of each left out: it compiles and faults pages in)."""
        times = self._trials.setdefault(k, {way: [] for way in WAYS})
        way = min(WAYS, key=lambda w: len(times[w]))
        t0 = time.perf_counter()
        out = self._run(way, positions)
        times[way].append(time.perf_counter() - t0)
        if all(len(t) >= TRIALS for t in times.values()):
            best = {w: min(t[1:]) for w, t in times.items()}
            self._ways[k] = min(WAYS, key=best.get)
            del self._trials[k]
            logger.debug("pymc model: %d positions %s (%s)", k,
                         "a call each" if self._ways[k] == "each" else f"a call {self._ways[k]}",
                         ", ".join(f"{w} {s * 1e6:.1f} us" for w, s in best.items()))
        return out
