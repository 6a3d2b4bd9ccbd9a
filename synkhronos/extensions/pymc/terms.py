"""Which rows a PyMC model's log-density may split: its terms, its row containers, and what is refused.

The log-density is a sum of terms: one per observed variable, one per
``pm.Potential``, and the priors of the free variables (with their
transforms' Jacobians).  A term that reads a container split by rows runs on
every rank over that rank's rows ("split term"); every other term is the
same on every rank and counts once ("whole term").  This module decides
which is which and refuses, naming the variable, what cannot be split
without a wrong result: random draws inside the likelihood (``pm.Minibatch``)
and per-row NumPy arrays that cannot follow the rows.  NumPy arrays with one
row per observation (``observed=``, covariates, index arrays, ``pm.Censored``
bounds) are split as containers are (``Lifted``): a model runs as its user
wrote it.  ``rowcheck.py`` then checks that each split term really is a sum
over its rows.
"""

import logging
from typing import NamedTuple

import numpy as np
import pytensor.tensor as pt
from pytensor.compile import SharedVariable
from pytensor.graph.basic import Constant
from pytensor.tensor.random.op import RandomVariable
from pytensor.tensor.random.type import RandomType

import synkhronos as synk

from ... import compat
from . import cells, folding, internals, selections

logger = logging.getLogger(__name__)

WHERE = "data_parallel"


class Term(NamedTuple):
    """One term of the log-density."""

    name: str          # the observed variable's or potential's name, or "prior"
    graph: object      # its scalar graph, in the model's value variables
    scaled: bool       # PyMC scales it by total_size / (its rows): exact over ranks only rescaled
    rows: int = 0      # where written over an imputed variable's cells: that variable's rows


class Lifted:
    """A NumPy array of the model's graph with one row per observation, split as a container is.

    The model holds it as a constant of its graph (``observed=`` a NumPy array, a covariate,
    an index array, a ``pm.Censored`` bound); the ranks get its rows, in an order of their
    own where put in one.  It offers what the rest of the extension reads of a ``pm.Data``
    container (``name``, ``type``, ``dtype``, ``ndim``, ``get_value``); ``pm.set_data``
    cannot reach it."""

    def __init__(self, constant, name, dims_of=None):
        self.constant = constant
        self.name = name
        self.dims_of = dims_of or name   # the model variable whose dims describe its rows
        self.type = constant.type
        self.dtype = constant.dtype
        self.ndim = constant.ndim
        self._rows = None                # the rows in the ranks' order, where put in one

    def get_value(self, borrow=False):
        data = self.constant.data if self._rows is None else self._rows   # put_in_order's
        return data if borrow else data.copy()

    def put_in_order(self, order):
        """The ranks get the rows in ``order``; the model's constant stays as it is."""
        self._rows = np.ascontiguousarray(self.get_value(borrow=True)[order])

    def __repr__(self):
        return f"Lifted({self.name!r}, shape={self.constant.data.shape})"


def graph_var(c):
    """The variable of the model's graph that holds container (or ``Lifted``) ``c``'s rows."""
    return c.constant if isinstance(c, Lifted) else c


class Plan(NamedTuple):
    """How the log-density splits."""

    split: list        # pm.Data containers and Lifted arrays split by rows
    whole: list        # pm.Data containers every rank reads whole
    split_terms: list  # Terms that read split rows
    whole_terms: list  # Terms computed whole (counted once)
    n_rows: int        # rows of the split containers
    row_sizes: tuple = ()   # constant shapes [n_rows, ...] of variables over lifted rows
    row_params: tuple = ()  # value variables with one entry per row (eight schools' theta)
    row_ids: object = None  # the Lifted row numbers that index them on a rank


def _ancestors(graph):
    return list(compat.ancestors([graph]))


def _name(var):
    return getattr(var, "name", None) or str(var)


def containers_of(model):
    """The model's ``pm.Data`` containers (shared variables), by name."""
    return {c.name: c for c in model.data_vars if isinstance(c, SharedVariable)}


