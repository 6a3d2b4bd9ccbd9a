"""Which PyTensor mode a model's rank graph runs fastest in, measured on a rank's share of its rows.

No one mode wins for every model: on a logistic regression of 581,012 rows x
55 covariates a rank's (logp, dlogp) ran 5x faster in C (the cvm linker: BLAS's
gemv, fused loops) than in Numba, and on a radon-style model, indexed per
row, 4.8x faster in Numba (issue 47, bench/pymc_calls.py --parts ratio).  So
where ``data_parallel(mode=None)``, the first data-parallel evaluation
compiles the one-position graph in each mode, times it on as many rows as
one rank holds, and keeps the faster; only that mode's functions are then
built on the ranks.  The master measures the first mode while a child
process measures the others on the ranks' cores, idle then
(``_measure_aside``).  A mode whose graph Numba could compile only in
object mode simply measures slow.

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
import json
import logging
import math
import os
import select
import time

import numpy as np
import pytensor

from ... import compat
from ...functions.measures import MeasureFile, digest, graph_text
from ...runtime.devices import jax_initialised
from ...runtime.liveness import stop_process
from ...runtime.process_setup import fork_quietly
from .master_cores import unpinned_cores

logger = logging.getLogger(__name__)

TRIAL_S = 0.05
"""Seconds each mode's graph is timed for, after its first (compiling) call, over all
``ROUNDS``: at least a call a round, at most 200 calls."""

ROUNDS = 4
"""Rounds the modes are timed in, taking turns (the child's modes, then the master's) and
swapping cores every round, each mode keeping its least: a VM's cores slow down apart, in
spells of seconds (on this project's 2-vCPU VM one ran a NumPy loop in 400 us while the
other took 270, then both 270), so a mode timed on one core alone is compared with another
timed on a quicker one.  Timed each on its own core, a robust regression's rank graph at
10^5 rows measured Numba 1001-1144 us against C's 875-894 us in 2 runs of 8, where the
other 6 measured 557-947 us against 808-1491 us: C was kept, and the data-parallel call took
1.0-1.8 ms instead of 0.6-0.7 (PyMC 5.28, Intel Xeon VM, 2026-12-06, bench/HISTORY.md)."""


CLEAR_WIN = 0.9
"""Another mode than the first is kept only where its graph ran in at most this share of the
first's time: closer, the timing's spread decides, and the first (Numba) is the quicker to
start from warm caches (each rank loads PyTensor's cache of C modules at its first C call)."""


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


def fastest(inputs, position, output, arrays, x, n_parts, modes):
    """The name of the fastest of ``modes`` for ``output`` on a rank's rows (the first, unless
    another wins clearly: ``CLEAR_WIN``), and each one's seconds.

    Args:
        inputs: the graph's row inputs, ``arrays`` their values (every row).
        position: the graph's position input, ``x`` its value.
        output: the one-position graph.
        n_parts: how many ranks share the rows (each holds about 1 / n_parts of them).
        modes: mode name -> the PyTensor mode to compile in.
    """
    rows = max(1, -(-len(arrays[0]) // n_parts))
    args = [np.asarray(a[:rows]) for a in arrays] + [x]
    key = _key(output, args, modes)
    known = _cached(key) if key is not None else None
    if known is not None:
        best, seconds = known
        logger.info("pymc model: the ranks' graph runs in %s (%s on %d rows, measured by an "
                    "earlier run: %s)", best, ", ".join(f"{m} {s * 1e6:.0f} us"
                                                        for m, s in seconds.items()),
                    rows, cache_path())
        return best, seconds
    # JAX started here (an earlier model's ranks run in it): a forked child would hang in it.
    aside = {n: m for n, m in list(modes.items())[1:] if n != "JAX" or not jax_initialised()}
    helper = _measure_aside(inputs, position, output, aside, args)
    first = next(iter(modes))
    try:
        fn, compiled_s = _compiled(inputs, position, output, modes[first], args)
    except BaseException:
        _stop(helper)
        raise
    fns, compile_s = {first: fn}, {first: compiled_s}
    seconds, by_child = _turns(helper, fns, args) if helper is not None else ({}, {})
    for name, (s, c) in by_child.items():
        seconds[name], compile_s[name] = s, c
    late = {}
    for name, mode in modes.items():
        if name not in seconds and name not in fns:  # no child, or it failed: here, then
            built = _compiled(inputs, position, output, mode, args, optional=True)
            if built is None:
                seconds[name], compile_s[name] = math.inf, math.nan
            else:
                late[name], compile_s[name] = built
    if late or helper is None:   # the master's modes, all of them, in turns among themselves
        seconds.update(_turns(None, {**fns, **late}, args)[0])
    for name in modes:
        logger.debug("pymc model: the ranks' graph in %s: %.1f us on %d rows (compiled in "
                     "%.2f s)", name, seconds[name] * 1e6, rows, compile_s[name])
    # A mode that did not compile is no candidate (nor kept as one).
    seconds = {name: seconds[name] for name in modes if math.isfinite(seconds[name])}
    best = kept(seconds)
    logger.info("pymc model: the ranks' graph runs in %s (%s on %d rows)", best,
                ", ".join(f"{m} {s * 1e6:.0f} us" for m, s in seconds.items()), rows)
    if key is not None:
        _store(key, best, seconds)
    return best, seconds


def kept(seconds):
    """The mode kept of ``{mode: seconds}``: the first, unless another ran in at most
    ``CLEAR_WIN`` of its time (then the fastest)."""
    first = next(iter(seconds))
    best = min(seconds, key=seconds.get)
    return best if seconds[best] <= CLEAR_WIN * seconds[first] else first


def _compiled(inputs, position, output, mode, args, optional=False):
    """``output``'s function in ``mode``, called once (Numba compiles at the first call), and
    the seconds both took; where ``optional``, None if it fails (a backend lacking an op)."""
    t0 = time.perf_counter()
    try:
        # A graph of its own in each mode: Numba may change what an earlier compile shares.
        fn = pytensor.function([*inputs, position], compat.private_inner_graphs(output),
                               mode=mode, on_unused_input="ignore")
        _done(fn(*args))
    except Exception as exc:  # noqa: BLE001 - any backend's failure: that mode is no candidate
        if not optional:
            raise
        logger.debug("pymc model: the ranks' graph does not compile in %s (%s: %s)", mode,
                     type(exc).__name__, str(exc)[:300])
        return None
    return fn, time.perf_counter() - t0


def _trial(fn, args, seconds):
    """The least seconds of ``fn(*args)`` over about ``seconds`` (at least a call, at most
    ``200 / ROUNDS``)."""
    times, end = [], time.perf_counter() + seconds
    while not times or (len(times) < 200 // ROUNDS and time.perf_counter() < end):
        t0 = time.perf_counter()
        _done(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def _round(fns, args, best, cores=None):
    """One round: each of ``fns`` ({mode: function}) timed, its least kept in ``best``; on
    ``cores`` where given (this process's own again afterwards)."""
    home = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        for name, fn in fns.items():
            best[name] = min(best.get(name, math.inf), _trial(fn, args, TRIAL_S / ROUNDS))
    finally:
        if cores:
            os.sched_setaffinity(0, home)


def _done(outputs):
    """``outputs`` as NumPy arrays: JAX returns before it has computed them."""
    for out in outputs:
        np.asarray(out)


HELPER_WAIT_S = 60.0
"""How long the master waits, after its own compile, for the child measuring aside to end."""


def _measure_aside(inputs, position, output, modes, args):
    """A child process that compiles ``modes``' graphs on the cores the ranks hold (idle
    now) while the master compiles the first mode's, then times them in turns with the
    master's (``_turns``: on a 2-vCPU VM the two may be one core's hardware threads).

    Cold, the master compiled the two modes one after the other: 7.7 + 9.6 s (a
    logistic regression, PyMC 6.4); with the child only compiling C, the master's own C
    compile, loading the child's modules, still took 1.3-4.4 s.  Returns ``(pid, results
    pipe, turns pipe, its cores)``, or None where no other core is free or fork() fails (the master
    then measures every mode itself).
    """
    others = unpinned_cores() - os.sched_getaffinity(0)
    if not modes or not others:
        return None
    fds = []
    try:
        fds += os.pipe()
        fds += os.pipe()
        r, w, go_r, go_w = fds
        pid = fork_quietly()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        logger.debug("pymc model: no child to measure aside (%s)", exc)
        return None
    if pid:
        os.close(w)
        os.close(go_r)
        return pid, r, go_w, others
    code = 1
    try:   # the child: measure, and leave without running anything of the master's at exit
        os.close(r)
        os.close(go_w)
        home = os.sched_getaffinity(0)     # the master's core(s)
        os.sched_setaffinity(0, others)
        logging.disable(logging.CRITICAL)
        built = {name: _compiled(inputs, position, output, mode, args, optional=True)
                 for name, mode in modes.items()}
        best = {}
        for i in range(ROUNDS):
            if not os.read(go_r, 1):   # the master gone: end of file
                os._exit(1)
            _round({name: b[0] for name, b in built.items() if b}, args, best,
                   home if i % 2 else None)
            os.write(w, b".")          # the master's turn
        # A mode that did not compile: infinite seconds (JSON's Infinity), not compiled again.
        measured = {name: [best[name], b[1]] if b else [math.inf, math.nan]
                    for name, b in built.items()}
        os.write(w, json.dumps(measured).encode())   # far less than a pipe's buffer
        code = 0
    finally:
        os._exit(code)


def _turns(helper, fns, args):
    """Time the master's ``fns`` ({mode: function}) and the child's modes in turns,
    ``ROUNDS`` rounds of the child's then the master's, swapping their cores every other
    round, each keeping its least.

    Returns ``({mode: seconds} of the master's, {mode: (seconds, compile seconds)} of the
    child's)``; the child's are empty where there is none (``helper`` None) or it failed
    or did not answer within ``HELPER_WAIT_S`` (then it is killed).
    """
    best = {}
    deadline = time.monotonic() + HELPER_WAIT_S
    for i in range(ROUNDS):
        if helper is not None and not _turn(helper, deadline):
            _stop(helper, "ended or did not answer")
            helper = None
        _round(fns, args, best, helper[3] if helper is not None and i % 2 else None)
    if helper is None:
        return best, {}
    pid, pipe, go, _ = helper
    os.close(go)
    try:
        chunks = []
        while _readable(pipe, deadline):
            chunk = os.read(pipe, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            logger.warning("pymc model: the child measuring the ranks' graph aside did not "
                           "end; killed")
            stop_process(pid, reap=True)
            return best, {}
    finally:
        os.close(pipe)
    _, status = os.waitpid(pid, 0)
    return best, (_measured(b"".join(chunks)) if os.waitstatus_to_exitcode(status) == 0
                  else {})


def _turn(helper, deadline):
    """The child's turn: whether it timed its modes (and handed the turn back) in time."""
    pid, pipe, go, _ = helper
    try:
        os.write(go, b".")
    except OSError:         # the child ended
        return False
    return _readable(pipe, deadline) and os.read(pipe, 1) == b"."


def _readable(fd, deadline):
    """Whether ``fd`` has something to read (or its end) before ``deadline`` (monotonic)."""
    ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    return bool(ready)


def _stop(helper, why=None):
    """Kill and reap the child measuring aside (where any) and close its pipes; ``why`` it
    was stopped, where it failed, is said in a warning."""
    if helper is None:
        return
    pid, pipe, go, _ = helper
    for fd in (go, pipe):
        os.close(fd)
    if why:
        logger.warning("pymc model: the child measuring the ranks' graph aside %s; killed", why)
    stop_process(pid, reap=True)


def _measured(data):
    try:
        measured = json.loads(data)
        return {str(m): (float(s), float(c)) for m, (s, c) in measured.items()}
    except (ValueError, TypeError, AttributeError):
        return {}


KEPT = MeasureFile("synkhronos_modes.json")
"""Where measurements are kept: PyTensor's compile directory (``measures``)."""


def cache_path():
    """Where measurements are kept: PyTensor's compile directory."""
    return KEPT.path()


def _key(output, args, modes):
    """What a measurement depends on, hashed: the graph as PyTensor prints it (its
    operations and types, not the rows' values), the arguments' shapes and types, the
    modes, the libraries that compile it and the CPU that runs it (``measures.digest``);
    None where the graph cannot be printed."""
    graph = graph_text(output)
    if graph is None:
        return None
    return digest(graph, [(np.shape(a), str(np.asarray(a).dtype)) for a in args],
                  sorted(str(m) for m in modes))


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
