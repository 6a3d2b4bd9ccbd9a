"""Which machine uses which rows (synkhronos/machine_rows.py), against the even split over ranks."""

import numpy as np
import pytest

from synkhronos.inputs import machine_rows, rank_rows
from synkhronos.inputs.rank_rows import RowIndex, RowRange


@pytest.mark.parametrize("n_local", [[1], [2, 2], [2, 1, 3], [1, 1, 1, 1]])
@pytest.mark.parametrize("n_rows", [0, 1, 5, 37, 100])
def test_even_plan_gives_each_rank_the_rows_of_the_even_split(n_local, n_rows):
    n_parallel = sum(n_local)
    idx = np.random.default_rng(n_rows).permutation(max(n_rows, 1) * 2)[:n_rows]
    for sel in (None, RowRange("range", 3, 3 + n_rows), RowIndex("index", idx)):
        plans = machine_rows.even_plan(sel, n_rows, n_local)
        rank = 0
        for plan, k in zip(plans, n_local):
            for i in range(k):
                lo, hi = rank_rows.rank_range(plan.n, k, i)
                g_lo, g_hi = rank_rows.rank_range(n_rows, n_parallel, rank)
                assert hi - lo == g_hi - g_lo
                mine = machine_rows.gather_rows(np.arange(1000), plan.sel)[lo:hi]
                whole = rank_rows.take(np.arange(1000), sel, g_lo, g_hi)
                np.testing.assert_array_equal(mine, whole)
                rank += 1


def test_owner_plan_keeps_every_row_on_its_machine_once():
    parts = [(0, 10), (10, 13), (13, 13), (13, 30)]
    rng = np.random.default_rng(0)
    idx = rng.permutation(30)[:19]
    for sel in (None, RowRange("range", 5, 25), RowIndex("index", idx)):
        plans = machine_rows.owner_plan(sel, parts)
        got = []
        for (lo, hi), plan in zip(parts, plans):
            rows = machine_rows.gather_rows(np.arange(30), plan.sel)
            assert len(rows) == plan.n and np.all((rows >= lo) & (rows < hi))
            assert (plan.row_lo, plan.row_n) == (lo, hi - lo)
            local = machine_rows.local(plan.sel, plan.row_lo)
            np.testing.assert_array_equal(
                machine_rows.gather_rows(np.arange(lo, hi), local), rows)
            # A minibatch input's rows pair with the positions of these rows in the batch.
            whole = rank_rows.take(np.arange(30), sel, 0, rank_rows.selection_length(sel, 30))
            pos = machine_rows.take_positions(whole, plan.pos, 0, plan.n)
            np.testing.assert_array_equal(pos, rows)
            got.extend(rows.tolist())
        expect = rank_rows.take(np.arange(30), sel, 0, rank_rows.selection_length(sel, 30))
        assert sorted(got) == sorted(expect.tolist())


def test_machine_rows_follow_the_ranks():
    assert machine_rows.machine_rows(37, [1, 1]) == [(0, 19), (19, 37)]
    assert machine_rows.machine_rows(10, [2, 1]) == [(0, 7), (7, 10)]
    assert machine_rows.machine_rows(0, [2, 2]) == [(0, 0), (0, 0)]


def test_balanced_batches_use_every_row_once_and_every_part_in_each_batch():
    parts = [(0, 40), (40, 61), (61, 100)]
    got = list(machine_rows.balanced_batches(parts, 16, np.random.default_rng(0)))
    assert len(got) == 7
    assert sorted(np.concatenate(got).tolist()) == list(range(100))
    for b in got:
        assert 14 <= len(b) <= 16
        for lo, hi in parts:
            share = np.sum((b >= lo) & (b < hi))
            assert abs(share - len(b) * (hi - lo) / 100) <= 1.5
    assert list(machine_rows.balanced_batches([(0, 0)], 4, np.random.default_rng(0))) == []


def test_batches_checks_its_size():
    with pytest.raises(ValueError, match="batch_size"):
        list(machine_rows.batches(10, 0))
    assert sorted(np.concatenate(list(machine_rows.batches(10, 3))).tolist()) == list(range(10))
