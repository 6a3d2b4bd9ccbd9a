"""Combining a call's results: a machine's part (clusters) gives what every rank's results give."""

import types

import numpy as np
import pytest

from synkhronos.comm.reduce_ops import COLLECTIVE_OPS
from synkhronos.functions.outputs import MACHINE_PART_BYTES, MachinePart, collect, machine_part

OPS = ["sum", "avg", "max", "min", "prod", "gather", None, "avg"]
BIG = MACHINE_PART_BYTES // 8 + 7   # float64 elements: over the threshold
N_LOCAL = 3


def _spec(ops):
    return types.SimpleNamespace(outputs=[None] * len(ops), output_ops=ops, return_list=True,
                                 simple=len(ops) == 1 and ops[0] in COLLECTIVE_OPS)


def _collect(spec, parts, subset=None):
    """The master's collect, with ``parts`` as the backend's collect() (rank 0 the master's own)."""
    rt = types.SimpleNamespace(place=types.SimpleNamespace(rank=0),
                               backend=types.SimpleNamespace(scalar_result=lambda op, v, w: None,
                                                             collect=lambda: [None] + parts[1:]))
    return collect(spec, rt, parts[0], subset, "f")


def _results(rng, rows):
    """One rank's results for OPS (rows of its own; the last output is a small 0-d one)."""
    x = 1 + 0.1 * rng.standard_normal((rows, BIG))
    return [x.sum(0), x.mean(0), x.max(0), x.min(0), x.prod(0) ** (1 / max(rows, 1)), 2 * x,
            x.sum(0), np.asarray(x.mean())]


@pytest.mark.parametrize("rows", [[3, 2, 2, 2, 1, 1], [2, 2, 2, 0, 3, 1]])
def test_a_machine_part_gives_what_every_rank_gives(rows):
    rng = np.random.default_rng(1)
    spec = _spec(OPS)
    per_rank = [None if r == 0 else (_results(rng, r), float(r)) for r in rows]
    want = _collect(spec, list(per_rank))
    # Machine 1 holds ranks 3..5: its node master combines them before they travel.
    entries = [(q, p[0], p[1]) for q, p in enumerate(per_rank) if q >= N_LOCAL and p is not None]
    sent = machine_part(spec, None, entries, N_LOCAL, N_LOCAL)
    assert len(sent) == 1 and type(sent[0][1]) is MachinePart
    part = sent[0][1]
    assert type(part.outputs[6]) is list and type(part.outputs[7]) is list  # op None, and small
    assert all(type(v) is tuple for v in part.outputs[:6])                   # one array each
    parts = per_rank[:N_LOCAL] + [(part, sent[0][2])] + [None] * (N_LOCAL - 1)
    got = _collect(spec, parts)
    for op, g, w in zip(OPS, got, want):
        if op in ("max", "min", "gather"):
            np.testing.assert_array_equal(g, w)
        elif op is None:
            assert len(g) == len(w) == len(rows)
            for a, b in zip(g, w):
                assert (a is None) == (b is None)
                if a is not None:
                    np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-12)
            assert g.dtype == w.dtype


def test_a_machine_part_keeps_what_combining_would_not_save():
    spec = _spec(["sum"])
    one = [(3, [np.ones(BIG)], 2.0)]
    assert machine_part(spec, None, one, 3, 3) is one                      # one rank: as it is
    small = [(3, [np.ones(4)], 1.0), (4, [np.ones(4)], 1.0)]
    assert machine_part(spec, None, small, 3, 2) is small                  # nothing big
    ragged = [(3, [np.ones(BIG)], 1.0), (4, [np.ones(BIG + 1)], 1.0)]
    assert machine_part(spec, None, ragged, 3, 2) is ragged                # the master names shapes


def test_a_machine_part_follows_output_subset():
    rng = np.random.default_rng(2)
    spec = _spec(OPS)
    subset = [5, 0]
    per_rank = [([r[i] for i in subset], 2.0) for r in (_results(rng, 2) for _ in range(4))]
    want = _collect(spec, list(per_rank), subset)
    entries = [(q, p[0], p[1]) for q, p in enumerate(per_rank) if q >= 2]
    sent = machine_part(spec, subset, entries, 2, 2)
    got = _collect(spec, per_rank[:2] + [(sent[0][1], sent[0][2]), None], subset)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-12)
