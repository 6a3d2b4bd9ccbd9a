"""Chunked calls in a cluster: each rank its even share of the chunks, combined in chunk order.

Why: a cluster's static split follows the ranks (each machine its ranks'
rows), so a reduction's bits change with the number of machines and ranks,
and ``dp.sample`` with a fixed seed drew other draws on 2 machines than on
one.  Here the rows are cut into the chunks one machine cuts
(``chunks.chunk_rows``, by the row count, the count timed fastest: pace.py); global rank ``r`` of
``P`` runs chunks ``[n*r//P, n*(r+1)//P)`` one by one and contributes their
results, output after output, chunk after chunk; the master combines them in
chunk order (``in_chunk_order``), as it does on one machine.  The
partials are small (only reductions of small outputs run in chunks) and
travel as a static call's results do, so no board spans the machines; the
price is that ranks do not take chunks as they come free across machines.

Only where every machine holds every row (``chunks.eligible``: no machine plan).
Also what both ways share: a chunk's arguments, and the combination in chunk order.
"""

import numpy as np

from ..comm import reduce_ops
from ..inputs import mappings
from ..runtime.commands import Command
from ..runtime.run import run_command


def chunk_args(plan, arrays, n_scattered):
    """Each chunk's arguments: its rows of the scattered inputs, the broadcast ones whole."""
    bcast = tuple(arrays[n_scattered:])
    return [tuple(a[lo:hi] for a in arrays[:n_scattered]) + bcast
            for lo, hi in map(plan.bounds, range(plan.n_chunks))]


def in_chunk_order(ops, results, weights, bools, listed):
    """The call's outputs: each chunk's ``results`` combined by op, chunk after chunk.

    The one combination both ways use (chunks.py's board on one machine, this
    module's ranks in a cluster), so the bits depend on the rows alone.
    ``bools``: outputs of bools summed or multiplied, which count as integers
    (``outputs.counted``).
    """
    out = []
    for j, op in enumerate(ops):
        parts = [r[j] for r in results]
        if bools[j]:
            parts = [p.astype(np.int_) for p in parts]
        out.append(reduce_ops.combine(op, parts, weights))
    return out if listed else out[0]


def owned(n_chunks, n_parallel, rank):
    """The chunks ``(lo, hi)`` global rank ``rank`` of ``n_parallel`` runs."""
    return n_chunks * rank // n_parallel, n_chunks * (rank + 1) // n_parallel


def _run_chunks(rt, fn, args, lo, hi):
    """Chunks ``lo:hi`` run here: their results, output after output, chunk after chunk."""
    flat = []
    rt.in_call = True
    try:
        for c in range(lo, hi):
            flat.extend(r if type(r) is np.ndarray else np.asarray(r) for r in fn(*args[c]))
    finally:
        rt.in_call = False
    return flat


def master_runner(spec, rt, plan, arrays, n_scattered):
    """``(arm, local, after)``: the master's chunks, then everyone's combined in chunk order.

    ``arm(seq, first)`` before each call hands over chunk 0's results where the
    master just ran them (``chunks.MasterChunks.plan_for``); ``local`` and
    ``after`` are ``run_command``'s.
    """
    fn = spec.fn
    args = chunk_args(plan, arrays, n_scattered)
    n_chunks, n_out = plan.n_chunks, len(spec.outputs)
    weights = [float(hi - lo) for lo, hi in map(plan.bounds, range(n_chunks))]
    ops, listed = spec.output_ops, spec.return_list
    state = [None]

    def arm(seq, first):
        state[0] = first

    def local(seq):
        lo, hi = owned(n_chunks, rt.place.n_parallel, rt.place.rank)
        first, state[0] = state[0], None
        if first is not None and lo == 0 < hi:
            return first + _run_chunks(rt, fn, args, 1, hi)
        return _run_chunks(rt, fn, args, lo, hi)

    def after(mine):
        # Each rank's contribution is (arrays, weight); the weights are the chunks' rows.
        place = rt.place
        parts = rt.backend.collect()
        parts[place.rank] = (mine, None)
        results = []
        for r in range(place.n_parallel):
            lo, hi = owned(n_chunks, place.n_parallel, r)
            if hi == lo:
                continue
            flat = None if parts[r] is None else parts[r][0]
            if flat is None or len(flat) != (hi - lo) * n_out:
                raise RuntimeError(f"rank {r} returned {0 if flat is None else len(flat)} arrays "
                                   f"for chunks {lo}:{hi} of {n_out} outputs each")
            results.extend(flat[i:i + n_out] for i in range(0, len(flat), n_out))
        bools = [op in ("sum", "prod") and np.asarray(v).dtype == np.bool_
                 for op, v in zip(ops, results[0])]
        return in_chunk_order(ops, results, weights, bools, listed)

    return arm, local, after


def run(spec, rt, msg, arrays, first, what, kept=None):
    """Run the spread call ``msg`` on every rank; return its outputs (``first``: chunk 0's)."""
    arm, local, after = master_runner(spec, rt, msg.chunks, arrays, msg.n_scattered)
    arm(None, first)
    return run_command(rt, Command.CALL, msg, local, after, what=what, kept=kept)


def worker_runner(spec, rt, msg):
    """A worker's share of a spread call: its chunks, contributed for the master."""
    plan = msg.chunks
    args = chunk_args(plan, [mappings.view(rt, d) for d in msg.descs], msg.n_scattered)
    fn = spec.ready()
    contribute = rt.backend.contribute

    def run():
        lo, hi = owned(plan.n_chunks, rt.place.n_parallel, rt.place.rank)
        contribute(_run_chunks(rt, fn, args, lo, hi) or None)
    return run
