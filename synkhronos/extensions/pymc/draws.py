"""How many gradients a draw takes, for ``crossover``'s prediction: ``draw_steps`` by a
position's size, or counted by a short nutpie run (``leapfrogs``) where the choice turns on
the count.
"""

import logging
import warnings

import numpy as np

from . import internals
from .master_cores import released

logger = logging.getLogger(__name__)

LEAPFROGS = 10
"""Gradient evaluations a draw takes, for the prediction: NUTS's trees of depth 3-4, as
tuned models take (tests/extensions/test_pymc.py counts n_steps per draw), up to
``LEAPFROG_SIZE`` numbers a position (``draw_steps``)."""

LEAPFROG_SIZE = 100
"""Above this many numbers a position a draw takes ``(size / LEAPFROG_SIZE) ** (1/4)`` times
``LEAPFROGS``: NUTS's step shrinks as the size to the -1/4 (Beskos et al., 2013), its paths
take as many more steps.  The missing values at 10^5 rows (9965 numbers) took 31 a draw (the
rule: 32), 45-52 tuning (nutpie, PyMC 6.4; bench/HISTORY.md, 2026-12-07)."""

MAX_LEAPFROGS = 1023
"""The most a draw takes: NUTS's trees at their default greatest depth, 10."""

TRIAL_TUNE, TRIAL_DRAWS = 30, 20
"""nutpie's short run on PyMC's compiled function in this process (the callback way) that
counts the gradients a draw takes (``leapfrogs``), where the choice between that way and
nutpie's own compile turns on the count: the draws after a short tuning.  It costs
``(TRIAL_TUNE + TRIAL_DRAWS) / (chains x (tune + draws))`` of the callback way's run, so it
runs only where that is at most ``TRIAL_SHARE``.  bench/gallery_more.py's splines counted
117 on PyMC 5.28 (nutpie's own compile chosen) and 79 on 6.4 (docs/pymc.md)."""

TRIAL_SHARE = 0.05


def counted_in(draws):
    """Whether a counting run (``leapfrogs``) is short enough beside ``draws`` draws in all
    (every chain's): at most ``TRIAL_SHARE`` of them."""
    return TRIAL_TUNE + TRIAL_DRAWS <= TRIAL_SHARE * draws


def draw_steps(size):
    """Gradients a draw of ``size`` numbers a position is predicted to take (``LEAPFROG_SIZE``)."""
    return LEAPFROGS * max(1.0, size / LEAPFROG_SIZE) ** 0.25


def leapfrogs(dp, serial):
    """Gradients a draw takes: the mean over a short nutpie run on ``serial`` (the callback
    way, ``TRIAL_TUNE`` tuning steps then ``TRIAL_DRAWS`` draws), its output kept quiet."""
    import pymc as pm

    kwargs = internals.sample_kwargs("nutpie", 1, {"tune": TRIAL_TUNE}, at_once=False)
    pymc_log = logging.getLogger("pymc")
    level = pymc_log.level
    pymc_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), released(), internals.driving_serial(dp, serial.fn):
            warnings.simplefilter("ignore")
            idata = pm.sample(TRIAL_DRAWS, chains=1, random_seed=0, nuts_sampler="nutpie",
                              model=dp.model, progressbar=False,
                              compute_convergence_checks=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the run itself reports what nutpie cannot do
        logger.debug("dp.sample: counting nutpie's gradients a draw failed: %r", exc)
        return None
    finally:
        pymc_log.setLevel(level)
    return float(np.mean(idata.sample_stats["n_steps"]))
