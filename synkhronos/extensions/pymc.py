"""PyMC models, data-parallel: the log-likelihood summed over ranks, the prior once.

PyMC is an optional extra (``pip install synkhronos[pymc]``); this module
imports it, so ``import synkhronos.extensions`` does not load it.

    import synkhronos as synk
    from synkhronos.extensions import pymc as synk_pymc

    synk.fork()
    dp = synk_pymc.data_parallel(model)   # after fork(), before distribute()
    synk.distribute()
    dp.scatter()                          # each rank gets its rows of every pm.Data
    fit = scipy.optimize.minimize(dp.neg_logp_dlogp, dp.initial_x(), jac=True)
    dp.unravel(fit.x)                     # the MAP point, as a point dict

The model's log-density splits into terms of observed variables, whose data
are split by rows over the ranks and summed back (exact for any split), and
everything else (priors with their Jacobians, potentials), computed once, in
the master, on the model's own data.  The model itself is left unchanged:
ranks hold their rows in copies of the ``pm.Data`` containers.
"""

import logging

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile import SharedVariable

try:
    import pymc as pm
except ImportError as exc:
    raise ImportError("synkhronos.extensions.pymc needs PyMC: pip install 'synkhronos[pymc]'"
                      ) from exc

import synkhronos as synk

from .. import compat

logger = logging.getLogger(__name__)

__all__ = ["DataParallelModel", "data_parallel"]


def data_parallel(model=None, data=None, name="pymc_logp"):
    """Build the data-parallel log-density of a PyMC model.  Master only.

    Call after ``synk.fork()`` and before ``synk.distribute()``; after
    distributing, call ``scatter()`` on the result (the first evaluation
    does it if you have not).

    Args:
        model: a ``pm.Model``; default: the model of the enclosing ``with`` block.
        data: the ``pm.Data`` containers (variables or names) to split by
            rows.  Default: every container the likelihood reads whose first
            axis has the length of the observed data; other containers are
            used whole on every rank.
        name: name of the synkhronos function (for logs and errors).

    Returns:
        DataParallelModel

    Raises:
        SynkStateError: not forked, or already distributed.
        ValueError: the model has no observed variables, observed data that
            is not in a ``pm.Data`` container, a discrete free variable (no
            gradient), or ``data`` naming something else than a container.
    """
    model = pm.modelcontext(model)
    return DataParallelModel(model, data, name)


