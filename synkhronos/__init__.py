"""Synkhronos: data-parallel PyTensor functions on all local cores (or GPUs).

    import synkhronos as synk
    synk.fork()
    f = synk.function([x], outputs=loss)
    synk.distribute()
    loss = f(synk.data(x_data))
"""

import logging

logging.getLogger(__name__).addHandler(logging.NullHandler())


# floatX: float32 unless the user chose (flags, code, PyMC); see floatx.py.
from . import floatx as _floatx  # noqa: E402

_floatx.apply_default()

from .cluster.layout import Layout, layout, on_machines  # noqa: E402
from .inputs.data_object import Data  # noqa: E402
from .inputs.create import data  # noqa: E402
from .inputs.produced import PlacedData  # noqa: E402
from .inputs.machine_rows import Part, batches  # noqa: E402
from .functions.distribute import distribute  # noqa: E402
from .errors import (BackendUnavailableError, MachineLostError, SharedMemoryError, SynkError,  # noqa: E402
                     SynkStateError, WorkerDiedError, WorkerError, WorkerStalledError)
from .functions.build import function  # noqa: E402
from .functions.function import Function  # noqa: E402
from .process import close, fork  # noqa: E402
from .runtime.profiling import profile  # noqa: E402
from .variables.collectives import (all_gather, all_reduce, broadcast, gather, get_lengths, get_shapes,  # noqa: E402
                                    get_value, reduce, scatter, set_value)

__version__ = "0.1.0"

__all__ = [
    "fork", "close", "function", "distribute", "data", "Data", "Function",
    "PlacedData", "Part", "batches",
    "SynkError", "SynkStateError", "WorkerError", "WorkerDiedError", "WorkerStalledError",
    "MachineLostError", "SharedMemoryError", "BackendUnavailableError",
    "broadcast", "scatter", "gather", "all_gather", "reduce", "all_reduce",
    "set_value", "get_value", "get_lengths", "get_shapes", "profile", "layout", "Layout", "on_machines",
]

# Public modules beside __all__, imported on first use (``synk.checkpoint.save(...)``).
_PUBLIC_MODULES = ["checkpoint", "extensions", "ingraph"]


def __getattr__(name):
    if name in _PUBLIC_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'synkhronos' has no attribute {name!r}")


def __dir__():
    # The public API only: the package's own submodules (runtime, process, ...) and the
    # modules it imports are reachable, but not what a user looks for here.
    return sorted(__all__ + _PUBLIC_MODULES + ["__version__"])
