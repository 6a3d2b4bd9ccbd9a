"""How many chunks a chunked call is cut into: fewer where a chunk's fixed cost shows, more
where a pass over the rows ran faster in them.

Why: each chunk is a call of the compiled function, and such a call costs a
fixed time beside its rows: 4-8 us for a radon-style PyMC model's rank graph
in Numba (its nodes' dispatch and allocations; bench/pymc_calls.py --parts
chunk), and as long as its whole terms take where those are large (a PyMC
model's imputed covariates: 1.2 ms).  Cut into the rows' rule's 16 chunks at 10^5 rows, where
all its rows take 100-200 us, the radon model's call ran 1.10-1.12x PyMC's
serial call on 2 ranks, against 1.6x in one share a rank (bench/pymc_calls.py
--parts ratio, bench/RESULTS.md).  Chunks pay where a rank falls behind (its
core taken by another program) and cost where their fixed time shows.  Yet a
chunk's rows also cost less where they stay in a core's cache between the
graph's passes over them, which a line through a call's fixed cost and its
rows' time cannot see: a splines model's 17-column basis, read by its ``dot``
and again by the gradient's, kept 4 chunks by that line, and its call on 2
ranks ran 1.38x faster in the count its passes chose (bench/RESULTS.md,
2026-12-07).

So the first call of a function at a row count (and inputs' shapes) times its
chunk 0 and a sixteenth of it, which gives the call's fixed cost and the
rows' work (``_measured``), and takes up to ``BALANCED`` chunks, fewer where
the fixed cost would be more than ``SHARE`` of a chunk's time (``fewest``),
but never fewer than the machine's cores (or two), so that every core still
has a chunk at any number of ranks.  It then times a pass over all the rows
in each power of two of chunks up to the rows' rule's count (``passes``) and
keeps that count unless another ran its pass over ``SHARE`` faster: then the
fastest (``chosen``).  The count depends on the graph, its rows and the
machine, never on the number of ranks, and is kept on disk
(``measures.MeasureFile``): so every later call and run cuts those rows the
same way, at 1, 2 or 4 ranks and on the machines of a cluster led from this
one, and returns the same bits.  ``SYNK_CHUNK_ROWS`` fixes the rows of a
chunk instead.
"""

import logging
import os
import time
from typing import NamedTuple

import numpy as np

from .measures import MeasureFile, digest, graph_text

logger = logging.getLogger(__name__)

CHUNK_ROWS_ENV = "SYNK_CHUNK_ROWS"
MIN_ROWS = 1024     # a chunk's fewest rows: below, a call's fixed cost (10-15 us) shows
MAX_CHUNKS = 256    # the rows' rule's most (timed): at 10^6 rows, ~4000 rows a chunk (a core's cache)
BALANCED = 16       # chunks enough for ranks to balance: more only where a pass ran faster

SHARE = 0.05
"""The most of a chunk's time that its fixed cost may take where fewer chunks would do; and
how much slower than the fastest a pass over the rows in the count so found may be and stay."""

PAST = 1.5
"""A pass this many times the fastest so far ends the timing: more chunks would cost more."""

MACHINERY_S = 1e-6
"""A chunk's cost beside its function's call: its claim, its flag, its results combined."""

LONG_S = 0.01
"""A call or pass that takes this long is timed twice, not three times: noise cannot show."""

KEPT = MeasureFile("synkhronos_chunks.json")
RULE = "passes"     # in the key on disk: counts kept by an older rule are measured again


