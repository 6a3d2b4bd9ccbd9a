"""A split term summed over groups of rows, each group running only the branches its data takes.

PyTensor computes both sides of an elementwise ``switch`` for every element.
Where the condition reads nothing but the rows' data, every row still pays
for every branch: ``pm.Censored``'s normal runs its log-CDF at the lower
bound and its log-survival at the upper (two ``erfcx`` and two ``erfc``,
and their gradients) on every row, though most rows take the log-density
alone (80 ns a row in Numba at 10^5 rows against PyMC's 8 ms call).  A
split term is a sum over its rows (``rowcheck`` checked it on uneven
parts), so it is the sum of the same term over the groups of any
partition of them.  The rows are grouped by the data conditions they meet
(``classes``, read from the master's rows at set-up), and each group's
term has every such ``switch`` replaced by the branch its rows take.

A condition qualifies where it is elementwise in one-dimensional row inputs
and constants of one element (``conditions``).  A group's rows are picked
inside the rank's graph (their positions, then a gather), so that the
ranks' rows need no reordering; where a condition reads a ``pm.Data``
container, which ``pm.set_data`` may change, a last group takes the rows of
no group seen at set-up with the term as PyMC wrote it.  Picking costs a
pass over the rows, so rows are grouped only where a branch runs a special
function (``SPECIAL``); where all rows take the same branches, the switches
go without any picking.

Where the rows never change (every split array a NumPy array of the
model's, on one machine), ``by_sorted_class`` puts them in their groups'
order once at set-up instead, and a group is then a slice of any contiguous
range of them (a chunk's), found by ``searchsorted`` on the range's codes:
nothing is gathered.  Grouping then costs so little that a branch reading a
parameter through a row's index qualifies too (an imputed value: its
gradient, an increment per row, kept the whole loop from vectorising; a
bare regression with 10% of its values imputed took 357 us at 10^5 rows so,
209 us as two slices, 187 with none imputed; bench/HISTORY.md, 2026-12-07).
"""

import logging

import numpy as np
import pytensor
import pytensor.scalar as ps
import pytensor.tensor as pt
from pytensor.graph.basic import Constant
from pytensor.scalar import Switch
from pytensor.tensor.basic import Nonzero
from pytensor.tensor.elemwise import DimShuffle, Elemwise
from pytensor.tensor.extra_ops import SearchsortedOp, broadcast_shape, searchsorted

from ... import compat

logger = logging.getLogger(__name__)

SPECIAL = tuple(getattr(ps, name) for name in (
    "Erf", "Erfc", "Erfcx", "Erfinv", "Erfcinv", "Gamma", "GammaLn", "Psi", "TriGamma",
    "GammaInc", "GammaIncC", "GammaU", "GammaL", "BetaInc", "Hyp2F1", "Iv", "Ive")
    if hasattr(ps, name))
"""Scalar ops that cost a row several times what picking the row costs: where no branch of
a switch runs one (a Bernoulli's ``log(p)`` against ``log1p(-p)``), the rows are not
grouped, the gathers would cost what the branch saves."""

COSTLY = SPECIAL + tuple(getattr(ps, name) for name in (
    "Log", "Log1p", "Log2", "Log10", "Exp", "Exp2", "Expm1", "Pow", "Log1mexp", "Softplus",
    "Sigmoid", "Sqrt") if hasattr(ps, name))
"""Scalar ops that cost a row more than a branch or than reading one more array: the special
functions and libm's.  ``rowsums`` computes a switch's branch only where taken where it runs
one; ``folding`` computes a part of the data alone once where it runs one."""

MAX_CLASSES = 6
"""The most groups a term is run as: each is a copy of the term to compile (less what its
rows skip), and the groups' gathers cost a pass over the rows each."""


def conditions(expr, inputs):
    """The conditions of ``expr``'s elementwise switches that read only rows: a list of
    variables, each one-dimensional, elementwise in ``inputs`` (1-D of them) and constants
    of one element."""
    rows = {v for v in inputs if v.ndim == 1}
    found = []
    for v in compat.ancestors([expr]):
        if (_is_switch(v.owner) and v.owner.inputs[0] not in found
                and _row_wise(v.owner.inputs[0], rows)):
            found.append(v.owner.inputs[0])
    return found


