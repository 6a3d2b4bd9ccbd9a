"""A split term run as groups of rows, each on the branches of its switches its data takes.

pm.Censored's rows at a bound take the log-CDF, the others the log-density:
the rank's graph runs each group on its own branch only (``branches``), and
must equal PyMC's own functions on any rows, on a rank's uneven share, and
after ``pm.set_data`` brings rows of a group never seen at set-up.  Skipped
where PyMC is not installed.
"""

import logging

import numpy as np
import pytest

pm = pytest.importorskip("pymc", reason="PyMC is not installed (pip install -e '.[pymc]')")

import pytensor  # noqa: E402
import pytensor.scalar as ps  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from pytensor.tensor.elemwise import Elemwise  # noqa: E402

from synkhronos import compat  # noqa: E402
from synkhronos.extensions import pymc as synk_pymc  # noqa: E402
from synkhronos.extensions.pymc import branches, graphs, modes, terms  # noqa: E402

pytestmark = pytest.mark.timeout(300)

N_ROWS = 301


def _censored(upper_data=False):
    """A regression censored at -1 and at 1 (NumPy observed data and covariate); with
    ``upper_data`` the upper bounds are a pm.Data container, one per row."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=N_ROWS)
    y = np.clip(0.2 + 1.1 * x + rng.normal(scale=0.5, size=N_ROWS), -1.0, 1.0)
    with pm.Model() as m:
        a = pm.Normal("a", 0, 1)
        b = pm.Normal("b", 0, 1)
        s = pm.HalfNormal("s", 1)
        upper = pm.Data("upper", np.full(N_ROWS, 1.0)) if upper_data else 1.0
        pm.Censored("y", pm.Normal.dist(a + b * x, s), lower=-1.0, upper=upper, observed=y)
    return m, x, y


def _split_term(model):
    """The split term of ``model`` on symbolic rows, as a rank's graph has it, the rows'
    inputs, and the master's rows."""
    plan = terms.choose(model, terms.model_terms(model), None, None, lift=True,
                        point=model.initial_point())
    inputs = graphs.row_inputs(plan.split)
    n_total = pt.dscalar("n_total")
    (expr,), _, _ = graphs.rank_terms(model, plan, inputs, {}, n_total, by_class=False)
    arrays = [c.get_value(borrow=True) for c in plan.split]
    return expr, inputs, arrays, plan


def _scalar_ops(var):
    """The scalar ops of every elementwise node in ``var``'s graph (as built: none fused)."""
    found = set()
    for v in compat.ancestors([var]):
        if v.owner is not None and isinstance(v.owner.op, Elemwise):
            found.add(type(v.owner.op.scalar_op))
    return found


def _with_gradients(exprs, value_vars, inputs):
    """Each of ``exprs`` and its gradient, compiled as a function of the position and the rows."""
    return [pytensor.function([*value_vars, *inputs], [e, *pytensor.grad(e, value_vars)],
                              on_unused_input="ignore") for e in exprs]


