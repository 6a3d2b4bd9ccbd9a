"""Where the time goes: per rank and per command, input gather, compute, waits, collectives, control.

``synk.profile()`` switches recording on in every rank for the commands run
inside it.  Each rank keeps a lap timer per command: every checkpoint of the
command's path books the time since the previous one under one category, so
a rank's categories add up to its wall time in that command:

- ``control``: posting or reading the command's message, dispatch, status;
- ``gather``: selecting this rank's input rows (``batch=`` index lists);
- ``compute``: the compiled function (and a fused step's follow-up call);
- ``collective``: backend calls (reductions, all-reduce, broadcast, ...),
  barriers inside them included;
- ``wait``: the master waiting at the end barrier for the slowest rank;
- ``reduce``: the master combining the ranks' results.

With profiling off, the hot path pays one attribute test per checkpoint.
"""

import json
import pickle
import time
from typing import NamedTuple

import numpy as np

from .commands import Command, handler
from .run import run_command
from ..errors import SynkStateError
from .state import require_forked, serialized

CATEGORIES = ("control", "gather", "compute", "collective", "wait", "reduce")


class Profiler:
    """One process's record: a lap timer over the current command, and the commands done."""

    def __init__(self, rank):
        self.rank = rank
        self.records = []       # (what, start ns, [(category, t0 ns, t1 ns), ...])
        self._what = None
        self._start = 0
        self._last = 0
        self._laps = None
        self._depth = 0
        self.marks = []         # where each open synk.profile() began in records, outermost first
        self.contexts = []      # the master's open synk.profile() blocks, outermost first

    def mark(self):
        """Return where the records of a profile opened now begin (after the current command)."""
        return len(self.records) + (self._laps is not None)

    def begin(self, what, start_ns=None):
        """Start timing a command (``what`` names it in tables and traces).

        A command run inside another (a message area that must grow) is
        booked as part of the outer one.
        """
        self._depth += 1
        if self._depth > 1:
            return
        self._what = what
        self._start = self._last = time.perf_counter_ns() if start_ns is None else start_ns
        self._laps = []

    def lap(self, category):
        """Book the time since the last checkpoint under ``category``."""
        now = time.perf_counter_ns()
        if self._laps is not None:
            self._laps.append((category, self._last, now))
        self._last = now

    def end(self, category="control"):
        """Book the rest under ``category`` and keep the command's record."""
        if self._laps is None:
            return
        self.lap(category)
        self._depth = max(self._depth - 1, 0)
        if not self._depth:
            self.records.append((self._what, self._start, self._laps))
            self._laps = None


class ProfileMsg(NamedTuple):
    """PROFILE: start recording (``on``), or stop and send the records to the master."""

    on: bool


def _open(rt):
    """Start a profile in this process: the first one switches recording on."""
    if rt.profiler is None:
        rt.profiler = Profiler(rt.place.rank)
    rt.profiler.marks.append(rt.profiler.mark())


def _close(rt):
    """End the innermost profile here; return its records (an outer profile keeps them too)."""
    prof = rt.profiler
    if prof is None or not prof.marks:
        return []
    records = prof.records[prof.marks.pop():]
    if not prof.marks:
        rt.profiler = None
    return records


@handler(Command.PROFILE, ProfileMsg, collected=True)
def _profile_worker(rt, msg):
    if msg.on:
        _open(rt)
        return
    records = _close(rt)
    rt.backend.contribute([np.frombuffer(pickle.dumps(records), dtype=np.uint8)])


