"""What PyTensor's JAX backend lacks for PyMC's graphs: an ``erfcx`` in float64.

``pm.Censored`` on a normal, on PyMC 5.28, reads its log-CDF through the
scaled complementary error function (``erfcx``).  PyTensor 2.38's JAX backend
asks TensorFlow Probability for it, so without that installed the graph did
not compile in JAX and the ranks could not be measured in it (``modes``);
PyTensor 3.3's takes jax's own, which in jax 0.10.2 is off by up to 100%
near x = 26.5 (a one-off check, bench/HISTORY.md, 2026-12-06).  ``erfcx`` here is
``exp(x**2) * erfc(x)`` where that product cannot overflow, and its
asymptotic series beyond (x > 26, seven terms: below float64's rounding
there): within 1e-13 of SciPy's (the test; 1.4e-15 in a one-off check on
200,001 points, bench/HISTORY.md).  Registered when
PyTensor's JAX dispatch module loads (``import_hooks.when_imported``), unless
TensorFlow Probability, which PyTensor's own asks for, is installed.
"""

import importlib.util
import logging
import math

logger = logging.getLogger(__name__)

JAX_DISPATCH = "pytensor.link.jax.dispatch"

_DIRECT_MAX = 26.0   # exp(x * x) overflows float64 from x = 26.64
_TERMS = 7           # the series' terms: the eighth is below 1e-18 of the first at x = 26


def erfcx(x):
    """``exp(x**2) * erfc(x)`` in JAX, for float64 (see the module's docstring)."""
    import jax.numpy as jnp
    from jax.scipy.special import erfc

    big = x > _DIRECT_MAX
    near = jnp.where(big, 0.0, x)
    direct = jnp.exp(near * near) * erfc(near)
    far = jnp.where(big, x, _DIRECT_MAX)
    a = 0.5 / (far * far)
    series = jnp.ones_like(far)
    for n in range(_TERMS - 1, 0, -1):     # 1 - a (1 - 3a (1 - 5a (...)))
        series = 1.0 - (2 * n - 1) * a * series
    return jnp.where(big, series / (far * math.sqrt(math.pi)), direct)


def register():
    """Give PyTensor's JAX backend this ``erfcx``, unless TensorFlow Probability is
    installed."""
    from pytensor.link.jax.dispatch import jax_funcify
    from pytensor.scalar.math import Erfcx

    if importlib.util.find_spec("tensorflow_probability") is not None:
        return

    @jax_funcify.register(Erfcx)
    def _jax_erfcx(op, **kwargs):
        return erfcx

    logger.debug("erfcx registered with PyTensor's JAX backend")
