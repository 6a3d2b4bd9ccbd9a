"""Whether splitting a model's rows gains over pm.sample, and sampling as pm.sample does where not.

``dp.sample`` on a small model would cost the user time: every gradient
pays a data-parallel call's fixed cost (tens of microseconds) and, with
PyMC's NUTS, every chain's Python work runs in this one process, where
``pm.sample`` runs each chain in a process of its own on its own core.  So,
unless ``data_parallel(split=...)`` decided, the first ``dp.sample`` of a
model times PyMC's own serial call (compiled as pm.sample compiles it, run
in this process on one core as one of pm.sample's chains runs it) and, where
it must, a data-parallel call, both near the model's mode, where the
sampler's draws go (``typical_x``), and predicts the rest of the run both ways:

    pm.sample:  what its sampler compiles of its own (nutpie: SAMPLER_COMPILE_S)
                + steps x ceil(chains / cores) x (serial call + the sampler's own work)
    dp.sample:  steps x (chains x the sampler's own work + the call(s) at every chain's position)

where ``cores`` is what pm.sample would run chains on (``min(chains,
cores=, the machine's CPUs)``) and ``steps`` is ``(tune + draws) x`` the
gradients a draw takes (``draws.draw_steps``).  PyMC's own (logp, dlogp), compiled here to time it, is the
one pm.sample then runs (``internals.serving``): spent either way, as is
what data_parallel() did.  The data-parallel call is first predicted, not
built: the rows split over the ranks (``RANK_GRAPH_GAIN`` times faster per
row at best) plus ``CALL_S``, and building it (``BUILD_COMPILES`` times
PyMC's own compile: the master compiles the rank's graph in each mode to
keep the faster, ``modes``, then the ranks theirs); where even that would
not gain, nothing is built for the ranks.  Splitting is kept where it is
predicted ``GAIN`` times faster and a step of every chain faster too (slower a step, it
wins only a short run, by what the other way compiles); else ``dp.sample`` runs ``pm.sample``
itself with this process's cores released (the ranks sleep meanwhile), and
says so in one log line.  Left out: pm.sample's chains slowing each other.

With nutpie there is a third way: nutpie on that same compiled (logp, dlogp),
called back from its threads in this process, as the split's callback is, so
that nutpie compiles nothing of its own (``Decision.callback``); the
chains' calls then take turns (one interpreter), so it is predicted as

    callback:   steps x chains x (serial call + CALLBACK_S)

and taken where it beats pm.sample's own nutpie.  nutpie compiles the model in Numba, so
PyMC's function timed (and called back) for it is compiled in Numba too
(``internals.sampler_mode``; should Numba fail, in PyTensor's default, and where that
default is not Numba too, ``in_numba``, nutpie's gradient is then predicted at that call
times the rank graph's Numba / C ratio, ``numba_ratio``).
Where the choice turns on the gradients a draw takes, a short nutpie run counts them
(``draws.leapfrogs``).

A measured decision is kept on disk for the next run of the model (``decision.py``).
"""

import dataclasses
import logging
import math
import time

import numpy as np

import synkhronos as synk

from ... import compat
from . import calls as calls_mod
from . import decision as decision_mod
from . import draws as draws_mod
from . import internals, trials
from .decision import Decision
from .master_cores import unpinned_cores

logger = logging.getLogger(__name__)

GAIN = 1.1
"""How much faster the prediction must make splitting for the rows to be split: the
prediction is rough, and what it leaves out (the many-position graph compiled at the first
step of several chains) costs the data-parallel side."""

SAMPLER_S = {"pymc": 60e-6, "nutpie": 4e-6}
"""Each sampler's own work per gradient beyond the call, on one core (bench/pymc_calls.py
--parts steps; docs/pymc.md, "When splitting pays")."""

SAMPLER_COMPILE_S = {"nutpie": 5.0}
"""What a sampler compiles of its own besides PyMC's (logp, dlogp), timed here: nutpie
compiles the model again with Numba, 5.2-8.4 s a process on the gallery's 7 models
(2026-12-02, bench/pymc_gallery.py --parts compile, bench/HISTORY.md), which dp.sample's
nutpie, on the data-parallel callback, does not."""

BUILD_COMPILES = 3.0
"""Building the ranks' graph, in units of PyMC's own compile of its (logp, dlogp): the master
compiles it in two modes to keep the faster, the ranks then the one kept (each theirs, at
once).  A gallery model's first split call took 3-8 s on PyMC 5.28 against PyMC's 0.3-0.8 s
compile in C (2026-12-04, bench/pymc_gallery.py --parts e2e)."""