def test_each_group_of_rows_runs_only_its_branch():
    """Three groups (below, inside and above the bounds), the inside one without the
    normal's CDF (no erfc, no erfcx), and their sum equal to the term on any rows."""
    model, _, y = _censored()
    expr, inputs, arrays, plan = _split_term(model)
    conds = branches.conditions(expr, inputs)
    assert conds, "pm.Censored's switches on the observed rows were not found"
    keys = branches.classes(conds, inputs, arrays)
    assert len(keys) == 3
    # The most rows first: the rows inside the bounds, where every condition is false.
    assert keys[0] == (False,) * len(conds)
    inside = branches._on_rows(expr, inputs, pt.lvector("idx"), dict(zip(conds, keys[0])))
    assert not _scalar_ops(inside) & {ps.Erfc, ps.Erfcx}
    assert _scalar_ops(expr) & {ps.Erfc, ps.Erfcx}

    grouped = branches.by_class(expr, inputs, arrays, [False] * len(inputs))
    assert branches.picks_rows(grouped) and not branches.picks_rows(expr)
    value_vars = model.value_vars
    f_whole, f_grouped = _with_gradients([expr, grouped], value_vars, inputs)
    rng = np.random.default_rng(0)
    for take in (np.arange(N_ROWS), rng.permutation(N_ROWS)[:97], np.flatnonzero(np.abs(y) < 1),
                 np.arange(0)):
        rows = [a[take] for a in arrays]
        for _ in range(2):
            point = [rng.normal(size=v.type.shape or ()) for v in value_vars]
            want = f_whole(*point, *rows)
            got = f_grouped(*point, *rows)
            for w, g in zip(want, got):
                np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_rows_put_in_order_run_each_group_as_a_slice():
    """Where the rows never change, they are put in their groups' order once and each group
    is a slice of any contiguous range of them (no row picked by position): the sum equals the
    term on the same rows, chunk by chunk, with each group's own branch only."""
    model, _, y = _censored()
    expr, inputs, arrays, plan = _split_term(model)
    grouped, order = branches.by_sorted_class(expr, inputs, arrays)
    assert sorted(order) == list(range(N_ROWS))
    assert branches.picks_rows(grouped)
    assert not any(isinstance(v.owner.op, pt.basic.Nonzero) for v in compat.ancestors([grouped])
                   if v.owner is not None)
    conds = branches.conditions(expr, inputs)
    codes = [tuple(bool(c) for c in row) for row in
             branches._values(conds, inputs, [a[order] for a in arrays]).T]
    assert codes == sorted(codes, key=lambda k: sum(b << j for j, b in enumerate(k)))
    value_vars = model.value_vars
    f_whole, f_sorted = _with_gradients([expr, grouped], value_vars, inputs)
    rng = np.random.default_rng(1)
    ordered = [a[order] for a in arrays]
    for lo, hi in ((0, N_ROWS), (0, 37), (37, 250), (250, N_ROWS), (5, 5)):
        rows = [a[lo:hi] for a in ordered]
        point = [rng.normal(size=v.type.shape or ()) for v in value_vars]
        for w, g in zip(f_whole(*point, *rows), f_sorted(*point, *rows)):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    # A term whose switches read a pm.Data container's rows is not put in order.
    model, *_ = _censored(upper_data=True)
    expr, inputs, arrays, plan = _split_term(model)
    split, _, _ = graphs.rank_terms(model, plan, inputs, {}, pt.dscalar("n"), sort=True)
    assert all(getattr(c, "_rows", None) is None for c in plan.split)


def test_too_many_groups_run_whole(monkeypatch):
    model, *_ = _censored()
    expr, inputs, arrays, _ = _split_term(model)
    monkeypatch.setattr(branches, "MAX_CLASSES", 2)
    assert branches.by_class(expr, inputs, arrays, [False] * len(inputs)) is expr
    assert branches.by_class(expr, inputs, None, [False] * len(inputs)) is expr


def test_grouped_model_exact_on_uneven_ranks_and_after_set_data(runtime_keeper, caplog,
                                                                monkeypatch):
    """On 3 ranks (uneven shares), dp.logp and dp.dlogp equal PyMC's; after pm.set_data
    moves the upper bound onto the lower one for some rows at the lower bound (a group of
    rows never seen at set-up, run with the term as PyMC wrote it), they still do."""
    model, _, y = _censored(upper_data=True)
    rng = np.random.default_rng(1)
    start = model.initial_point()
    points = [{k: v + rng.normal(scale=0.4, size=np.shape(v)) for k, v in start.items()}
              for _ in range(2)]

    def check(dp):
        logp, dlogp = model.compile_logp(), model.compile_dlogp()
        for point in points:
            np.testing.assert_allclose(dp.logp(point), logp(point), rtol=1e-10)
            np.testing.assert_allclose(dp.dlogp(point), dlogp(point), rtol=1e-9, atol=1e-10)

    caplog.set_level(logging.DEBUG, logger=branches.logger.name)

    monkeypatch.setenv(modes.MODES_ENV, "")    # every mode, as a user's process measures

    def build():
        # A second model measured for its mode: JAX, which cannot pick rows, is left out
        # (where installed, it is measured for a graph that picks none: test_pymc_jax.py).
        measured = synk_pymc.data_parallel(_censored()[0], name="measured")
        assert "NUMBA" in measured.rank_modes and "JAX" not in measured.rank_modes
        with monkeypatch.context() as env:   # JAX the one mode named: the default instead
            env.setenv(modes.MODES_ENV, "JAX")
            only_jax = synk_pymc.data_parallel(_censored()[0], name="only_jax")
        assert only_jax.rank_modes == ("NUMBA",)
        return synk_pymc.data_parallel(model, mode="NUMBA")

    with runtime_keeper.distributed(3, build) as dp:
        # The three groups seen, and a fourth for rows pm.set_data may bring.
        assert "a term run as 4 groups of rows" in caplog.text
        check(dp)
        moved = (y == -1.0) & (np.arange(N_ROWS) % 2 == 0)
        assert moved.sum() >= 5
        with model:
            pm.set_data({"upper": np.where(moved, -1.0, 1.0)})
        dp.scatter()
        check(dp)