def _is_switch(node):
    return (node is not None and isinstance(node.op, Elemwise)
            and isinstance(node.op.scalar_op, Switch))


def _leaves(var):
    return {v for v in compat.ancestors([var]) if v.owner is None}


def _row_wise(cond, rows):
    if cond.ndim != 1:
        return False
    leaves = _leaves(cond)
    if not leaves & rows:
        return False
    if any(v not in rows and not (isinstance(v, Constant) and v.data.size == 1) for v in leaves):
        return False
    return all(v.owner is None or isinstance(v.owner.op, (Elemwise, DimShuffle))
               for v in compat.ancestors([cond]))


def classes(conds, inputs, arrays):
    """The distinct rows of the conditions' values over the whole data (``arrays``, one per
    input), as tuples of bools, most rows first."""
    values = _values(conds, inputs, arrays)
    keys, counts = np.unique(values.T, axis=0, return_counts=True)
    return [tuple(bool(b) for b in keys[k]) for k in np.argsort(-counts, kind="stable")]


def _values(conds, inputs, arrays):
    """The conditions' values over the whole data: a (conditions, rows) bool array."""
    read = set().union(*(_leaves(c) for c in conds))
    used = [(i, a) for i, a in zip(inputs, arrays) if i in read]
    fn = pytensor.function([i for i, _ in used], pt.stack([pt.cast(c, "int8") for c in conds]),
                           mode="FAST_COMPILE", on_unused_input="ignore")
    return np.asarray(fn(*[a for _, a in used]), dtype=bool)


def by_class(expr, inputs, arrays, changeable):
    """``expr`` (a split term in the row ``inputs``) as the sum of its groups' terms, or
    ``expr`` itself where no switch reads only rows, or where no branch of one runs a
    special function (picking the rows would cost what the branch saves: ``SPECIAL``),
    or where the groups are too many.

    Where every row takes the same branches and the rows cannot change, the switches
    are replaced in place: no rows are picked (and JAX, whose jit cannot pick a number
    of rows known only at run time, runs it too).

    Args:
        arrays: each input's rows in the master (all of them), or None where the master
            does not hold them (then ``expr`` is returned).
        changeable: each input's flag, True where ``pm.set_data`` may change its rows.
    """
    if arrays is None:
        return expr
    conds = conditions(expr, inputs)
    if not conds or not _special_branches(expr, conds):
        return expr
    keys = classes(conds, inputs, arrays)
    read = set().union(*(_leaves(c) for c in conds))
    unseen = any(flag for i, flag in zip(inputs, changeable) if i in read)
    if len(keys) == 1 and not unseen:
        logger.debug("pymc model: every row takes the same branches of %d switches", len(conds))
        return _on_rows(expr, inputs, None, dict(zip(conds, keys[0])))
    if len(keys) > MAX_CLASSES:
        logger.debug("pymc model: %d groups of rows by their branches, run whole", len(keys))
        return expr
    key = _key(conds, "int64")
    codes = [sum(1 << j for j, b in enumerate(k) if b) for k in keys]
    parts = [_on_rows(expr, inputs, pt.eq(key, code).nonzero()[0], dict(zip(conds, k)))
             for code, k in zip(codes, keys)]
    if unseen:
        rest = pt.all(pt.neq(key[:, None], np.array(codes, dtype="int64")[None, :]), axis=1)
        parts.append(_on_rows(expr, inputs, rest.nonzero()[0], {}))
    logger.debug("pymc model: a term run as %d groups of rows by %d conditions on the data",
                 len(parts), len(conds))
    return pt.add(*parts)