CALLBACK_S = 20e-6
"""A gradient of nutpie on PyMC's compiled function in this process, beyond the call:
nutpie's thread calls back into Python, one chain after the other (splines, 2 chains:
16 us a gradient beyond the call on PyMC 6.4, 21 us on 5.28; 2026-12-05)."""

DP_NUTPIE_S = 25e-6
"""A data-parallel gradient under nutpie beyond the call: nutpie's thread calls back into
Python, and its request waits for the other chains' in the batcher."""

MANY_COMPILE_S = 3.0
"""What compiling the graphs at many positions (vectorised and the loop, at their first
call) is taken to cost at least (a warm one on PyMC 5.28: 8-20 s a process, its Numba code
uncached), or ``MANY_BUILDS`` times the first one-position call where more.  Where one call
at every chain's position could save less over the run (at most a call's fixed cost per
chain beyond the first, each step: ``call_fixed_s``), the chains take a call each and nothing
more is compiled."""

MANY_BUILDS = 4.0
"""Robust at 10^5 rows, PyMC 5.28: the first call 3.9-4.2 s, the many-position graphs 15.7-17.0
s more; under 3 s alone, they were compiled to save 3.0 s (2026-12-05, bench/HISTORY.md)."""

CALL_S = 3e-6
"""A data-parallel call's cost beyond its ranks' share of the rows, at the least: 2.7 us
on 2 ranks, the (logp, dlogp) call's fixed cost less its rank graph's run
(bench/pymc_calls.py --parts overhead, bench/RESULTS.md, 2026-11-27)."""

RANK_GRAPH_GAIN = 5.0
"""How much faster per row a rank's graph may run than PyMC's own, at the most: the radon
model's in Numba against PyMC's in C, 4.77x (bench/pymc_calls.py --parts ratio,
bench/RESULTS.md, 2026-11-28).  The prediction before anything is built takes it, so
that it never turns down a split that a built graph would have won."""

TRIAL_S = 0.1
"""Seconds each side of the trial runs for (at least 5 calls, at most 500)."""

SERIAL_TRIAL_S = 0.02
"""Seconds PyMC's serial call is timed for (at least 5 calls, at most 500): no rank takes
part, so the spread is the machine's alone (the 5-25 us calls of the gallery's models
make 500 calls in 3-13 ms)."""

def check_split(split):
    """``split`` as ``data_parallel`` takes it: True, False or None."""
    if split is not None and not isinstance(split, bool):
        raise ValueError("data_parallel: split must be True (always split the rows), False "
                         "(sample as pm.sample does) or None (measure at the first "
                         f"dp.sample); got {split!r}")
    return split


def sampling_cores(chains, cores):
    """The cores ``dp.sample`` runs ``chains`` on where it does not split: ``cores=``, else
    ``pm.sample``'s default over the cores this process had before ``fork()`` (``min(4,
    cores)``, not PyMC's own, which takes half the CPUs for hardware threads), at most those."""
    available = len(unpinned_cores())
    if cores is None:
        cores = min(4, available)
    return max(1, min(chains, cores, available))


def predict(sampler, chains, cores, steps, serial_s, compile_s, round_s):
    """(pm.sample's, dp.sample's) predicted seconds for ``steps`` gradients of every chain.

    ``serial_s`` is PyMC's serial call and ``compile_s`` what pm.sample
    would compile that dp.sample does not, besides its sampler's own
    (``SAMPLER_COMPILE_S``); ``round_s`` the data-parallel call (or calls) at
    every chain's position; see the module docstring.
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
    call that costs each position's rows and one call's fixed cost,
    ``call_fixed_s``); where even that does not gain, the rows are not
    split.  With several chains, where one call at every chain's position
    could not save ``MANY_COMPILE_S`` over the run, the
    chains take a call each (``Decision.separate``); else that call is timed,
    its first call compiling the many-position graphs, which sampling
    several chains would compile anyway, and the cheaper of it and a call
    per chain is taken.
    """
    layout = synk.layout()
    ranks = layout.n_parallel
    n_cores = sampling_cores(chains, cores)
    if dp.split is not None:
        return Decision(dp.split, "asked", sampler, chains, n_cores, ranks)
    if layout.n_machines > 1 or dp.given:
        # The rows are on other machines (or given as synk.Data): only the ranks hold them.
        return Decision(True, "cluster", sampler, chains, n_cores, ranks)
    steps = int(round((draws + (1000 if tune is None else tune)) * draws_mod.draw_steps(dp.size)))
    key = (dp.n_rows, sampler, chains, n_cores, ranks, steps)
    dp.run_calls = steps * chains   # a short run measures no other mode (modes.SMALL_RUN_S)
    known = dp.decisions.get(key)
    if known is None:
        where = decision_mod.where(dp, key)
        known = decision_mod.kept(where, sampler, chains, n_cores, ranks)
        if known is None:
            # The ranks' graph's modes compile aside (on the ranks' cores, idle now) while
            # PyMC's function compiles here; stopped where nothing is evaluated after all.
            dp.begin_measuring()
            try:
                known = _measured(dp, sampler, chains, n_cores, ranks, steps)
            finally:
                dp.end_measuring()
            decision_mod.keep(where, known)
        dp.decisions[key] = known
    return known