class Fit(NamedTuple):
    """What a function's chunks were cut by: ``chunks`` of the call, each costing
    ``fixed_s`` beside its rows, and ``row_s`` a row (seconds)."""

    chunks: int
    fixed_s: float
    row_s: float

    def fixed_per_rank(self, ranks):
        """Seconds a rank's share of the chunks costs beside its rows, on ``ranks`` ranks."""
        return -(-self.chunks // max(1, ranks)) * (self.fixed_s + MACHINERY_S)


def chunk_rows(n_rows, env=os.environ):
    """Rows per chunk for a call of ``n_rows`` rows, or 0: no chunks (the static split).

    A power of two of chunks (at most ``MAX_CHUNKS``, each at least ``MIN_ROWS``
    rows), so that 2, 4 or 8 ranks on a quiet machine get equal shares; it
    depends on the rows only, never on the ranks.  The rows' rule: ``Pace``
    then keeps fewer where these would be small, or more where those ran faster.
    """
    setting = env.get(CHUNK_ROWS_ENV)
    if setting is not None and setting.strip() != "":
        try:
            rows = int(setting)
        except ValueError:
            raise ValueError(f"{CHUNK_ROWS_ENV} must be an integer number of rows (0: off); "
                             f"got {setting!r}") from None
        if rows < 0:
            raise ValueError(f"{CHUNK_ROWS_ENV} must be >= 0 (0: off); got {rows}")
        return rows if rows and n_rows >= 2 * rows else 0
    n = min(n_rows // MIN_ROWS, MAX_CHUNKS)
    if n < 2:
        return 0
    n = 1 << (n.bit_length() - 1)
    return -(-n_rows // n)


def fewest(fixed_s, work_s, n, cores):
    """The chunks to cut rows into where the rows' rule cuts ``n`` (a power of two), a
    call costs ``fixed_s`` beside its rows and all the rows take ``work_s``: the most (a
    power of two) whose fixed cost is at most ``SHARE`` of a chunk's time, at least the
    machine's ``cores`` (rounded up to a power of two) and 2, at most ``n``."""
    each = fixed_s + MACHINERY_S
    fit = 1
    while fit < n and each <= SHARE * (work_s / (fit * 2) + each):
        fit *= 2
    return min(n, max(fit, fewest_chunks(cores)))


def fewest_chunks(cores):
    """The fewest chunks a call is cut into on a machine of ``cores`` cores: one a core,
    rounded up to a power of two, and at least 2 (else the static split would do)."""
    floor = 2
    while floor < cores:
        floor *= 2
    return floor


def chosen(count, seconds):
    """``count``, unless the pass over the rows in another count of ``seconds`` (chunks ->
    a pass's seconds) ran over ``SHARE`` faster (or ``count``'s was not timed): then the
    fastest."""
    if not seconds:
        return count
    fastest = min(seconds, key=seconds.get)
    mine = seconds.get(count)
    return count if mine is not None and mine <= (1.0 + SHARE) * seconds[fastest] else fastest


def passes(run, n_rows, floor, most):
    """chunks -> seconds of a pass over all ``n_rows`` rows cut into that many chunks, each
    a power of two from ``floor`` to ``most``; ``run(lo, hi)`` runs rows ``lo:hi`` and
    returns the outputs.

    Stops where a pass took over ``PAST`` times the fastest so far: further chunks
    would only add their fixed costs (a chunk's rows in cache gain less than that).
    """
    seconds, n = {}, floor
    while n <= most:
        rows = -(-n_rows // n)
        bounds = [(lo, min(n_rows, lo + rows)) for lo in range(0, n_rows, rows)]

        def one_pass():
            # Each chunk's results added up as the master combines them: large outputs
            # (a network's gradient) make more chunks cost more there too.
            total = None
            for lo, hi in bounds:
                out = run(lo, hi)
                if total is None:
                    total = [np.array(o) for o in out]
                else:
                    for t, o in zip(total, out):
                        np.add(t, o, out=t, casting="unsafe")
        seconds[n] = _least(one_pass, 3)
        if seconds[n] > PAST * min(seconds.values()):
            break
        n *= 2
    return seconds


class Pace:
    """A function's chunk counts, per (rows, shapes) of a call: measured once, then kept."""

    def __init__(self):
        self.known = {}      # (rows, shapes) -> chunks
        self.fits = {}       # (rows, shapes) -> Fit, where measured (here or by an earlier run)
        self.graph = None    # the function's graph as printed, for the key on disk

    def fit(self, n_rows, shapes):
        """The ``Fit`` of calls of ``n_rows`` rows at ``shapes``, or None where not measured
        (the rows fixed by ``SYNK_CHUNK_ROWS``, too few rows for fewer chunks)."""
        return self.fits.get((n_rows, shapes))

    def rows(self, fn, n_rows, rows, shapes, run):
        """Rows per chunk for a call of ``n_rows`` rows that the rows' rule cuts into
        chunks of ``rows``: those or another count (see the module's docstring).

        ``fn`` is the compiled PyTensor function, ``shapes`` the inputs' shapes past the
        rows, ``run(lo, hi)`` runs it on rows ``lo:hi``.
        """
        n = -(-n_rows // rows)
        cores = os.cpu_count() or 1
        floor = fewest_chunks(cores)
        if os.environ.get(CHUNK_ROWS_ENV, "").strip() or n <= floor:
            return rows   # the rows fixed by the setting, or no other count to time
        local = (n_rows, shapes)
        count = self.known.get(local)
        if count is None:
            key = self._key(fn, n_rows, shapes)
            fit = _kept(KEPT.get(key) if key is not None else None, n)
            if fit is None:
                fixed_s, row_s = _measured(lambda r: run(0, r), rows)
                count = fewest(fixed_s, row_s * n_rows, min(n, BALANCED), cores)
                seconds = passes(run, n_rows, floor, n)
                fit = Fit(chosen(count, seconds), fixed_s, row_s)
                logger.debug("chunks: %d rows a call in %d chunks (%d by its fixed cost; a pass "
                             "over them: %s us; a call %.1f us beside its rows, %.2f ns a row)",
                             n_rows, fit.chunks, count,
                             ", ".join(f"{k} chunks {s * 1e6:.0f}" for k, s in seconds.items()),
                             fixed_s * 1e6, row_s * 1e9)
                if key is not None:
                    KEPT.put(key, fit._asdict())
            self.fits[local] = fit
            count = self.known[local] = fit.chunks
        return -(-n_rows // count)

    def _key(self, fn, n_rows, shapes):
        if self.graph is None:
            self.graph = graph_text(fn.maker.fgraph) or ""
        if not self.graph:
            return None
        return digest(self.graph, type(fn.maker.linker).__name__, n_rows, shapes, RULE)


def _kept(value, n):
    """The ``Fit`` kept on disk as ``value``, or None where it is none a call cut by the rows'
    rule into ``n`` chunks could take (absent, written by another version, or damaged)."""
    try:
        fit = Fit(**value)
        chunks, fixed_s, row_s = int(fit.chunks), float(fit.fixed_s), float(fit.row_s)
    except (TypeError, ValueError):
        return None
    if chunks != fit.chunks or not 2 <= chunks <= n or chunks & (chunks - 1):
        return None
    if not (0.0 <= fixed_s < 1e3 and 0.0 <= row_s < 1e3):
        return None
    return Fit(chunks, fixed_s, row_s)


def _measured(run, rows):
    """(a call's seconds beside its rows, seconds a row): ``run`` timed on ``rows`` rows and on a
    sixteenth of them, the least of 3 calls each (2 of the whole where one took over
    ``LONG_S``: its fixed cost cannot show then); the first call is often slower (the
    inputs' pages faulted in, the function's first run)."""
    few = max(1, rows // 16)
    whole = _least(lambda: run(rows), 3)
    part = _least(lambda: run(few), 3)
    row_s = max(0.0, (whole - part) / (rows - few))
    return max(0.0, part - row_s * few), row_s


def _least(call, calls):
    best = None
    for i in range(calls):
        t0 = time.perf_counter()
        call()
        t = time.perf_counter() - t0
        best = t if best is None else min(best, t)
        if i and best >= LONG_S:
            break
    return best
