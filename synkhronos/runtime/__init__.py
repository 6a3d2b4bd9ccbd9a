"""The runtime: the one process-global state, commands and the control block, the worker loop,
liveness, the janitor, shared memory, devices, profiling and the fork plan.

Importing it checks its C extension (``_block``, the waits): built from these sources, or
an ImportError that says how to rebuild, never a stale build that misreads memory.
"""

import importlib

# The ABI of runtime/_block.c this Python expects (SYNK_BLOCK_ABI in runtime/_block.h):
# bump both together.
BLOCK_ABI = 3

REBUILD = "pip install -e ."


def load_extension(name, abi):
    """Import the C extension ``name`` and return it, checked against the ABI ``abi`` its Python expects.

    Raises:
        ImportError: it is not built, or was built from other sources (its ``ABI``
            differs); the message names the rebuild, ``pip install -e .``.
    """
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"synkhronos's C extension {name} does not import ({exc}); "
                          f"rebuild it: {REBUILD} (or pip install . outside a checkout)") from exc
    found = getattr(module, "ABI", None)
    if found != abi:
        raise ImportError(f"synkhronos's C extension {name} is a stale build (ABI {found}, "
                          f"these sources expect {abi}); rebuild it: {REBUILD} "
                          f"(or pip install . outside a checkout)")
    return module


load_extension(__name__ + "._block", BLOCK_ABI)
