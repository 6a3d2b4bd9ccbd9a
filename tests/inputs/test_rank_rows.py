"""split: per-rank ranges and selections, checked against NumPy's own splitting."""

import numpy as np
import pytest

from synkhronos.inputs import rank_rows
from synkhronos.inputs.rank_rows import RowIndex, RowRange


def _array_split_ranges(n, p):
    """(lo, hi) per part of numpy.array_split: the first n % p parts get one more."""
    bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(n), p)])
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 11, 100])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_split_ranges_and_rank_range_match_array_split(n, p):
    expected = _array_split_ranges(n, p)
    assert rank_rows.split_ranges(n, p) == expected
    assert [rank_rows.rank_range(n, p, r) for r in range(p)] == expected


def test_split_ranges_first_ranks_get_the_extra_rows():
    assert rank_rows.split_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert rank_rows.split_ranges(2, 3) == [(0, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("batch, expected", [
    (5, ("range", 0, 5)),
    (0, ("range", 0, 0)),
    (np.int32(4), ("range", 0, 4)),
    (slice(2, 6), ("range", 2, 6)),
    (slice(None, 3), ("range", 0, 3)),
    (slice(3, None), ("range", 3, None)),
    (slice(1, 4, 1), ("range", 1, 4)),
])
def test_normalize_batch_ranges(batch, expected):
    assert rank_rows.normalize_batch(batch) == expected


@pytest.mark.parametrize("batch", [[3, 0, 2], (1, 1, 4), np.array([5, 2], dtype=np.int32),
                                   np.array([7, 1, 0], dtype=np.uint8), [],
                                   np.array([2**63 - 1, 3], dtype=np.uint64)])
def test_normalize_batch_index_lists(batch):
    kind, idx = rank_rows.normalize_batch(batch)
    assert kind == "index"
    assert idx.dtype == np.int64
    np.testing.assert_array_equal(idx, np.asarray(batch, dtype=np.int64))


@pytest.mark.parametrize("batch, exc, words", [
    (-1, ValueError, ">= 0"),
    (slice(0, 6, 2), ValueError, "step"),
    (slice(1.0, 4), TypeError, "start and stop"),
    (slice(0, "4"), TypeError, "start and stop"),
    (slice(-2, 4), ValueError, ">= 0"),
    (slice(5, 3), ValueError, "stop must be >= start"),
    ([1.0, 2.0], TypeError, "1-d integers"),
    ([[0, 1], [2, 3]], TypeError, "1-d integers"),
    ([2, -1], ValueError, ">= 0"),
    (1.5, TypeError, "must be an int"),
    ("3", TypeError, "must be an int"),
    (True, TypeError, "must be an int"),
    (None, TypeError, "must be an int"),
    # uint64 indices past int64 would wrap to negative rows when cast
    (np.array([2**64 - 1], "uint64"), IndexError, "out of range"),
    ([2**64 - 1], IndexError, "out of range"),
    (np.array([0, 2**63], "uint64"), IndexError, "below 2**63"),
    ([2**70], TypeError, "1-d integers"),
    ([0, True], TypeError, "not bools"),
    ([np.True_], TypeError, "not bools"),
    (np.array([True, False]), TypeError, "1-d integers"),
    ([[0], [1, 2]], TypeError, "1-d integers"),
])
def test_normalize_batch_rejects(batch, exc, words):
    with pytest.raises(exc, match="batch") as info:
        rank_rows.normalize_batch(batch)
    assert words in str(info.value)


@pytest.mark.parametrize("sel, length, expected", [
    (None, 9, 9),
    (RowRange("range", 2, 6), 9, 4),
    (RowRange("range", 3, None), 9, 6),
    (RowRange("range", 8, None), 5, 0),
    (RowIndex("index", np.array([4, 4, 0])), 9, 3),
])
def test_selection_length(sel, length, expected):
    assert rank_rows.selection_length(sel, length) == expected


def test_rows_needed_and_resolve():
    assert rank_rows.rows_needed(None, 9) == 0
    assert rank_rows.rows_needed(RowRange("range", 2, 6), 9) == 6
    assert rank_rows.rows_needed(RowRange("range", 2, None), 9) == 9
    assert rank_rows.rows_needed(RowIndex("index", np.array([3, 8, 1])), 9) == 9
    assert rank_rows.resolve_selection(RowRange("range", 2, None), 9) == ("range", 2, 9)
    assert rank_rows.resolve_selection(RowRange("range", 2, 5), 9) == ("range", 2, 5)
    assert rank_rows.resolve_selection(None, 9) is None


def test_take_range_is_a_view_of_the_right_rows():
    a = np.arange(30.0).reshape(10, 3)
    sel = rank_rows.normalize_batch(slice(2, 9))
    got = rank_rows.take(a, sel, 1, 4)
    np.testing.assert_array_equal(got, a[2:9][1:4])
    assert np.shares_memory(got, a)
    np.testing.assert_array_equal(rank_rows.take(a, None, 3, 7), a[3:7])


def test_take_index_list_gathers_rows_in_selection_order():
    a = np.arange(30.0).reshape(10, 3)
    idx = [9, 0, 4, 4, 7]
    sel = rank_rows.normalize_batch(idx)
    got = rank_rows.take(a, sel, 1, 4)
    np.testing.assert_array_equal(got, a[idx][1:4])


def test_take_minibatch_pairs_rows_with_selection_positions():
    m = np.arange(12.0).reshape(6, 2)
    sel = rank_rows.normalize_batch([9, 3, 7])
    np.testing.assert_array_equal(rank_rows.take(m, sel, 1, 3, minibatch=True), m[1:3])


def test_splitting_a_selection_over_ranks_covers_it_once():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((20, 2))
    idx = rng.permutation(20)[:13]
    sel = rank_rows.normalize_batch(idx)
    n = rank_rows.selection_length(sel, len(a))
    parts = [rank_rows.take(a, sel, *rank_rows.rank_range(n, 3, r)) for r in range(3)]
    np.testing.assert_array_equal(np.concatenate(parts), a[idx])


def test_normalize_batch_s_one_selection_for_every_rank():
    out = rank_rows.normalize_batch_s(slice(1, 3), 3)
    assert out == [("range", 1, 3)] * 3
    out = rank_rows.normalize_batch_s([2, 0], 2)
    assert len(out) == 2
    for kind, idx in out:
        assert kind == "index"
        np.testing.assert_array_equal(idx, [2, 0])


def test_normalize_batch_s_one_selection_per_rank():
    out = rank_rows.normalize_batch_s([slice(0, 2), slice(1, 3), slice(2, 4)], 3)
    assert out == [("range", 0, 2), ("range", 1, 3), ("range", 2, 4)]
    out = rank_rows.normalize_batch_s([[1], [0, 2]], 2)
    np.testing.assert_array_equal(out[0][1], [1])
    np.testing.assert_array_equal(out[1][1], [0, 2])
    out = rank_rows.normalize_batch_s([np.array([3]), np.array([1, 2])], 2)
    np.testing.assert_array_equal(out[1][1], [1, 2])


@pytest.mark.parametrize("batch_s, exc", [
    ([slice(0, 1), slice(0, 1)], ValueError),          # 2 selections for 3 ranks
    ([slice(0, 1), [0], [1]], TypeError),               # mixed types
    (4, TypeError),                                     # an int is not allowed in batch_s
    (slice(0, 4, 2), ValueError),
    ("0:2", TypeError),
])
def test_normalize_batch_s_rejects(batch_s, exc):
    with pytest.raises(exc, match="batch_s"):
        rank_rows.normalize_batch_s(batch_s, 3)
