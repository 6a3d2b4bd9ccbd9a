"""Whether splitting a model's rows gains over pm.sample, and sampling as pm.sample does where not.

``dp.sample`` on a small model would cost the user time: every gradient
pays a data-parallel call's fixed cost (tens of microseconds) and, with
PyMC's NUTS, every chain's Python work runs in this one process, where
``pm.sample`` runs each chain in a process of its own on its own core.  So,
unless ``data_parallel(split=...)`` decided, the first ``dp.sample`` of a
model times a data-parallel call and PyMC's own serial call (compiled as
pm.sample compiles it, run in this process on one core as one of
pm.sample's chains runs it) and predicts the rest of the run both ways:

    pm.sample:  compiling its (logp, dlogp) (and nutpie's own, SAMPLER_COMPILE_S)
                + steps x ceil(chains / cores) x (serial call + the sampler's own work)
    dp.sample:  steps x (chains x the sampler's own work + the call(s) at every chain's position)

where ``cores`` is what pm.sample would run chains on (``min(chains,
cores=, the machine's CPUs)``) and ``steps`` is ``(tune + draws) x
LEAPFROGS``.  What data_parallel() and distribute() compiled is spent
either way.  Splitting is kept where it is predicted ``GAIN`` times faster;
else ``dp.sample`` runs ``pm.sample`` itself with this process's cores
released (the ranks sleep meanwhile), and says so in one log line.  Left
out: pm.sample's chain processes slowing each other (memory bandwidth,
shared caches), which favours splitting.
"""

import contextlib
import dataclasses
import logging
import math
import os
import time

import numpy as np

from . import calls as calls_mod
from . import internals

logger = logging.getLogger(__name__)

GAIN = 1.1
"""How much faster the prediction must make splitting for the rows to be split: the
prediction is rough, and what it leaves out (the many-position graph compiled at the first
step of several chains) costs the data-parallel side."""

SAMPLER_S = {"pymc": 60e-6, "nutpie": 4e-6}
"""Each sampler's own work per gradient beyond the call (its leapfrog step and tree), on
one core; measured with bench/pymc_calls.py --parts steps (docs/pymc.md, "When splitting
pays")."""

SAMPLER_COMPILE_S = {"nutpie": 5.0}
"""What a sampler compiles of its own besides PyMC's (logp, dlogp), timed here: nutpie
compiles the model again with Numba, 5.2-8.4 s a process on the gallery's 7 models
(2026-12-02, bench/pymc_gallery.py --parts compile, bench/HISTORY.md), which dp.sample's
nutpie, on the data-parallel callback, does not."""

DP_NUTPIE_S = 25e-6
"""A data-parallel gradient under nutpie beyond the call: nutpie's thread calls back into
Python, and its request waits for the other chains' in the batcher."""

MANY_COMPILE_S = 3.0
"""What compiling the graphs at many positions (vectorised and the loop, at their first
call) is taken to cost at least: a cold compile takes 10-20 s (docs/pymc.md), a warm one
on PyMC 5.28 8-20 s a process (Numba's code is not cached there), 2026-12-02.  Where one
call at every chain's position could save less than this over the run (at most a call
per chain less each step), the chains take a call each and nothing more is compiled."""

TRIAL_S = 0.1
"""Seconds each side of the trial runs for (at least 5 calls, at most 500)."""

LEAPFROGS = 10
"""Gradient evaluations a draw takes, for the prediction: NUTS's trees of depth 3-4, as
tuned models take (tests/extensions/test_pymc.py counts n_steps per draw)."""


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
    go in a call each (``MANY_COMPILE_S``).
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

    def describe(self):
        """One line: what was chosen and why."""
        if self.reason == "cluster":
            return ("dp.sample: sampling data-parallel (the rows are the ranks': given as "
                    "synk.Data, or over machines)")
        if self.reason == "asked":
            how = "data-parallel" if self.split else "as pm.sample does, in this process"
            return f"dp.sample: sampling {how} (data_parallel(split={self.split}))"
        calls = f"a call {self.parallel_s * 1e6:.0f} us" + (", a call per chain"
                                                           if self.separate else "")
        if self.parallel_many_s is not None:
            calls += f", at {self.chains} positions {self.parallel_many_s * 1e6:.0f} us"
        figures = (f"{self.chains} chain(s), sampler {self.sampler}: predicted "
                   f"{self.parallel_run_s:.1f} s data-parallel on {self.ranks} ranks ({calls}) "
                   f"against {self.serial_run_s:.1f} s for pm.sample on {self.cores} core(s) "
                   f"(a call {self.serial_s * 1e6:.0f} us, compiling "
                   f"{self.compile_s + SAMPLER_COMPILE_S.get(self.sampler, 0.0):.1f} s)")
        if self.split:
            return f"dp.sample: splitting the rows gains ({figures})"
        return (f"dp.sample: splitting the rows would not gain ({figures}); sampling as "
                f"pm.sample does, in this process with its cores released. "
                f"data_parallel(model, split=True) splits anyway")


