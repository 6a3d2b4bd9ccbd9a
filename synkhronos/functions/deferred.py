"""A PyTensor function built at its first call, in each process that calls it.

Why: ``pytensor.function`` rewrites a graph before any code is compiled, and
for a PyMC model's gradient at many positions (vectorised, or a Scan of the
one-position graph) that alone took 0.8-1.7 s a graph in the master
(bench/pymc_gallery.py --parts startup), paid at ``data_parallel()`` for
graphs that a run with one chain, or one call per chain, never calls.
Deferred, the graph is kept as it was given and built at its first call by
every rank: on one machine with a core for each rank, all at once (the master
once the call is posted); else the master first, before posting it, so that
the others load Numba's code from PyTensor's cache (``kept.builds_together``).

Only plain graphs are deferred (no updates, givens or in-graph collectives;
JAX-linked ones only where lazy, in CPU mode): what the rest of the library
reads of a function before its first call (its name, its shared variables,
whether it is JAX) is then known from the graph itself and its mode.

The graph itself may be built at the first call too (``Lazy``): building a
gradient vectorised over many positions, or a Scan of one, took 0.1-0.3 s
a graph for the gallery's PyMC models (2026-12-04), for graphs a run may
never call.  Each process then builds it from what the function pickles
(or, on one machine, what the worker inherited), so its shared variables
are that process's own; ``base`` names a graph holding every one of them,
for ``distribute()`` to find before the first call.
"""

from typing import Callable, NamedTuple

import pytensor
from pytensor.compile import SharedVariable

from .. import compat


class Lazy(NamedTuple):
    """Outputs made by ``make(*args)`` at the first call, in each process (a picklable
    ``make``); every shared variable they read is in the graph of ``base``."""

    make: Callable
    args: tuple
    base: list


class Deferred:
    """Stands for ``pytensor.function(*args, **kwargs)`` until ``build()``.

    ``FunctionSpec.ready()`` swaps the built function in, so calls never go
    through this object.  Attributes set before the build (``trust_input``)
    are set on the built function.  Pickles as the graph, unbuilt.
    """

    def __init__(self, args, kwargs, lazy=None, uses_jax=False):
        # uses_jax: whether it links with JAX, read before the build (devices.uses_jax)
        self.__dict__.update(_args=args, _kwargs=kwargs, _fn=None, _attrs={},
                             name=kwargs.get("name"), _lazy=lazy, uses_jax=uses_jax)

    def get_shared(self):
        """The graph's shared variables, as ``Function.get_shared`` lists a built one's."""
        if self._fn is not None:
            return self._fn.get_shared()
        graph = self._lazy.base if self._lazy is not None else self._args[1]
        return [v for v in compat.ancestors(graph) if isinstance(v, SharedVariable)]

    def build(self):
        """The PyTensor function: built here at the first call of this, then the same one."""
        fn = self._fn
        if fn is None:
            inputs, outputs = self._args
            if self._lazy is not None:
                outputs = self._lazy.make(*self._lazy.args)
            fn = pytensor.function(inputs, outputs, **self._kwargs)
            for k, v in self._attrs.items():
                setattr(fn, k, v)
            self.__dict__["_fn"] = fn
        return fn

    def adopt(self, fn):
        """Take ``fn``, compiled elsewhere of the same graph in the same mode, as the build."""
        if self._fn is None:
            fn.name = self.name
            for k, v in self._attrs.items():
                setattr(fn, k, v)
            self.__dict__["_fn"] = fn

    def __setattr__(self, name, value):
        if self._fn is None:
            self._attrs[name] = value
        else:
            setattr(self._fn, name, value)

    def __getattr__(self, name):
        # Anything else a built function has: build it (a read before the first call).
        if name.startswith("__") or name in ("_args", "_kwargs", "_fn", "_attrs", "_lazy",
                                             "uses_jax"):
            raise AttributeError(name)
        return getattr(self.build(), name)

    def __call__(self, *args, **kwargs):
        return self.build()(*args, **kwargs)

    def __getstate__(self):
        return {"_args": self._args, "_kwargs": self._kwargs, "_fn": None,
                "_attrs": dict(self._attrs), "name": self.name, "_lazy": self._lazy,
                "uses_jax": self.uses_jax}

    def __setstate__(self, state):
        self.__dict__.update(state)