def _measured(dp, sampler, chains, n_cores, ranks, steps):
    """The decision as measured now (see ``decide``)."""
    serial = serial_function(dp, sampler)
    call = internals.serial_call(serial.fn)
    x = typical_x(dp, call)
    serial_s = _timed(lambda: call(x), SERIAL_TRIAL_S)
    per_draw = None
    if sampler == "nutpie":
        draws_all = int(round(steps / draws_mod.draw_steps(dp.size)))
        turns = callback_turns(draws_all, chains, n_cores, serial_s)
        if (turns is not None and draws_mod.draw_steps(dp.size) < turns < draws_mod.MAX_LEAPFROGS
                and draws_mod.counted_in(chains * draws_all)):
            # Which way wins turns on the gradients a draw takes: count them.
            per_draw = draws_mod.leapfrogs(dp, serial)
            steps = int(round(draws_all * (per_draw or draws_mod.draw_steps(dp.size))))
    # The one pm.sample would run (internals.serving): nothing for it to compile again.
    serial_run, at_best = predict(sampler, chains, n_cores, steps, serial_s, 0.0,
                                  CALL_S + serial_s / (ranks * RANK_GRAPH_GAIN))
    if not dp.built:
        at_best += BUILD_COMPILES * serial.compile_s
    callback = False
    if sampler == "nutpie":
        callback_run = steps * chains * (serial_s + CALLBACK_S)
        if callback_run < serial_run:
            serial_run, callback = callback_run, True
    if at_best * GAIN >= serial_run:
        # Even the best a split could do would not gain: the ranks' graph is not built.
        return Decision(
            False, "measured", sampler, chains, n_cores, ranks, serial_s, serial.compile_s,
            CALL_S + serial_s / (ranks * RANK_GRAPH_GAIN), None, serial_run, at_best,
            predicted=True, callback=callback, leapfrogs=per_draw,
            sampler_compile_s=SAMPLER_COMPILE_S.get(sampler))
    one_s = _timed(lambda: dp.logp_dlogp(x))
    compile_s = 0.0
    # nutpie's gradient (Numba) costs PyMC's call, where that is Numba's too (PyTensor 3's
    # default: mixture at 10^5 rows 3852 us, nutpie's own 3854); else PyMC's call times the
    # rank graph's Numba / C ratio, where both were timed.
    numba = (numba_ratio(dp.mode_seconds)
             if sampler == "nutpie" and not callback and not in_numba(serial) else None)
    if numba is not None:
        serial_run, _ = predict(sampler, chains, n_cores, steps, serial_s * numba, 0.0, 0.0)
    # One call at every chain's position saves at most a call's fixed cost per chain beyond
    # the first: it runs every position's rows (at 10^5 rows the graphs at 2 positions never
    # took less than 2 calls at one: bench/HISTORY.md, 2026-12-05).
    fixed_s = call_fixed_s(dp.chunk_fit, one_s, ranks)
    _, fastest = predict(sampler, chains, n_cores, steps, serial_s, compile_s,
                         chains * one_s - (chains - 1) * fixed_s)
    many_s, parallel_run, separate = None, fastest, False
    many_cost = max(MANY_COMPILE_S, MANY_BUILDS * (dp.first_call_s or 0.0))
    if chains > 1 and steps * (chains - 1) * fixed_s < many_cost:
        separate = True   # a call each: the many-position graphs would not pay their compile
        _, parallel_run = predict(sampler, chains, n_cores, steps, serial_s, compile_s, chains * one_s)
    elif chains > 1 and fastest * GAIN < serial_run:
        # Positions near the start, apart as chains' are; the first calls choose a way
        # (vectorised, a loop, a call each: calls.Calls), the timing sees the one kept.
        P = x + 0.01 * np.arange(chains, dtype=dp.dtype)[:, None]
        for _ in range(len(calls_mod.WAYS) * calls_mod.TRIALS + 1):
            dp.logp_dlogp_many(P)
        many_s = _timed(lambda: dp.logp_dlogp_many(P))
        separate = chains * one_s < many_s   # logistic, 10^5 rows: 3.1 ms against 2 x 1.2
        round_s = min(many_s, chains * one_s)
        _, parallel_run = predict(sampler, chains, n_cores, steps, serial_s, compile_s, round_s)
    # A split slower a step gains only on a short run, by what the serial way compiles
    # (nutpie's own); runs take draws.LEAPFROGS gradients a draw at the least, often many more
    # (docs/pymc.md), so it must gain a step too: each run less what it compiles.
    compiled = 0.0 if callback else SAMPLER_COMPILE_S.get(sampler, 0.0)
    step_s = (parallel_run / max(steps, 1), (serial_run - compiled) / max(steps, 1))
    split = parallel_run * GAIN < serial_run and step_s[0] < step_s[1]
    return Decision(split, "measured", sampler, chains, n_cores, ranks, serial_s,
                    serial.compile_s, one_s, many_s, serial_run, parallel_run, separate,
                    callback=callback, numba_ratio=numba, leapfrogs=per_draw,
                    fixed_s=fixed_s if fixed_s < one_s else None,
                    sampler_compile_s=SAMPLER_COMPILE_S.get(sampler),
                    steps_s=step_s)