class DataParallelModel:
    """The data-parallel log-density and gradient of one PyMC model.  Master only.

    Points are either point dicts, as ``model.initial_point()`` returns them
    (value variables in the transformed space, e.g. ``sigma_log__``), or flat
    vectors in the order of ``value_names`` (see ``ravel``/``unravel``); the
    gradient is flat in that same order, as ``model.compile_dlogp()`` returns it.
    """

    def __init__(self, model, data, name):
        self.model = model
        if not model.observed_RVs:
            raise ValueError("data_parallel: the model has no observed variables")
        value_vars = list(model.value_vars)
        discrete = [v.name for v in value_vars
                    if not np.issubdtype(np.dtype(v.dtype), np.floating)]
        if discrete:
            raise ValueError(f"data_parallel: free variables {discrete} are discrete; the "
                             "gradient needs continuous free variables only")
        point = model.initial_point()
        self.value_names = [v.name for v in value_vars]
        self._shapes = [np.shape(point[n]) for n in self.value_names]
        self._sizes = [int(np.prod(s, dtype=int)) for s in self._shapes]
        self._dtypes = [np.dtype(v.dtype) for v in value_vars]
        self.dtype = np.result_type(*self._dtypes) if value_vars else np.dtype("float64")
        self.size = sum(self._sizes)

        lik = model.logp(vars=model.observed_RVs, sum=True)
        once = model.logp(vars=list(model.free_RVs) + list(model.potentials), sum=True)
        self.containers = self._choose_data(lik, data)
        self.n_rows = len(self.containers[0].get_value(borrow=True))
        # Each rank's rows live in copies of the containers: the model keeps
        # its whole data set (and so PyMC's own functions stay right).
        self._shards = [pytensor.shared(_empty_rows(c.get_value(borrow=True)), name=c.name)
                        for c in self.containers]
        x = pt.vector("x", dtype=self.dtype)
        to_x = self._replace_values(x, value_vars)
        replace = dict(to_x)
        replace.update(zip(self.containers, self._shards))
        replace.update(self._row_dims(self._shards[0]))
        lik_x = pytensor.clone_replace(lik, replace=replace)
        once_x = pytensor.clone_replace(once, replace=dict(to_x))
        mode = _pymc_mode(model)
        self._fn = synk.function(
            inputs=[], bcast_inputs=[x],
            outputs=[(lik_x, "sum"), (_grad(lik_x, x), "sum")],
            sliceable_shareds=self._shards, name=name, mode=mode, on_unused_input="ignore")
        # Run in the master only: counted once, whatever the number of ranks.
        self._once = pytensor.function([x], [once_x, _grad(once_x, x)], mode=mode,
                                       on_unused_input="ignore")
        self._scattered = False
        logger.info("pymc model: %d value variables (%d numbers), data %s split by rows (%d)",
                    len(value_vars), self.size, [c.name for c in self.containers], self.n_rows)

    def _choose_data(self, lik, data):
        model = self.model
        containers = [v for v in model.data_vars if isinstance(v, SharedVariable)]
        used = set(compat.ancestors([lik]))
        if data is not None:
            by_name = {c.name: c for c in containers}
            items = [data] if isinstance(data, (str, SharedVariable)) else list(data)
            chosen = []
            for item in items:
                c = by_name.get(item) if isinstance(item, str) else item
                if c is None or not any(c is d for d in containers):
                    raise ValueError(f"data_parallel: data entry {item!r} is not a pm.Data "
                                     "container of the model")
                chosen.append(c)
        else:
            n_obs = self._observed_length(containers, used)
            chosen = [c for c in containers if c in used and np.ndim(c.get_value(borrow=True))
                      and len(c.get_value(borrow=True)) == n_obs]
        if not chosen:
            raise ValueError("data_parallel: no pm.Data container to split by rows")
        lengths = {len(c.get_value(borrow=True)) for c in chosen}
        if len(lengths) > 1:
            raise ValueError(f"data_parallel: the containers to split have different lengths "
                             f"{sorted(lengths)}; they must share their rows")
        return chosen

    def _observed_length(self, containers, used):
        lengths = set()
        for rv in self.model.observed_RVs:
            value = self.model.rvs_to_values[rv]
            mine = [c for c in containers if c in set(compat.ancestors([value]))]
            if not mine:
                raise ValueError(
                    f"data_parallel: the observed data of {rv.name!r} is not in a pm.Data "
                    f"container; build it with pm.Data({rv.name!r}_data, values) and pass "
                    "that as observed=")
            lengths.update(len(c.get_value(borrow=True)) for c in mine
                           if np.ndim(c.get_value(borrow=True)))
        if len(lengths) != 1:
            raise ValueError(f"data_parallel: the observed data have different lengths "
                             f"{sorted(lengths)}; pass data= to say which containers to split")
        return lengths.pop()

    def _replace_values(self, x, value_vars):
        pairs, lo = [], 0
        for v, shape, size in zip(value_vars, self._shapes, self._sizes):
            part = x[lo:lo + size].reshape(shape) if shape else x[lo]
            part = pt.specify_shape(part, shape) if shape else part
            pairs.append((v, part.astype(v.dtype)))
            lo += size
        return pairs

    def _row_dims(self, shard):
        """Dims named for the split rows whose length is a shared variable: follow the shard."""
        dims_of = self.model.named_vars_to_dims
        out = {}
        for c in self.containers:
            dims = dims_of.get(c.name) or ()
            if dims and dims[0] is not None:
                length = self.model.dim_lengths.get(dims[0])
                if isinstance(length, SharedVariable):
                    out[length] = shard.shape[0].astype(length.dtype)
        return out

    def scatter(self):
        """Split the rows of the model's containers over the ranks.  Master only.

        Call after ``synk.distribute()``, and again after changing the data
        with ``pm.set_data``.

        Raises:
            SynkStateError: before distribute().
        """
        synk.scatter(self._shards, [c.get_value(borrow=True) for c in self.containers])
        self._scattered = True

    def ravel(self, point):
        """Return the flat vector of a point dict (keys: ``value_names``)."""
        missing = [n for n in self.value_names if n not in point]
        if missing:
            raise ValueError(f"point lacks value variables {missing}")
        if not self.value_names:
            return np.zeros(0, self.dtype)
        return np.concatenate([np.asarray(point[n], dtype=self.dtype).ravel()
                               for n in self.value_names])

    def unravel(self, x):
        """Return the point dict of a flat vector."""
        x = np.asarray(x)
        if x.shape != (self.size,):
            raise ValueError(f"x must have shape ({self.size},); got {x.shape}")
        out, lo = {}, 0
        for n, shape, size, dtype in zip(self.value_names, self._shapes, self._sizes,
                                         self._dtypes):
            out[n] = x[lo:lo + size].reshape(shape).astype(dtype)
            lo += size
        return out

    def initial_x(self):
        """Return the model's initial point as a flat float64 vector."""
        return self.ravel(self.model.initial_point()).astype(np.float64)

    def _flat(self, point):
        if isinstance(point, dict):
            return self.ravel(point)
        x = np.asarray(point, dtype=self.dtype)
        if x.shape != (self.size,):
            raise ValueError(f"x must have shape ({self.size},); got {x.shape}")
        return x

    def _call(self, point, subset):
        x = self._flat(point)
        if not self._scattered:
            self.scatter()
        return x, self._fn(x, output_subset=subset)

    def logp(self, point):
        """Return the model's log-density at ``point`` (a point dict or flat vector).

        Equals ``model.compile_logp()(point)`` on the whole data set.
        """
        x, (lik,) = self._call(point, [0])
        once, _ = self._once(x)
        return np.asarray(lik + once)[()]

    def dlogp(self, point):
        """Return the flat gradient of the log-density at ``point``.

        Equals ``model.compile_dlogp()(point)`` on the whole data set.
        """
        return self.logp_dlogp(point)[1]

    def logp_dlogp(self, point):
        """Return ``(logp, dlogp)`` at ``point`` with one data-parallel call."""
        x, (lik, glik) = self._call(point, None)
        once, gonce = self._once(x)
        return np.asarray(lik + once)[()], np.asarray(glik + gonce)

    def neg_logp_dlogp(self, x):
        """Return ``(-logp, -dlogp)`` as float64: ``scipy.optimize.minimize(..., jac=True)``."""
        lp, g = self.logp_dlogp(x)
        return -float(lp), -np.asarray(g, dtype=np.float64)

    def find_map(self, x0=None, method="L-BFGS-B", **kwargs):
        """Maximise the log-density with ``scipy.optimize.minimize``; return (point, result).

        Args:
            x0: start (point dict or flat vector); default the model's initial point.
            method: a gradient-based ``scipy.optimize.minimize`` method.
            **kwargs: passed on to ``scipy.optimize.minimize`` (``options=``...).

        Returns:
            ``(point dict, scipy OptimizeResult)``; the point is in the
            transformed space, as ``model.initial_point()``.
        """
        from scipy.optimize import minimize

        x0 = self.initial_x() if x0 is None else np.asarray(self._flat(x0), np.float64)
        res = minimize(self.neg_logp_dlogp, x0, jac=True, method=method, **kwargs)
        return self.unravel(res.x), res


def _grad(cost, x):
    # A model part may not depend on every parameter (or on none): zeros, not an error.
    return pytensor.grad(cost, x, disconnected_inputs="ignore")


def _empty_rows(value):
    value = np.asarray(value)
    return np.empty((0,) + value.shape[1:], dtype=value.dtype)


def _pymc_mode(model):
    """Return the mode PyMC's own compile uses: failed parameter checks give -inf."""
    from pytensor.compile.mode import Mode, get_mode

    check = ("local_check_parameter_to_ninf_switch" if model.check_bounds
             else "local_remove_check_parameter")
    mode = get_mode(None)
    return Mode(linker=mode.linker, optimizer=mode.provided_optimizer.including(check))
