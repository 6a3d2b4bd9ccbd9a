"""PyMC models, data-parallel: sampling and the log-density summed over ranks, the prior once.

PyMC is an optional extra (``pip install -e '.[pymc]'``); this package
imports it, so ``import synkhronos.extensions`` does not load it.

    import synkhronos as synk
    from synkhronos.extensions import pymc as synk_pymc

    synk.fork()
    dp = synk_pymc.data_parallel(model)   # after fork(), before distribute()
    synk.distribute()
    idata = dp.sample(1000, chains=4)     # pm.sample's arguments and result

Modules by job: ``terms`` (which terms read which rows; what is refused),
``rowcheck`` (each split term adds up over rows), ``graphs`` (the graph each
rank runs, batched over positions), ``model`` (DataParallelModel), ``calls``
(its calls at one or many positions, vectorised, in a loop or one by one), ``batching``
(every chain's request in one call), ``crossover`` (whether splitting gains
over pm.sample), ``sampling`` and ``internals`` (what PyMC and nutpie need,
in one place).
"""

try:
    import pymc as _pymc  # noqa: F401
except ImportError as exc:
    raise ImportError("synkhronos.extensions.pymc needs PyMC: pip install -e '.[pymc]'"
                      ) from exc

from ... import import_hooks
from . import jax_ops
from .model import DataParallelModel

# erfcx for PyTensor's JAX backend where it has none (jax_ops), once that backend loads.
import_hooks.when_imported(jax_ops.JAX_DISPATCH, jax_ops.register)

__all__ = ["DataParallelModel", "data_parallel"]


def data_parallel(model=None, data=None, unsplit=None, name="pymc_logp", mode=None, split=None):
    """Build the data-parallel log-density of a PyMC model.  Master only.

    Call after ``synk.fork()`` and before ``synk.distribute()``.  The model
    runs as written: NumPy arrays with one row per observation (observed
    data, covariates, index arrays, ``pm.Censored`` bounds) are split as
    ``pm.Data`` containers are.  Checks the model first and refuses, naming
    the variable, what would be silently wrong when split by rows:
    ``pm.Minibatch``, NumPy masks selecting rows of a longer container, and
    terms that combine rows (a mean over rows, a sort, a time series) unless
    their containers (or arrays, by the names the refusal gives) are in
    ``unsplit``.  From then on,
    ``pm.sample`` called while forked warns where its chains would share the
    master's one pinned core (sample with ``dp.sample`` instead).

    Args:
        model: a ``pm.Model``; default: the model of the enclosing ``with`` block.
        data: which ``pm.Data`` containers to split by rows: names or
            variables; or a dict name -> ``synk.Data`` (for example
            ``synk.data(produce=fn, length=n)`` in a cluster) whose rows
            replace the container's.  Default: every container the
            log-density reads whose first axis has the observed rows.
        unsplit: containers to keep whole on every rank (the terms reading
            only those count once).
        name: name of the synkhronos function (for logs and errors).
        mode: the PyTensor mode the ranks compile the log-density in:
            "NUMBA", "CVM" (C code), "JAX" (XLA's CPU code; needs jax) or a
            ``Mode``; None: the fastest of those on this model (JAX where
            installed), timed on a rank's share of the rows at the first
            data-parallel evaluation (``dp.mode``; docs/pymc.md, "The ranks'
            mode, measured").
        split: whether ``dp.sample`` splits the rows over the ranks: True
            always, False never (it runs ``pm.sample`` itself, in this
            process with its cores released, on PyMC's own compiled (logp,
            dlogp)); None: the first ``dp.sample`` times PyMC's serial call,
            predicts the run both ways (a split at its best before anything
            is built for the ranks, then, where that could gain, a timed
            data-parallel call) and splits only where that predicts a gain
            (``dp.decision`` holds what it chose and the figures;
            docs/pymc.md, "When splitting pays").
            The other calls (``dp.logp_dlogp``, ``dp.find_map``...) always
            split.

    Returns:
        DataParallelModel

    Raises:
        SynkStateError: not forked, or already distributed.
        ValueError: no likelihood (no observed variable or ``pm.Potential``),
            a discrete free variable (no gradient), ``data``/``unsplit``
            naming something else than a container (or a lifted array), a
            likelihood that cannot be split exactly (the message names the
            variable), or ``split`` not True, False or None.
    """
    import pymc as pm

    from . import internals

    model = pm.modelcontext(model)
    dp = DataParallelModel(model, data, unsplit, name, mode, split)
    internals.warn_when_pinned()  # pm.sample while forked: its chains would share one core
    return dp
