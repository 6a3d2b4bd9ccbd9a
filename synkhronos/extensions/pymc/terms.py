"""Which rows a PyMC model's log-density may split: its terms, its row containers, and what is refused.

The log-density is a sum of terms: one per observed variable, one per
``pm.Potential``, and the priors of the free variables (with their
transforms' Jacobians).  A term that reads a container split by rows runs on
every rank over that rank's rows ("split term"); every other term is the
same on every rank and counts once ("whole term").  This module decides
which is which and refuses, naming the variable, what cannot be split
without a wrong result: random draws inside the likelihood (``pm.Minibatch``)
and per-row NumPy arrays outside ``pm.Data``.  ``rowcheck.py`` then checks
that each split term really is a sum over its rows.
"""

from typing import NamedTuple

import numpy as np
from pytensor.compile import SharedVariable
from pytensor.graph.basic import Constant
from pytensor.tensor.random.op import RandomVariable
from pytensor.tensor.random.type import RandomType

from ... import compat
from . import internals

WHERE = "data_parallel"


class Term(NamedTuple):
    """One term of the log-density."""

    name: str          # the observed variable's or potential's name, or "prior"
    graph: object      # its scalar graph, in the model's value variables
    scaled: bool       # PyMC scales it by total_size / (its rows): exact over ranks only rescaled


class Plan(NamedTuple):
    """How the log-density splits."""

    split: list        # pm.Data containers split by rows
    whole: list        # pm.Data containers every rank reads whole
    split_terms: list  # Terms that read split rows
    whole_terms: list  # Terms computed whole (counted once)
    n_rows: int        # rows of the split containers


def _ancestors(graph):
    return list(compat.ancestors([graph]))


def _name(var):
    return getattr(var, "name", None) or str(var)


def containers_of(model):
    """The model's ``pm.Data`` containers (shared variables), by name."""
    return {c.name: c for c in model.data_vars if isinstance(c, SharedVariable)}


def model_terms(model):
    """Every term of the model's log-density, as ``Term`` s (the priors as one term)."""
    terms = []
    for rv in model.observed_RVs:
        terms.append(Term(rv.name, model.logp(vars=[rv], sum=True), internals.scales_rows(rv)))
    for pot in model.potentials:
        terms.append(Term(pot.name, model.logp(vars=[pot], sum=True), False))
    if model.free_RVs:
        terms.append(Term("prior", model.logp(vars=list(model.free_RVs), sum=True), False))
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


def choose(model, terms, data=None, unsplit=None):
    """Decide the containers to split and the terms that read them; return a ``Plan``.

    Args:
        data: containers to split (names or variables); default: every
            container a term reads whose first axis has the observed rows.
        unsplit: containers to keep whole on every rank even so.
    """
    by_name = containers_of(model)
    keep = _resolve(by_name, unsplit, "unsplit")
    if data is not None:
        split = [c for c in _resolve(by_name, data, "data") if c not in keep]
    else:
        n_obs = _observed_rows(model, by_name)
        read = set()
        for term in terms:
            read.update(_ancestors(term.graph))
        split = [c for c in by_name.values()
                 if c in read and c not in keep and _rows(c) == n_obs]
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
    split_set = set(split)
    split_terms, whole_terms = [], []
    for term in terms:
        (split_terms if split_set & set(_ancestors(term.graph)) else whole_terms).append(term)
    whole = [c for c in by_name.values() if c not in split_set]
    return Plan(split, whole, split_terms, whole_terms, n_rows)


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


def _observed_rows(model, by_name):
    """The number of observed rows, from the containers that hold the observed data."""
    lengths, numpy_observed = set(), []
    containers = set(by_name.values())
    for rv in model.observed_RVs:
        value = model.rvs_to_values[rv]
        mine = [c for c in _ancestors(value) if c in containers]
        if not mine:
            numpy_observed.append(rv.name)
            continue
        lengths.update(n for n in (_rows(c) for c in mine) if n is not None)
    if not lengths:
        names = numpy_observed or [rv.name for rv in model.observed_RVs]
        raise ValueError(
            f"{WHERE}: the observed data of {names} are NumPy arrays, constants of the graph "
            "that cannot be split by rows. Put each in a pm.Data container and pass that as "
            f"observed=, e.g. pm.Normal(..., observed=pm.Data(\"{names[0]}_data\", values))")
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
    for term in plan.split_terms:
        ancestors = _ancestors(term.graph)
        # Masks and index lists select rows: of the observations, or of any container.
        select_rows = {plan.n_rows} | {_rows(c) for c in ancestors if c in containers}
        for var in ancestors:
            if not isinstance(var, Constant) or getattr(var.type, "ndim", 0) < 1:
                continue
            shape = np.shape(var.data)
            kind = np.asarray(var.data).dtype
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
