"""cluster.layout: where the ranks are."""

import pytest

import synkhronos as synk
from synkhronos.cluster.layout import Layout

def test_layout_numbers_ranks_machine_by_machine():
    lay = Layout([2, 3, 1], ["a", "b", "c"])
    assert lay.n_machines == 3 and lay.n_parallel == 6 and lay.offsets == [0, 2, 5]
    assert list(lay.ranks(1)) == [2, 3, 4]
    assert [lay.machine_of(r) for r in range(6)] == [0, 0, 1, 1, 1, 2]
    assert "machine 1 (b, ranks 2..4)" == lay.describe(1)
    # An error path may name a machine that was still joining (past the layout).
    assert lay.describe(3) == "machine 3 (joining)"
    with pytest.raises(ValueError):
        lay.machine_of(6)


def test_layout_on_one_machine(forked):
    n = forked(2)
    lay = synk.layout()
    assert lay.n_machines == 1 and lay.n_local == [n] and list(lay.ranks(0)) == [0, 1]


def test_layout_needs_fork():
    with pytest.raises(synk.SynkStateError):
        synk.layout()