def by_sorted_class(expr, inputs, arrays):
    """``(expr as the sum of its groups' terms, each group a slice of the rows, the order that
    puts the rows in their groups)``, or ``(expr, None)`` where it does not qualify.

    For rows that never change: the caller puts every split array's rows in
    ``order`` (ascending code) once, and in any contiguous range of them a
    group's rows lie between two bounds ``searchsorted`` finds in the range's
    codes.  Qualifies where a switch reads only rows, a branch of it runs a
    special function or reads a parameter through a row's index, and the rows
    fall in 2 to ``MAX_CLASSES`` groups (one group: ``by_class`` replaces the
    switches in place).
    """
    conds = conditions(expr, inputs)
    if not conds or not (_special_branches(expr, conds) or _indexed_branches(expr, conds, inputs)):
        return expr, None
    values = _values(conds, inputs, arrays)
    codes = (values.astype(np.int64) << np.arange(len(conds))[:, None]).sum(axis=0)
    present = np.unique(codes)
    if not 1 < len(present) <= MAX_CLASSES:
        return expr, None
    dtype = "int8" if len(conds) < 7 else "int64"
    bounds = searchsorted(_key(conds, dtype), present.astype(dtype))
    rows = inputs[0].shape[0]
    parts = []
    for g, code in enumerate(present):
        end = bounds[g + 1] if g + 1 < len(present) else rows
        taken = {c: bool(code >> j & 1) for j, c in enumerate(conds)}
        parts.append(_on_rows(expr, inputs, slice(bounds[g], end), taken))
    logger.debug("pymc model: a term run as %d slices of rows put in order by %d conditions on "
                 "the data", len(parts), len(conds))
    return pt.add(*parts), np.argsort(codes, kind="stable")


def _key(conds, dtype):
    """Each row's group: bit ``j`` its value of ``conds[j]``, in ``dtype``."""
    bits = [pt.cast(c, dtype) * np.array(1 << j, dtype=dtype) for j, c in enumerate(conds)]
    return pt.add(*bits) if len(bits) > 1 else bits[0]


def picks_rows(graph):
    """Whether ``graph`` picks rows by positions found at run time (a group's ``nonzero``,
    or its slice's bounds), which JAX's jit cannot compile."""
    return any(v.owner is not None and isinstance(v.owner.op, (Nonzero, SearchsortedOp))
               for v in compat.ancestors([graph]))


def _indexed_branches(expr, conds, inputs):
    """Whether a branch of a switch on ``conds`` reads a variable of no row through an index
    that reads rows (an imputed value gathered into its row)."""
    rows, on = set(inputs), set(conds)
    for v in compat.ancestors([expr]):
        if _is_switch(v.owner) and v.owner.inputs[0] in on:
            for u in compat.ancestors(v.owner.inputs[1:]):
                node = u.owner
                if (node is not None and isinstance(node.op, compat.indexing_ops())
                        and not _leaves(node.inputs[0]) & rows
                        and any(_leaves(i) & rows for i in node.inputs[1:])):
                    return True
    return False


def _special_branches(expr, conds):
    """Whether a branch of a switch on ``conds`` runs a special function."""
    on = set(conds)
    for v in compat.ancestors([expr]):
        if _is_switch(v.owner) and v.owner.inputs[0] in on:
            for u in compat.ancestors(v.owner.inputs[1:]):
                if (u.owner is not None and isinstance(u.owner.op, Elemwise)
                        and isinstance(u.owner.op.scalar_op, SPECIAL)):
                    return True
    return False


def _on_rows(expr, inputs, idx, taken):
    """``expr`` on the rows ``idx`` of ``inputs`` (all of them where None), each switch on a
    condition of ``taken`` replaced by the branch it takes there (True: the first)."""
    def taking(node, new):
        if not (_is_switch(node) and node.inputs[0] in taken):
            return None
        out = node.outputs[0]
        branch = new[1] if taken[node.inputs[0]] else new[2]
        branch = branch.astype(out.dtype) if branch.dtype != out.dtype else branch
        if branch.type.broadcastable != out.type.broadcastable:
            branch = pt.broadcast_to(branch, broadcast_shape(*new))
        return [branch]
    replace = {} if idx is None else {i: i[idx] for i in inputs}
    return compat.rebuilt(expr, replace, override=taking)
