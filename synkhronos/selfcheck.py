"""The self-check behind ``python -m synkhronos --check``: fork, call, every collective.

Nothing here prints: ``check()`` returns the steps and hands each to
``on_step`` as it is taken, so the program can print them as they come.
"""

import math
import os
import signal
import traceback
from dataclasses import dataclass

import numpy as np


@dataclass
class Step:
    """One step of ``check()``: its name, whether it passed, and what went wrong."""

    name: str
    ok: bool
    detail: str = ""


class _Timeout(Exception):
    pass


class _Steps(list):
    """The check's steps; each is also handed to ``on_step`` as it is taken."""

    def __init__(self, on_step):
        super().__init__()
        self.on_step = on_step

    def append(self, step):
        super().append(step)
        if self.on_step is not None:
            self.on_step(step)


def check(n_parallel=None, use_gpu=False, timeout=120, on_step=None):
    """Fork, run a function call and every collective, compare with NumPy; return the steps.

    Runs in the calling process (it becomes the master) and closes the
    runtime before returning, whatever happened.

    Args:
        n_parallel: number of ranks; default every usable core (or GPU).
        use_gpu: passed on to ``synk.fork``.
        timeout: seconds before the check gives up (a step that hangs fails), or math.inf.
        on_step: called with each ``Step`` as it is taken (to print as it goes).

    Returns:
        A list of ``Step``; the check passed if every step is ``ok``.

    Raises:
        ValueError: ``timeout`` is not a number > 0.
    """
    import synkhronos as synk
    from .runtime.state import get_runtime

    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"check: timeout must be a number of seconds > 0 or math.inf; got {timeout!r}")
    steps = _Steps(on_step)

    def on_alarm(signum, frame):
        raise _Timeout(f"no answer within {timeout:g} s")

    timed = math.isfinite(timeout)
    old = signal.signal(signal.SIGALRM, on_alarm) if timed else None
    if timed:
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        try:
            n = synk.fork(n_parallel, use_gpu=use_gpu)
            steps.append(Step(f"fork ({n} ranks, {get_runtime().config.device} mode)", True))
        except Exception as exc:  # noqa: BLE001 - reported as the step's failure
            steps.append(Step("fork", False, _why(exc)))
            return steps
        _collective_steps(synk, n, steps)
    except _Timeout as exc:
        steps.append(Step("timeout", False, str(exc)))
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        rt = get_runtime()
        pid = os.getpid()
        try:
            if rt is not None and not rt.closed:
                synk.close()
            left = [f for f in os.listdir("/dev/shm") if f.startswith(f"synk_{pid}_")]
            steps.append(Step("close (no segment left)", not left,
                              f"left in /dev/shm: {left}" if left else ""))
        except Exception as exc:  # noqa: BLE001
            steps.append(Step("close", False, _why(exc)))
    return steps


def _why(exc):
    tb = traceback.format_exception_only(type(exc), exc)
    return "".join(tb).strip()


def _collective_steps(synk, n, steps):
    """Build, distribute, call, then each collective; a failed step does not stop the rest."""
    import pytensor
    import pytensor.tensor as pt

    rows = 2 * n + 1                                    # uneven: some ranks get one more
    x_np = np.arange(rows * 3, dtype="float64").reshape(rows, 3) / 7.0
    parts = np.array_split(x_np, n)
    x = pt.dmatrix("x")
    s = pytensor.shared(np.zeros(3), name="doctor_s")
    v = pytensor.shared(np.zeros(0), name="doctor_v")
    try:
        f = synk.function([x], [(x.sum(axis=0), "sum"), (x.mean(axis=0), "avg"),
                                (x.max(axis=0), "max"), (2 * x, "gather")],
                          updates=[(s, x.sum(axis=0))], name="doctor_f")
        g = synk.function([], (v.sum(), "sum"), name="doctor_g")
        synk.distribute()
        steps.append(Step("build and distribute", True))
    except Exception as exc:  # noqa: BLE001
        steps.append(Step("build and distribute", False, _why(exc)))
        return

    def step(name, body):
        try:
            body()
            steps.append(Step(name, True))
        except _Timeout:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as the step's failure
            steps.append(Step(name, False, _why(exc)))

    def call():
        got = f(synk.data(x_np))
        _same("sum", got[0], x_np.sum(axis=0))
        _same("avg", got[1], x_np.mean(axis=0))
        _same("max", got[2], x_np.max(axis=0))
        _same("gather", got[3], 2 * x_np)

    def gather():
        _same("gather(s)", synk.gather(s), np.stack([p.sum(axis=0) for p in parts]))

    def broadcast():
        a = np.array([1.5, -2.0, 3.25])
        synk.broadcast(s, a)
        _same("broadcast then gather", synk.gather(s), np.tile(a, (n, 1)))

    def scatter():
        whole = np.arange(rows, dtype="float64")
        synk.scatter(v, whole)
        _same("get_lengths", np.asarray(synk.get_lengths(v)), [len(p) for p in parts])
        _same("gather(nd_up=0)", synk.gather(v, nd_up=0), whole)
        _same("call on scattered", g(), whole.sum())

    def all_gather():
        synk.all_gather(v)
        whole = np.arange(rows, dtype="float64")
        _same("all_gather", synk.gather(v, nd_up=0), np.tile(whole, n))

    def set_get():
        for r in range(n):
            synk.set_value(r, s, np.full(3, float(r + 1)))
        for r in range(n):
            _same(f"get_value(rank {r})", synk.get_value(r, s), np.full(3, float(r + 1)))

    def reduce():
        _same("reduce sum", synk.reduce(s, op="sum", in_place=False),
              np.full(3, n * (n + 1) / 2))

    def all_reduce():
        # Each op from values that differ by rank (r + 1), so none can pass by accident.
        for op, want in (("avg", (n + 1) / 2), ("max", float(n))):
            for r in range(n):
                synk.set_value(r, s, np.full(3, float(r + 1)))
            synk.all_reduce(s, op=op)
            _same(f"all_reduce {op}", synk.gather(s), np.full((n, 3), want))

    step("function call (sum, avg, max, gather, updates)", call)
    step("gather", gather)
    step("broadcast", broadcast)
    step("scatter", scatter)
    step("all_gather", all_gather)
    step("set_value / get_value", set_get)
    step("reduce", reduce)
    step("all_reduce", all_reduce)


def _same(what, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=1e-9):
        raise AssertionError(f"{what}: expected {want.tolist()}, got {got.tolist()}")