def model_terms(model):
    """Every term of the log-density, as ``Term`` s (the priors as one term).

    A likelihood's constant row selections are moved onto the arrays they select
    (``selections``): the rows present of a variable with missing values, whose observed
    cells' term and imputed values' prior are one term over its cells, by rows (``cells``).
    """
    terms, joined, joins = [], set(), {}
    imputed = {name: rv for rv, name in selections.imputed(model).items()}
    for rv in model.observed_RVs:
        graph = selections.fold(model.logp(vars=[rv], sum=True), joins)
        name, graph, rows, missing = cells.own_term(model, rv, graph, imputed, joins)
        joined.add(missing)
        terms.append(Term(name, graph, internals.scales_rows(rv), rows))
    for pot in model.potentials:
        terms.append(Term(pot.name, selections.fold(model.logp(vars=[pot], sum=True), joins),
                          False))
    priors = [rv for rv in model.free_RVs if rv not in joined]
    if priors:
        terms.append(Term("prior", model.logp(vars=priors, sum=True), False))
    return terms


def refuse_random_draws(terms):
    """Refuse a likelihood that draws random numbers: pm.Minibatch (each rank would draw its own)."""
    for term in terms:
        ancestors = _ancestors(term.graph)
        # PyMC 5.27-5.28: pm.Minibatch is a MinibatchOp holding the draw (an RNG input);
        # MinibatchRandomVariable is total_size's scaling, not a draw.
        minibatch = any("Minibatch" in type(v.owner.op).__name__
                        and type(v.owner.op).__name__ != "MinibatchRandomVariable"
                        for v in ancestors if v.owner is not None)
        random = minibatch or any(isinstance(v.type, RandomType) for v in ancestors) or any(
            v.owner is not None and isinstance(v.owner.op, RandomVariable) for v in ancestors)
        if random:
            what = "pm.Minibatch" if minibatch else "a random variable"
            raise ValueError(
                f"{WHERE}: the log-density term of {term.name!r} draws random numbers "
                f"inside the graph ({what}): every rank would draw and scale its own "
                "batch, which is not the model's likelihood. data_parallel already "
                "spreads every row over the ranks: build the model on the whole "
                "pm.Data containers, without pm.Minibatch (and without total_size), or "
                "sample minibatches yourself with synk.function(...)(batch=rows)")


def choose(model, terms, data=None, unsplit=None, lift=True, point=None):
    """Decide the containers to split and the terms that read them; return a ``Plan``.

    Args:
        data: containers to split (names or variables); default: every
            container a term reads whose first axis has the observed rows.
        unsplit: containers (or lifted arrays, by name) to keep whole on every rank even so.
        lift: split the NumPy arrays with one row per observation too (``Lifted``);
            False where the rows come from elsewhere (``data=`` a dict of ``synk.Data``).
        point: the model's initial point, where the caller has it (each
            ``model.initial_point()`` compiles a function).
    """
    by_name = containers_of(model)
    chosen = _resolve(by_name, data, "data") if data is not None else None
    if chosen:
        n_obs = _rows(chosen[0])   # differing lengths are refused below, by name
    else:
        n_obs = _observed_rows(model, by_name, terms, lift)
    lifted = lift_rows(model, terms, n_obs) if lift else []
    keep = _resolve({**by_name, **{a.name: a for a in lifted}}, unsplit, "unsplit")
    if data is not None:
        split = [c for c in chosen if c not in keep]
    else:
        read = set()
        for term in terms:
            read.update(_ancestors(term.graph))
        split = [c for c in by_name.values()
                 if c in read and c not in keep and _rows(c) == n_obs]
    split += [a for a in lifted if a not in keep]
    if not split:
        raise ValueError(f"{WHERE}: no pm.Data container to split by rows"
                         + (f" (all of them are in unsplit={[c.name for c in keep]}; "
                            "statistics over rows such as centring can be computed with "
                            "NumPy before building the model)" if keep else ""))
    lengths = {_rows(c) for c in split}
    if len(lengths) > 1 or None in lengths:
        raise ValueError(f"{WHERE}: the containers to split {[c.name for c in split]} have "
                         f"different lengths {[_rows(c) for c in split]}; they must share "
                         "their rows (pass data= to say which to split)")
    n_rows = lengths.pop()
    split_set = {graph_var(c) for c in split}
    split_terms, whole_terms = [], []
    for term in terms:
        (split_terms if split_set & set(_ancestors(term.graph)) else whole_terms).append(term)
    if lift:
        split_terms, folded = folding.fold(split_terms, split, n_rows, Lifted)
        if folded:   # the arrays read only by the parts folded are no longer split
            read = {v for term in split_terms for v in _ancestors(term.graph)}
            split = [c for c in split if not isinstance(c, Lifted) or graph_var(c) in read] + folded
            split_set = {graph_var(c) for c in split}
    whole = [c for c in by_name.values() if c not in split_set]
    sizes = _row_sizes(split_terms, n_rows, split_set) if lifted else ()
    params = _row_params(model, split_terms, n_rows, point) if lift else ()
    ids = None
    if params:   # a rank reads its entries of them, by row number
        ids = Lifted(pt.as_tensor_variable(np.arange(n_rows)), "row_ids")
        split.append(ids)
    return Plan(split, whole, split_terms, whole_terms, n_rows, sizes, params, ids)


