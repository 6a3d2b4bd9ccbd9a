"""distribute(): every Function in each worker, by starting the workers again from the master
(one machine, CPU mode) or in one pickle, unpickled on each worker."""

import logging
import pickle
import time
from typing import NamedTuple

from .. import compat
from ..runtime import devices
from ..variables import access
from ..runtime.commands import Command, handler
from ..runtime.run import run_command
from ..errors import SynkStateError
from ..runtime.state import require_forked, serialized

logger = logging.getLogger(__name__)


@serialized
def distribute():
    """Replicate every synkhronos function, with its shared variables, in every worker.

    Call once, after building the last function and before calling any.  On
    one machine in CPU mode the workers are started again from the master, so
    they share its compiled functions instead of compiling their own; elsewhere
    all functions travel in one pickle.  Either way a shared variable used by
    several functions stays one variable in each worker.  Master only.

    Raises:
        SynkStateError: not forked, or already distributed (a ``RuntimeError``).
    """
    rt = require_forked("distribute()")
    if rt.registry.distributed:
        raise SynkStateError("distribute() can be called only once per fork()")
    t0 = time.perf_counter()
    functions = rt.registry.functions
    shareds = _collect_shareds(functions)
    # On one machine in CPU mode the workers start again from the master, which holds
    # every Function now: they share its compiled code and memory (process.respawn).
    if rt.respawn(rt, lambda: _install_here(rt, functions, shareds)):
        logger.info("distributed %d functions (%d shared variables) by starting the workers "
                    "again in %.2f s", len(functions), len(shareds), time.perf_counter() - t0)
        return
    msg = DistributeMsg.of(functions, shareds)
    run_command(rt, Command.DISTRIBUTE, msg)
    _install(rt, functions, shareds)
    logger.info("distributed %d functions (%d shared variables, %.1f MB) in %.2f s",
                len(functions), len(shareds), len(msg.blob) / 1e6, time.perf_counter() - t0)


def _collect_shareds(functions):
    """Every shared variable any function uses, in first-use order."""
    seen = {}
    for f in functions:
        for s in f.spec.fn.get_shared():
            seen.setdefault(id(s), s)
    return list(seen.values())


def _install(rt, functions, shareds):
    rt.registry.epoch += 1  # what was prepared for kept messages names functions
    rt.registry.functions = list(functions)
    rt.registry.shareds = list(shareds)
    rt.registry.shared_ids = {id(s): i for i, s in enumerate(shareds)}
    # Collectives keep the values of JAX functions' shared variables on the device; a JAX
    # function built at its first call (CPU mode only) reads host arrays, and placing them
    # here would start JAX in the master before the workers are forked from it.
    rt.registry.device_shareds = {id(s) for f in functions
                                  if devices.uses_jax(f.spec.fn) and not f.spec.compile_at_first_call
                                  for s in f.spec.fn.get_shared()}
    for s in shareds:
        # Their values go to the device once, here, rather than from the host
        # at every call until their first update.
        access.place(rt, s)
    rt.registry.distributed = True


def _install_here(rt, functions, shareds):
    """Install in the master before its workers start again from it, with the code compiled."""
    _install(rt, functions, shareds)
    n = sum(compat.precompile(f.spec.fn) for f in functions if not f.spec.compile_at_first_call)
    logger.debug("compiled the code of %d of %d functions before starting the workers", n,
                 len(functions))


class DistributeMsg(NamedTuple):
    """DISTRIBUTE: every Function and shared variable, in one pickle."""

    blob: bytes

    @classmethod
    def of(cls, functions, shareds):
        """The message for ``functions`` and ``shareds``: their values as they are now.

        ``distribute()`` sends it to every worker; a machine that joins later
        gets one made the same way (``cluster/elastic/door.py``).
        """
        return cls(pickle.dumps((functions, shareds), protocol=pickle.HIGHEST_PROTOCOL))


@handler(Command.DISTRIBUTE, DistributeMsg)
def _distribute_worker(rt, msg):
    functions, shareds = pickle.loads(msg.blob)
    for f in functions:
        f.attach(rt)
    _install(rt, functions, shareds)
