"""Which PyTensor mode a model's rank graph runs fastest in, measured on a rank's share of its rows.

No one mode wins for every model: on a logistic regression of 581,012 rows x
55 covariates a rank's (logp, dlogp) ran 5x faster in C (the cvm linker: BLAS's
gemv, fused loops) than in Numba, and on a radon-style model, indexed per
row, 4.8x faster in Numba (issue 47, bench/pymc_calls.py --parts ratio).  So
where ``data_parallel(mode=None)``, the first data-parallel evaluation
compiles the one-position graph in each mode in the master, times it on as
many rows as one rank holds, and keeps the faster; only that mode's
functions are then built on the ranks.  A mode whose graph Numba could
compile only in object mode simply measures slow.
"""

import logging
import time

import numpy as np
import pytensor

logger = logging.getLogger(__name__)

TRIAL_S = 0.05
"""Seconds each mode's graph is timed for, after its first (compiling) call: at least 3
calls, at most 200."""


def fastest(inputs, position, output, arrays, x, n_parts, modes):
    """The name of the fastest of ``modes`` for ``output`` on a rank's rows, and each one's seconds.

    Args:
        inputs: the graph's row inputs, ``arrays`` their values (every row).
        position: the graph's position input, ``x`` its value.
        output: the one-position graph.
        n_parts: how many ranks share the rows (each holds about 1 / n_parts of them).
        modes: mode name -> the PyTensor mode to compile in.
    """
    rows = max(1, -(-len(arrays[0]) // n_parts))
    args = [np.asarray(a[:rows]) for a in arrays] + [x]
    seconds = {}
    for name, mode in modes.items():
        t0 = time.perf_counter()
        fn = pytensor.function([*inputs, position], output, mode=mode, on_unused_input="ignore")
        fn(*args)   # Numba compiles at the first call
        compile_s = time.perf_counter() - t0
        times, end = [], time.perf_counter() + TRIAL_S
        while len(times) < 3 or (len(times) < 200 and time.perf_counter() < end):
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        seconds[name] = min(times)
        logger.debug("pymc model: the ranks' graph in %s: %.1f us on %d rows (compiled in "
                     "%.2f s)", name, seconds[name] * 1e6, rows, compile_s)
    best = min(seconds, key=seconds.get)
    logger.info("pymc model: the ranks' graph runs in %s (%s on %d rows)", best,
                ", ".join(f"{m} {s * 1e6:.0f} us" for m, s in seconds.items()), rows)
    return best, seconds