def given_data(given, plan):
    """The ``synk.Data`` given as ``data=`` for each split container, in the plan's order."""
    out = []
    for c in plan.split:
        d = given[c.name] if c.name in given else given.get(c)
        if not isinstance(d, synk.Data):
            raise TypeError(f"data_parallel: data[{c.name!r}] must be a synk.Data (for "
                            f"example synk.data(produce=fn, length=n)); got {type(d).__name__}")
        if np.dtype(d.dtype) != np.dtype(c.dtype) or d.ndim != c.ndim:
            raise TypeError(f"data_parallel: data[{c.name!r}] must have the container's "
                            f"dtype {c.dtype} and ndim {c.ndim} (pm.Data may have cast it); "
                            f"got {d.dtype}, ndim {d.ndim}")
        out.append(d)
    if len({len(d) for d in out}) != 1:
        raise ValueError(f"data_parallel: the Data given in data= have different lengths "
                         f"{[len(d) for d in out]}")
    return out


def _row_params(model, split_terms, n_rows, point=None):
    """The free variables a split term reads with one entry per row (``theta`` of eight schools).

    A rank then reads its rows' entries; the prior of the whole vector stays
    a whole term.  The additivity check refuses one that is not per row.
    """
    if n_rows < 2:
        return ()
    read = set()
    for term in split_terms:
        read.update(selections.read_by_position(term.graph))
    if point is None:
        point = model.initial_point()
    return tuple(v for v in model.value_vars
                 if v in read and np.ndim(point[v.name]) >= 1 and np.shape(point[v.name])[0] == n_rows)


def _row_sizes(split_terms, n_rows, split_set):
    """The constant shapes that start with the rows: an observed NumPy array's variable's size.

    PyMC gives a variable observed on a NumPy array the array's shape as a
    constant (``Alloc(logp, [n_rows])``); on a rank it is the rank's rows.
    """
    out = {}
    for term in split_terms:
        for v in _ancestors(term.graph):
            if (isinstance(v, Constant) and v not in split_set and getattr(v.type, "ndim", 0) == 1
                    and v.dtype[:3] in ("int", "uin") and 0 < len(v.data) <= 8
                    and int(v.data[0]) == n_rows):
                out[id(v)] = v
    return tuple(out.values())


def lift_rows(model, terms, n_rows):
    """The NumPy arrays of the likelihood's terms with ``n_rows`` rows, as ``Lifted`` s.

    Only the observed variables' and potentials' terms: a prior's constants
    (a hyperparameter vector) are not rows, even of the same length.  An
    observed value is named ``<variable>_data``, any other array
    ``<term>_array<k>`` (or its own name).
    """
    if n_rows is None or n_rows < 2:
        return []
    observed = {model.rvs_to_values[rv]: rv.name for rv in model.observed_RVs}
    out, seen, count = [], set(), {}
    for term in terms:
        if term.name == "prior":
            continue
        for var in _ancestors(term.graph):
            if (not isinstance(var, Constant) or getattr(var.type, "ndim", 0) < 1
                    or id(var) in seen or np.shape(var.data)[0] != n_rows):
                continue
            seen.add(id(var))
            dims_of = None
            if var in observed:
                name, dims_of = f"{observed[var]}_data", observed[var]
            elif var.name:
                name = var.name
            else:
                count[term.name] = count.get(term.name, 0) + 1
                name = f"{term.name}_array{count[term.name]}"
            out.append(Lifted(var, name, dims_of))
    return out


def _resolve(by_name, items, arg):
    if items is None:
        return []
    items = [items] if isinstance(items, (str, SharedVariable)) else list(items)
    out = []
    for item in items:
        c = by_name.get(item) if isinstance(item, str) else item
        if c is None or not any(c is d for d in by_name.values()):
            raise ValueError(f"{WHERE}: {arg} entry {item!r} is not a pm.Data container of "
                             f"the model (containers: {sorted(by_name)})")
        out.append(c)
    return out


def _rows(container):
    value = container.get_value(borrow=True)
    return len(value) if np.ndim(value) else None