class Profile:
    """The records of ``synk.profile()``: every rank's commands, with a table and a trace.

    Attributes:
        records: rank to a list of ``(what, start ns, [(category, t0 ns, t1 ns)])``.
    """

    def __init__(self):
        self.records = {}

    def totals(self):
        """Return ``{rank: {what: {category: seconds, "wall": seconds, "calls": n}}}``."""
        out = {}
        for rank, recs in self.records.items():
            per = out.setdefault(rank, {})
            for what, _, laps in recs:
                row = per.setdefault(what, dict.fromkeys(CATEGORIES, 0.0) | {"wall": 0.0,
                                                                            "calls": 0})
                row["calls"] += 1
                for cat, t0, t1 in laps:
                    row[cat] += (t1 - t0) / 1e9
                if laps:
                    row["wall"] += (laps[-1][2] - laps[0][1]) / 1e9
        return out

    def table(self):
        """Return the breakdown as text: per rank and command, mean ms per call by category."""
        head = ["rank", "command", "calls"] + list(CATEGORIES) + ["wall"]
        rows = []
        for rank, per in sorted(self.totals().items()):
            for what, row in sorted(per.items()):
                n = row["calls"]
                rows.append([str(rank), what, str(n)] +
                            [f"{1e3 * row[c] / n:.3f}" for c in CATEGORIES] +
                            [f"{1e3 * row['wall'] / n:.3f}"])
        widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
        lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths)),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
        return "mean ms per call\n" + "\n".join(lines)

    def trace(self):
        """Return a Chrome / Perfetto trace (a dict ready for ``json.dump``): a track per rank."""
        events = []
        t_zero = min((laps[0][1] for recs in self.records.values() for _, _, laps in recs
                      if laps), default=0)
        for rank, recs in sorted(self.records.items()):
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                           "args": {"name": f"rank {rank}"}})
            for what, _, laps in recs:
                if not laps:
                    continue
                events.append({"name": what, "cat": "command", "ph": "X", "pid": 0, "tid": rank,
                               "ts": (laps[0][1] - t_zero) / 1e3,
                               "dur": (laps[-1][2] - laps[0][1]) / 1e3})
                for cat, t0, t1 in laps:
                    if t1 > t0:
                        events.append({"name": cat, "cat": what, "ph": "X", "pid": 0,
                                       "tid": rank, "ts": (t0 - t_zero) / 1e3,
                                       "dur": (t1 - t0) / 1e3})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_trace(self, path):
        """Write ``trace()`` as JSON to ``path``; open it in ui.perfetto.dev or chrome://tracing."""
        with open(path, "w") as f:
            json.dump(self.trace(), f)


class _ProfileContext:
    def __init__(self):
        self.profile = Profile()
        self._rt = None
        self._depth = 0

    @serialized
    def __enter__(self):
        rt = require_forked("profile()")
        if self._rt is not None:
            raise SynkStateError("profile(): this profile is open already; nest a new "
                                 "synk.profile() instead")
        run_command(rt, Command.PROFILE, ProfileMsg(True))
        _open(rt)
        rt.profiler.contexts.append(self)
        self._rt, self._depth = rt, len(rt.profiler.marks)
        return self.profile

    @serialized
    def __exit__(self, exc_type, exc, tb):
        rt, self._rt = self._rt, None
        if rt is None or rt.closed:
            # The run ended inside the block (a dead worker, Ctrl-C), or close() ended the
            # profile already: nothing (more) to collect, and the error that ended the
            # run, if still on its way, is the one to see.
            return False
        if rt.profiler is None or len(rt.profiler.marks) != self._depth:
            raise SynkStateError("profile(): nested profiles must end in reverse order")
        self._finish(rt)
        return False

    def _finish(self, rt):
        """End this (the innermost) profile on every rank and keep their records."""
        rt.profiler.contexts.remove(self)
        mine = _close(rt)

        def after(_):
            got = rt.backend.collect()
            got[rt.place.rank] = None
            records = {q: pickle.loads(g[0][0].tobytes()) for q, g in enumerate(got)
                       if g is not None}
            records[rt.place.rank] = mine
            return records
        self.profile.records = run_command(rt, Command.PROFILE, ProfileMsg(False), after=after)


def end_open_profiles(rt):
    """``close()`` inside ``synk.profile()`` blocks: end them first, innermost first.

    Each profile then holds the commands run up to ``close()``; leaving its
    block later collects nothing more.
    """
    while rt.profiler is not None and rt.profiler.contexts:
        ctx = rt.profiler.contexts[-1]
        ctx._rt = None
        ctx._finish(rt)


def profile():
    """Return a context manager that records where every rank's time goes.  Master only.

    Inside the ``with`` block, every command (calls, collectives, data
    allocation) is timed on every rank; on leaving it, the records come to
    the master.

    Profiles nest: an inner one records its block, and its commands count in
    the outer one too.  ``synk.close()`` inside the block ends the profile
    first: it holds the commands run up to ``close()``.  If the run ends
    inside the block otherwise (a worker died, Ctrl-C), the error that ended
    it goes on and the profile stays empty.

    Example:
        ```python
        with synk.profile() as prof:
            for _ in range(10):
                train_step(x_data, y_data, batch=idx)
        text = prof.table()               # mean ms per call, by rank and category
        prof.write_trace("steps.json")    # one track per rank, for ui.perfetto.dev
        ```

    Returns:
        A context manager; ``with synk.profile() as prof`` gives a ``Profile``.

    Raises:
        SynkStateError: before fork(); nested profiles ended out of order.
    """
    return _ProfileContext()