def typical_x(dp, call):
    """Where ``dp``'s calls are timed: near the mode, where the sampler's draws go
    (``trials.settled``, climbing on PyMC's own ``call``), found once; the ranks' modes
    are then timed there too."""
    if dp.typical_x is None:
        dp.typical_x = trials.settled(call, dp.initial_x().astype(dp.dtype))
    return dp.typical_x


def call_fixed_s(fit, one_s, ranks):
    """What a data-parallel call of ``one_s`` seconds costs beside its rows: where its chunks
    were timed (``fit``, a ``Function.chunk_fit``), ``CALL_S`` and a rank's share of the
    chunks' fixed costs; else all of ``one_s`` (as if its rows cost nothing)."""
    if fit is None:
        return one_s
    return min(one_s, CALL_S + fit.fixed_per_rank(ranks))


def callback_turns(draws, chains, cores, serial_s):
    """Gradients a draw must take for nutpie's own compile to beat the callback way, or None
    where the callback way costs no more a gradient (then it wins at any count)."""
    own = SAMPLER_S["nutpie"]
    per_step = draws * (chains * (serial_s + CALLBACK_S)
                        - math.ceil(chains / cores) * (serial_s + own))
    return SAMPLER_COMPILE_S["nutpie"] / per_step if per_step > 0 else None


def in_numba(serial):
    """Whether ``serial``'s function was compiled with Numba, as nutpie compiles its own: in
    Numba's mode, or in PyTensor's default where that is Numba (PyTensor 3)."""
    return compat.linker_name(internals.serial_call(serial.fn).maker) == "numba"


def numba_ratio(seconds):
    """Numba's time over C's for the rank's graph (``dp.mode_seconds``), or None where not
    both were measured."""
    numba, c = seconds.get("NUMBA"), seconds.get("CVM")
    return numba / c if numba and c else None


@dataclasses.dataclass(frozen=True)
class Serial:
    """PyMC's own (logp, dlogp) of a model, compiled as pm.sample's sampler compiles it, in
    ``mode`` (None: PyTensor's default), and how long that took (seconds)."""

    fn: object
    compile_s: float
    mode: str | None = None


def serial_function(dp, sampler="pymc"):
    """``dp.model``'s ``Serial`` for ``sampler``: compiled in the mode that sampler compiles the
    model in (``internals.sampler_mode``) at its first decision, then the same one."""
    mode = internals.sampler_mode(sampler)
    serial = dp.serials.get(mode)
    if serial is None:
        try:
            serial = _compiled_serial(dp, mode)
        except Exception as exc:  # noqa: BLE001 - an op Numba cannot compile: PyMC's default
            if mode is None:
                raise
            logger.debug("dp.sample: PyMC's function in %s failed (%r); in the default mode",
                         mode, exc)
            serial = dp.serials.get(None) or _compiled_serial(dp, None)
            dp.serials[None] = serial
        dp.serials[mode] = serial
    return serial


def _compiled_serial(dp, mode):
    t0 = time.perf_counter()
    fn = internals.serial_logp_dlogp(dp.model, mode)
    internals.serial_call(fn)(dp.initial_x().astype(dp.dtype))  # Numba compiles here
    return Serial(fn, time.perf_counter() - t0, mode)


def _timed(call, seconds=TRIAL_S):
    """Median seconds of ``call()`` over about ``seconds``, after two warm-up calls."""
    call(), call()
    times, end = [], time.perf_counter() + seconds
    while len(times) < 5 or (len(times) < 500 and time.perf_counter() < end):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))