def _observed_rows(model, by_name, terms, lift):
    """The number of observed rows: of the containers, or NumPy arrays, holding the observed data.

    Where observed NumPy arrays differ in length (and no container says
    otherwise), the longest are the rows split: the likelihoods of the others
    read none of them and stay whole terms, counted once.  A model without
    observed variables (a likelihood in ``pm.Potential`` terms) takes the
    longest first axis among the arrays and containers its potentials read
    (``rowcheck`` then checks that they split).
    """
    lengths, arrays, numpy_observed = set(), {}, []
    containers = set(by_name.values())
    joined = {t.name + "_observed": t.rows for t in terms if t.rows}
    for rv in model.observed_RVs:
        value = model.rvs_to_values[rv]
        mine = [c for c in _ancestors(value) if c in containers]
        if mine:
            lengths.update(n for n in (_rows(c) for c in mine) if n is not None)
        elif lift and isinstance(value, Constant) and np.ndim(value.data) >= 1:
            arrays[rv.name] = joined.get(rv.name, len(value.data))
        else:
            numpy_observed.append(rv.name)
    if arrays and not lengths:
        # An imputed array's observed cells, flattened, are not rows where others are.
        flattened = selections.flattened(model) - set(joined)
        rows = {k: n for k, n in arrays.items() if k not in flattened}
        lengths = {max((rows or arrays).values())}
        whole = sorted(name for name, n in arrays.items() if n not in lengths)
        if whole:
            logger.info("data_parallel: splitting the rows of %s; %s, of other lengths, stay "
                        "whole", sorted(set(arrays) - set(whole)), whole)
    if not model.observed_RVs:
        firsts = [np.shape(v.data)[0] if isinstance(v, Constant) else _rows(v)
                  for term in terms if term.name != "prior" for v in _ancestors(term.graph)
                  if (isinstance(v, Constant) and lift and np.ndim(v.data) >= 1)
                  or v in containers]
        lengths = {max((n for n in firsts if n), default=None)} - {None}
    if not lengths:
        names = numpy_observed or [rv.name for rv in model.observed_RVs]
        raise ValueError(
            f"{WHERE}: the observed data of {names} are NumPy arrays, constants of the graph "
            "that cannot be split by rows here. Put each in a pm.Data container and pass that as "
            f"observed=, e.g. pm.Normal(..., observed=pm.Data(\"{names[0]}_data\", values))"
            if names else
            f"{WHERE}: the model's likelihood (its pm.Potential terms) reads no array with "
            "rows; put the rows in pm.Data containers, or observe them: observed=values")
    if len(lengths) != 1:
        raise ValueError(f"{WHERE}: the observed data have different lengths "
                         f"{sorted(lengths)}; pass data= to say which containers to split")
    return lengths.pop()


def refuse_numpy_rows(model, plan):
    """Refuse per-row NumPy arrays read by split terms: they cannot follow each rank's rows."""
    if plan.n_rows < 2:
        return
    observed = {rv.name: model.rvs_to_values[rv] for rv in model.observed_RVs}
    containers = set(containers_of(model).values())
    lifted = {a.constant for a in plan.split if isinstance(a, Lifted)}
    for term in plan.split_terms:
        ancestors = _ancestors(term.graph)
        # Masks and index lists select rows: of the observations, or of any container.
        select_rows = {plan.n_rows} | {_rows(c) for c in ancestors if c in containers}
        for var in ancestors:
            if (not isinstance(var, Constant) or getattr(var.type, "ndim", 0) < 1
                    or var in lifted):
                continue
            shape, kind = np.shape(var.data), np.asarray(var.data).dtype
            selects = kind.kind in "biu"
            if not shape or shape[0] not in (select_rows if selects else {plan.n_rows}):
                continue
            obs = observed.get(term.name)
            if obs is not None and var in set(_ancestors(obs)):
                raise ValueError(
                    f"{WHERE}: the observed data of {term.name!r} is a NumPy array (shape "
                    f"{shape}), a constant of the graph that cannot follow each rank's rows. "
                    f"Pass observed=pm.Data(\"{term.name}_data\", values) instead")
            select = (" If it selects rows (a mask or an index list), select them before "
                      "building the model (X[mask]), so that every container has one row "
                      "per observation." if selects else "")
            raise ValueError(
                f"{WHERE}: the log-density term of {term.name!r} reads a NumPy array of "
                f"{kind} with one entry per row (shape {shape}) that is not in a pm.Data "
                "container, so it cannot follow each rank's rows. Put it in one: "
                "values = pm.Data(\"name\", values), and use that in the model (for "
                "pm.Censored's lower=/upper= as well)." + select)