def check_split(split):
    """``split`` as ``data_parallel`` takes it: True, False or None."""
    if split is not None and not isinstance(split, bool):
        raise ValueError("data_parallel: split must be True (always split the rows), False "
                         "(sample as pm.sample does) or None (measure at the first "
                         f"dp.sample); got {split!r}")
    return split


def sampling_cores(chains, cores):
    """The cores ``pm.sample`` would run ``chains`` on: ``cores=`` or its default, at most the CPUs."""
    available = len(unpinned_cores())
    if cores is None:
        cores = min(4, available)
    return max(1, min(chains, cores, available))


def predict(sampler, chains, cores, steps, serial_s, compile_s, round_s):
    """(pm.sample's, dp.sample's) predicted seconds for ``steps`` gradients of every chain.

    ``serial_s`` is PyMC's serial call and ``compile_s`` its compiling,
    ``round_s`` the data-parallel call (or calls) at every chain's position;
    see the module docstring.
    """
    own = SAMPLER_S.get(sampler, SAMPLER_S["pymc"])
    compile_s += SAMPLER_COMPILE_S.get(sampler, 0.0)
    serial = compile_s + steps * math.ceil(chains / cores) * (serial_s + own)
    extra = DP_NUTPIE_S if sampler == "nutpie" else own
    return serial, steps * (chains * extra + round_s)


def decide(dp, sampler, chains, cores, draws, tune):
    """Whether ``dp.sample`` splits the rows: as ``dp.split`` says, else measured (once per set-up).

    The data-parallel side is timed in up to two steps.  A call at one
    position bounds a step of every chain from below (every position in one
    call that costs no more than one); where even that does not gain, the
    rows are not split.  With several chains, where one call at every
    chain's position could not save ``MANY_COMPILE_S`` over the run, the
    chains take a call each (``Decision.separate``); else that call is timed,
    its first call compiling the many-position graphs, which sampling
    several chains would compile anyway.
    """
    import synkhronos as synk

    layout = synk.layout()
    ranks = layout.n_parallel
    n_cores = sampling_cores(chains, cores)
    if dp.split is not None:
        return Decision(dp.split, "asked", sampler, chains, n_cores, ranks)
    if layout.n_machines > 1 or dp.given:
        # The rows are on other machines (or given as synk.Data): only the ranks hold them.
        return Decision(True, "cluster", sampler, chains, n_cores, ranks)
    steps = (draws + (1000 if tune is None else tune)) * LEAPFROGS
    key = (dp.n_rows, sampler, chains, n_cores, ranks, steps)
    known = dp.decisions.get(key)
    if known is not None:
        return known
    x = dp.initial_x().astype(dp.dtype)
    one_s = _timed(lambda: dp.logp_dlogp(x))
    t0 = time.perf_counter()
    serial = internals.serial_logp_dlogp(dp.model)
    serial(x)            # Numba compiles at the first call
    compile_s = time.perf_counter() - t0
    serial_s = _timed(lambda: serial(x))
    serial_run, fastest = predict(sampler, chains, n_cores, steps, serial_s, compile_s, one_s)
    many_s, parallel_run, separate = None, fastest, False
    if chains > 1 and steps * (chains - 1) * one_s < MANY_COMPILE_S:
        separate = True   # a call each: the many-position graphs would not pay their compile
        _, parallel_run = predict(sampler, chains, n_cores, steps, serial_s, compile_s,
                                  chains * one_s)
    elif chains > 1 and fastest * GAIN < serial_run:
        # Positions near the start, apart as chains' are; the first calls choose between
        # the vectorised graph and the loop (calls.Calls), the timing sees the one kept.
        P = x + 0.01 * np.arange(chains, dtype=dp.dtype)[:, None]
        for _ in range(2 * calls_mod.TRIALS + 1):
            dp.logp_dlogp_many(P)
        many_s = _timed(lambda: dp.logp_dlogp_many(P))
        _, parallel_run = predict(sampler, chains, n_cores, steps, serial_s, compile_s, many_s)
    decision = Decision(parallel_run * GAIN < serial_run, "measured", sampler, chains, n_cores,
                        ranks, serial_s, compile_s, one_s, many_s, serial_run, parallel_run,
                        separate)
    dp.decisions[key] = decision
    return decision


def _timed(call):
    """Median seconds of ``call()`` over about ``TRIAL_S``, after two warm-up calls."""
    call(), call()
    times, end = [], time.perf_counter() + TRIAL_S
    while len(times) < 5 or (len(times) < 500 and time.perf_counter() < end):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def unpinned_cores():
    """The cores this process may run on once released: those it had before ``fork()`` pinned it."""
    from ...runtime.state import get_runtime

    rt = get_runtime()
    before = getattr(getattr(rt, "processes", None), "unpinned", None) if rt is not None else None
    return set(before) if before else os.sched_getaffinity(0)


@contextlib.contextmanager
def released():
    """Within: this process runs on every core it had before ``fork()`` pinned it to one.

    The ranks wait for the next command meanwhile, asleep after a short spin,
    so pm.sample's chain processes (which inherit this process's cores) and
    nutpie's threads have the machine.
    """
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, unpinned_cores())
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)
