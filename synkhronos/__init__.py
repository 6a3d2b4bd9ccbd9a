"""Synkhronos: data-parallel PyTensor functions on all local cores (or GPUs).

    import synkhronos as synk
    synk.fork()
    f = synk.function([x], outputs=loss)
    synk.distribute()
    loss = f(synk.data(x_data))
"""

import logging
import os

logging.getLogger(__name__).addHandler(logging.NullHandler())


def _default_float32():
    # The original ran on GPUs with floatX=float32 and its examples mix float32
    # data with T.matrix(); keep them working unless the user chose floatX.
    import pytensor

    flags = os.environ.get("PYTENSOR_FLAGS", "") + os.environ.get("THEANO_FLAGS", "")
    if "floatX" not in flags and pytensor.config.floatX == "float64":
        pytensor.config.floatX = "float32"


_default_float32()

from .cluster.layout import Layout, layout  # noqa: E402
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
    "set_value", "get_value", "get_lengths", "get_shapes", "profile", "layout", "Layout",
]
