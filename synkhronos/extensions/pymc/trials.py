"""Timing a graph in several modes: compiled in the master and, meanwhile, in a child process
on the ranks' cores, then timed in turns, each on every core.

``modes.fastest`` decides which mode the ranks' graph runs in from what this
measures; this module is how it measures without the timing's noise deciding:
the child and the master take turns (one at a time, so neither slows the
other) and swap cores every round (a VM's cores slow down apart), and
each mode keeps its least time.  Where the child fails or stops answering it
is killed, and the master measures what is left itself.
"""

import dataclasses
import json
import logging
import math
import mmap
import multiprocessing
import os
import select
import time

import numpy as np
import pytensor

from ... import compat
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
other took 270, then both 270), so a mode timed on one core alone was compared with another
timed on a quicker one.  Timed so, a robust regression's rank graph at 10^5 rows measured
Numba 1001 and 1144 us against C's 875 and 894 us in 2 runs of 8, where the other 6 measured
Numba 557-615 us: C was kept, and the data-parallel call took 1.0-1.9 ms instead of 0.6-0.7.
Swapping cores, 6 runs of 6 measured Numba 554-601 us and C 815-893 us (PyMC 5.28, Intel
Xeon VM, 2026-12-06, bench/HISTORY.md)."""


SETTLE_S = 0.25
"""Seconds at most that ``settled`` climbs for (the decision's serial call at 10^5 rows
costs 0.04-11 ms on PyMC 5.28: 20 calls or more)."""

SETTLE_STEPS = 30
"""L-BFGS iterations at most that ``settled`` takes."""


def settled(logp_dlogp, x0, seconds=SETTLE_S, steps=SETTLE_STEPS):
    """A position near the model's mode, where a sampler's draws go: ``x0`` moved uphill by
    a few L-BFGS steps (at most ``steps``, and ``seconds``), the best finite one met.

    The graphs are timed there, not at the initial point, because a row's cost
    depends on the position where a likelihood's functions take branches: libm's
    ``log1p`` and ``exp`` are quicker for small arguments, XLA's vectorised ones
    cost the same everywhere.  On 50,000 rows on PyMC 6.4 (unpinned) a Student-t
    regression's (logp, dlogp) took 383 us in Numba and 483 in JAX at its initial
    point, 867 and 564 at a position its sampler visited; a logistic regression's
    1515 and 612, then 2320 and 638 (one-off probes, 2026-12-06, bench/HISTORY.md).
    Timed at the initial point, the modes favoured Numba and C, and both sides of
    ``crossover``'s prediction ran short.

    Args:
        logp_dlogp: a function of a position returning (logp, its gradient).
        x0: where to start (a vector; not changed).
    """
    from scipy.optimize import minimize

    dtype = np.asarray(x0).dtype
    start = np.array(x0, dtype=np.float64)
    best, best_lp = start, -math.inf
    end = time.perf_counter() + seconds

    class Enough(Exception):
        pass

    def objective(x):
        nonlocal best, best_lp
        if time.perf_counter() > end:
            raise Enough
        lp, grad = logp_dlogp(np.asarray(x, dtype=dtype))
        lp, grad = float(lp), np.asarray(grad, dtype=np.float64).reshape(-1)
        if not (math.isfinite(lp) and np.isfinite(grad).all()):
            raise Enough   # off the model's support: stay with the best seen
        if lp > best_lp:
            best, best_lp = np.array(x, dtype=np.float64), lp
        return -lp, -grad

    try:
        minimize(objective, start, jac=True, method="L-BFGS-B",
                 options={"maxiter": steps, "maxfun": 2 * steps})
    except Enough:
        pass
    except Exception as exc:  # noqa: BLE001 - the initial point then, as before
        logger.debug("pymc model: no position nearer the mode (%s: %s)", type(exc).__name__, exc)
    return best.astype(dtype)


def compiled(inputs, position, output, mode, args, optional=False):
    """``output``'s function in ``mode``, called once (Numba compiles at the first call), and
    the seconds both took; where ``optional``, None if it fails (a backend lacking an op)."""
    t0 = time.perf_counter()
    try:
        # A graph of its own in each mode: Numba may change what an earlier compile shares.
        fn = pytensor.function([*inputs, position], compat.private_inner_graphs(output),
                               mode=mode, on_unused_input="ignore")
        done(fn(*args))
    except Exception as exc:  # noqa: BLE001 - any backend's failure: that mode is no candidate
        if not optional:
            raise
        logger.debug("pymc model: the ranks' graph does not compile in %s (%s: %s)", mode,
                     type(exc).__name__, str(exc)[:300])
        return None
    return fn, time.perf_counter() - t0


def trial(fn, args, seconds):
    """The least seconds of ``fn(*args)`` over about ``seconds`` (at least a call, at most
    ``200 / ROUNDS``)."""
    times, end = [], time.perf_counter() + seconds
    while not times or (len(times) < 200 // ROUNDS and time.perf_counter() < end):
        t0 = time.perf_counter()
        done(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def time_round(fns, args, best, cores=None):
    """One round: each of ``fns`` ({mode: function}) timed, its least kept in ``best``; on
    ``cores`` where given (this process's own again afterwards)."""
    home = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        for name, fn in fns.items():
            best[name] = min(best.get(name, math.inf), trial(fn, args, TRIAL_S / ROUNDS))
    finally:
        if cores:
            os.sched_setaffinity(0, home)


def done(outputs):
    """``outputs`` (a function's list of them, or its one output) as NumPy arrays: JAX
    returns before it has computed them.  One output is not iterated: walking a gradient of
    10^4 numbers element by element took 1.8 ms a call in Numba and 33 ms in JAX, ten times
    the imputed values' graph itself (bench/HISTORY.md, 2026-12-07)."""
    for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        np.asarray(out)


CHILD_NICE = 10
"""How much less of the ranks' cores the child takes than a rank building its graph there
meanwhile (``functions.aside.build_while``), which the first call waits for: with equal
shares a robust regression's build (1.5 s alone) took 2.8-4.1 s beside the child compiling
C and JAX (PyMC 5.28, bench/HISTORY.md, 2026-12-08).  In the turns the child also times on
the master's core, where the master then waits: nothing there takes a share from it."""

HELPER_WAIT_S = 60.0
"""How long the master waits, after its own compile, for the child measuring aside to end."""


class Claims:
    """Which of the modes measured aside the child compiles and which the master does, once
    its own is compiled: each takes the next mode no one has, under a lock shared across the
    fork.  The child takes JAX first, and the master never takes it (started in the
    master, JAX would hang the workers forked from it later).  Cold, the child compiled C
    then JAX one after the other (a radon model at 10^5 rows, PyMC 5.28: 2.25 + 3.19 s)
    while the master, its Numba compile done in 0.81 s, waited."""

    CHILD, MASTER = 1, 2

    def __init__(self, names):
        self.names = sorted(names, key=lambda n: n != "JAX")
        self._taken = mmap.mmap(-1, max(1, len(self.names)))   # shared with the child
        self._lock = multiprocessing.get_context("fork").Lock()

    def take(self, who):
        """The next mode ``who`` (``CHILD`` or ``MASTER``) compiles, now its; None where none."""
        with self._lock:
            for i, name in enumerate(self.names):
                if not self._taken[i] and (who == self.CHILD or name != "JAX"):
                    self._taken[i] = who
                    return name
        return None


@dataclasses.dataclass(frozen=True)
class Aside:
    """The child measuring aside: its pid, the pipe it answers on, the pipe that gives it
    its turns, its cores, and which modes each compiles."""

    pid: int
    pipe: int
    go: int
    cores: set
    claims: Claims


def measure_aside(inputs, position, output, modes, args):
    """A child process that compiles ``modes``' graphs on the cores the ranks hold (idle
    now) while the master compiles the first mode's (then the master takes its share of
    ``modes``: ``Claims``), then times them in turns with the master's (``turns``: on a
    2-vCPU VM the two may be one core's hardware threads).

    Cold, the master compiled the two modes one after the other: 7.7 + 9.6 s (a
    logistic regression, PyMC 6.4); with the child only compiling C, the master's own C
    compile, loading the child's modules, still took 1.3-4.4 s.  Returns an ``Aside``, or
    None where no other core is free or fork() fails (the master then measures every mode
    itself).
    """
    others = unpinned_cores() - os.sched_getaffinity(0)
    if not modes or not others:
        return None
    fds = []
    try:
        claims = Claims(modes)
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
        return Aside(pid, r, go_w, others, claims)
    code = 1
    try:   # the child: measure, and leave without running anything of the master's at exit
        os.close(r)
        os.close(go_w)
        home = os.sched_getaffinity(0)     # the master's core(s)
        os.sched_setaffinity(0, others)
        os.nice(CHILD_NICE)
        logging.disable(logging.CRITICAL)
        built = {}
        while (name := claims.take(Claims.CHILD)) is not None:
            built[name] = compiled(inputs, position, output, modes[name], args, optional=True)
        best = {}
        for i in range(ROUNDS):
            if not os.read(go_r, 1):   # the master gone: end of file
                os._exit(1)
            time_round({name: b[0] for name, b in built.items() if b}, args, best,
                       home if i % 2 else None)
            os.write(w, b".")          # the master's turn
        # A mode that did not compile: infinite seconds (JSON's Infinity), not compiled again.
        measured = {name: [best[name], b[1]] if b else [math.inf, math.nan]
                    for name, b in built.items()}
        os.write(w, json.dumps(measured).encode())   # far less than a pipe's buffer
        code = 0
    finally:
        os._exit(code)


def turns(helper, fns, args):
    """Time the master's ``fns`` ({mode: function}) and the child's modes in turns,
    ``ROUNDS`` rounds of the child's then the master's, swapping their cores every
    round, each keeping its least.

    Returns ``({mode: seconds} of the master's, {mode: (seconds, compile seconds)} of the
    child's)``; the child's are empty where there is none (``helper`` None) or it failed
    or did not answer within ``HELPER_WAIT_S`` (then it is killed).
    """
    best = {}
    deadline = time.monotonic() + HELPER_WAIT_S
    try:
        for i in range(ROUNDS):
            if helper is not None and not _turn(helper, deadline):
                failed, helper = helper, None
                stop(failed, "ended or did not answer")
            time_round(fns, args, best, helper.cores if helper is not None and i % 2 else None)
    except BaseException:
        stop(helper)
        raise
    return best, ({} if helper is None else _results(helper, deadline))


def _results(helper, deadline):
    """What the child measured, ``{mode: (seconds, compile seconds)}``, read once its turns are
    done; empty where it failed or did not end by ``deadline`` (then it is killed)."""
    os.close(helper.go)
    try:
        chunks = []
        while _readable(helper.pipe, deadline):
            chunk = os.read(helper.pipe, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            logger.warning("pymc model: the child measuring the ranks' graph aside did not "
                           "end; killed")
            stop_process(helper.pid, reap=True)
            return {}
    finally:
        os.close(helper.pipe)
    _, status = os.waitpid(helper.pid, 0)
    return _measured(b"".join(chunks)) if os.waitstatus_to_exitcode(status) == 0 else {}


def _turn(helper, deadline):
    """The child's turn: whether it timed its modes (and handed the turn back) in time."""
    try:
        os.write(helper.go, b".")
    except OSError:         # the child ended
        return False
    return _readable(helper.pipe, deadline) and os.read(helper.pipe, 1) == b"."


def _readable(fd, deadline):
    """Whether ``fd`` has something to read (or its end) before ``deadline`` (monotonic)."""
    ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
    return bool(ready)


def stop(helper, why=None):
    """Kill and reap the child measuring aside (where any) and close its pipes; ``why`` it
    was stopped, where it failed, is said in a warning."""
    if helper is None:
        return
    for fd in (helper.go, helper.pipe):
        os.close(fd)
    if why:
        logger.warning("pymc model: the child measuring the ranks' graph aside %s; killed", why)
    stop_process(helper.pid, reap=True)


def _measured(data):
    try:
        measured = json.loads(data)
        return {str(m): (float(s), float(c)) for m, (s, c) in measured.items()}
    except (ValueError, TypeError, AttributeError):
        return {}
