"""What ``dp.sample`` chose and the figures it chose by (``Decision``), kept on disk for the
next run of the same model.

Deciding (``crossover.decide``) compiles PyMC's function and the rank's
graph and times them: 2-19 s at 10^5 rows on PyMC 5.28, 1-2 s at the
gallery's sizes (bench/HISTORY.md), which a run that then samples as
pm.sample does would pay for nothing at every start.  So a measured decision
is kept in ``KEPT`` (PyTensor's compile directory), keyed by the rank's
graph, the rows' shapes, the run's draws, chains, cores and ranks, the
libraries and the machine (``measures.digest``), and the next run of the
model takes it at once.  Deleting the file (``KEPT.path()``) measures again.
"""

import dataclasses

import numpy as np
import pymc

import synkhronos as synk

from ...functions.measures import MeasureFile, digest, graph_text

KEPT = MeasureFile("synkhronos_decisions.json")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``dp.sample`` chose, and the figures it chose by.

    ``split`` says whether the rows are split; ``reason`` is "asked" where
    ``data_parallel(split=True/False)`` decided, "cluster" where only the
    ranks hold the rows (several machines, or ``data=`` given as
    ``synk.Data``), else "measured".  Times are seconds (None where not
    measured): ``serial_s`` PyMC's serial call, ``compile_s`` compiling it,
    ``parallel_s`` a data-parallel call at one position, ``parallel_many_s``
    one at every chain's position; ``serial_run_s`` and ``parallel_run_s``
    the rest of the run as predicted.  ``separate``: the chains' positions
    go in a call each (``crossover.MANY_COMPILE_S``, or timed cheaper).  ``predicted``: ``parallel_s``
    was predicted, not timed (even at best it would not gain: nothing was
    built for the ranks; ``parallel_run_s`` then counts building it).
    ``callback``: the way not split is nutpie on PyMC's compiled (logp,
    dlogp) in this process instead of nutpie compiling its own
    (``serial_run_s`` is that way's).  ``numba_ratio``: with nutpie, its
    Numba gradient predicted at this ratio of PyMC's C call (``numba_ratio()``).
    ``leapfrogs``: the gradients a draw takes, where counted (``draws.leapfrogs``;
    else ``draws.draw_steps`` is assumed).  ``fixed_s``: what of ``parallel_s`` is
    the call's fixed cost (``call_fixed_s``), where its chunks were timed.
    ``kept``: read from disk, as an earlier run of this model measured it.
    ``sampler_compile_s``: what pm.sample's sampler compiles of its own
    (``crossover.SAMPLER_COMPILE_S``), where anything.  ``steps_s``: a step of
    every chain (data-parallel, the other way), where timed: a split slower a
    step is not taken, whatever the run's prediction.
    """

    split: bool
    reason: str
    sampler: str
    chains: int
    cores: int
    ranks: int
    serial_s: float = None
    compile_s: float = None
    parallel_s: float = None
    parallel_many_s: float = None
    serial_run_s: float = None
    parallel_run_s: float = None
    separate: bool = False
    predicted: bool = False
    callback: bool = False
    numba_ratio: float = None
    leapfrogs: float = None
    fixed_s: float = None
    kept: bool = False
    sampler_compile_s: float = None
    steps_s: tuple = None

    def describe(self):
        """One line: what was chosen and why."""
        if self.reason == "cluster":
            return ("dp.sample: sampling data-parallel (the rows are the ranks': given as "
                    "synk.Data, or over machines)")
        if self.reason == "asked":
            how = "data-parallel" if self.split else "as pm.sample does, in this process"
            return f"dp.sample: sampling {how} (data_parallel(split={self.split}))"
        calls = (f"a call {'at best ' if self.predicted else ''}"
                 f"{self.parallel_s * 1e6:.0f} us"
                 + (f" ({self.fixed_s * 1e6:.0f} us of it fixed)" if self.fixed_s else "")
                 + (", a call per chain" if self.separate else ""))
        if self.parallel_many_s is not None:
            calls += f", at {self.chains} positions {self.parallel_many_s * 1e6:.0f} us"
        if self.callback:
            other = ("nutpie on PyMC's compiled (logp, dlogp) in this process (a call "
                     f"{self.serial_s * 1e6:.0f} us, nothing more compiled)")
        else:
            other = (f"pm.sample on {self.cores} core(s) (a call {self.serial_s * 1e6:.0f} us"
                     + (f", in nutpie's Numba {self.serial_s * self.numba_ratio * 1e6:.0f} us"
                        if self.numba_ratio is not None else "")
                     + (f", compiling {self.sampler_compile_s:.1f} s)"
                        if self.sampler_compile_s is not None else ")"))
        counted = ("" if self.leapfrogs is None
                   else f", {self.leapfrogs:.0f} gradients a draw as counted")
        counted += (", as an earlier run measured it (delete "
                    f"{KEPT.path()} to measure again)" if self.kept else "")
        figures = (f"{self.chains} chain(s), sampler {self.sampler}{counted}: predicted "
                   f"{self.parallel_run_s:.1f} s data-parallel on {self.ranks} ranks ({calls}) "
                   f"against {self.serial_run_s:.1f} s for {other}")
        if self.split:
            return f"dp.sample: splitting the rows gains ({figures})"
        if self.steps_s is not None and self.steps_s[0] >= self.steps_s[1]:
            figures += (f"; a step of every chain {self.steps_s[0] * 1e6:.0f} us data-parallel "
                        f"against {self.steps_s[1] * 1e6:.0f} us: it gains only on a short run")
        how = ("nutpie on PyMC's compiled (logp, dlogp)" if self.callback
               else "as pm.sample does")
        return (f"dp.sample: splitting the rows would not gain ({figures}); sampling {how}, "
                f"in this process with its cores released. "
                f"data_parallel(model, split=True) splits anyway")


def kept(where_, sampler, chains, cores, ranks):
    """The decision kept at ``where_`` (a ``where()``), or None where none is or it is not one
    this run's could be."""
    return None if where_ is None else read(KEPT.get(where_), sampler, chains, cores, ranks)


def keep(where_, decision):
    """Keep ``decision`` at ``where_`` for the next run (nothing where ``where_`` is None)."""
    if where_ is not None:
        KEPT.put(where_, dataclasses.asdict(decision))


def where(dp, key):
    """Where a decision of ``dp`` for ``key`` (rows, sampler, chains, cores, ranks, steps) is
    kept on disk: the rank's graph, the rows' shapes, the rule's version and the libraries'
    (``measures.digest``); None where the graph cannot print."""
    text = graph_text(dp.rank_logp)
    if not text:
        return None
    shapes = [tuple(np.shape(c.get_value(borrow=True))) for c in (*dp.containers, *dp.whole)]
    return digest("pymc decision", "timed at a settled position, a step too, modes timed whole",
                  text, shapes, key, dp.rank_modes, synk.__version__, pymc.__version__)


def read(value, sampler, chains, cores, ranks):
    """The ``Decision`` kept on disk as ``value``, or None where it is not one this run's could
    be (absent, written by another version, or damaged)."""
    if not isinstance(value, dict):
        return None
    try:
        decision = Decision(**{**value, "kept": True})
    except TypeError:
        return None
    flags = (decision.split, decision.separate, decision.predicted, decision.callback)
    times = (decision.serial_s, decision.parallel_s, decision.serial_run_s,
             decision.parallel_run_s)
    if (decision.reason != "measured" or any(type(f) is not bool for f in flags)
            or (decision.sampler, decision.chains, decision.cores, decision.ranks)
            != (sampler, chains, cores, ranks)
            or not all(isinstance(t, (int, float)) and 0.0 <= t < 1e9 for t in times)):
        return None
    return decision
