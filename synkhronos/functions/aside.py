"""Functions built at their first call, built by the workers ahead of it while the master works.

Why: a function built at its first call (``function_at_first_call``) is
compiled by every rank at that call, each on its core, the master included.
Where the master compiles the very same graph earlier for ends of its own
(the PyMC extension times a rank's graph in each mode before keeping one),
the workers' cores idle meanwhile, and the first call then compiles it once
more on every rank: censored data at 10^5 rows on PyMC 5.28, where Numba
takes 3.3-3.9 s for the rank's graph, waited 4.5 s at that call after 4.0 s
of measuring (bench/HISTORY.md, 2026-12-08).  ``build_while`` builds the
functions on the workers while the master runs its own part, and ``adopt``
gives the master's function the PyTensor function the master compiled.
"""

import logging
from typing import NamedTuple

from .. import compat
from ..runtime.commands import Command, handler
from ..runtime.run import run_command
from ..runtime.state import serialized
from .deferred import Deferred
from .kept import builds_together

logger = logging.getLogger(__name__)


class BuildMsg(NamedTuple):
    """BUILD: each worker builds these functions (``Registry.functions`` indices) now."""

    function_ids: tuple


@handler(Command.BUILD, BuildMsg, local=True)
def _build_worker(rt, msg):
    for i in msg.function_ids:
        spec = rt.registry.functions[i].spec
        try:
            compat.precompile(spec.ready())   # Numba compiles its code at a first call else
        except Exception as exc:  # noqa: BLE001 - built again, and its failure raised, at its call
            logger.debug("rank %d: %s not built ahead of its first call (%s: %s)", rt.place.rank,
                         spec.fn.name, type(exc).__name__, exc)


@serialized
def build_while(functions, local):
    """Run ``local()`` in the master while every worker builds ``functions``; return its result.

    ``functions`` are ``function_at_first_call``'s, not called yet; the
    master's own are left to build at their first call, or to ``adopt``.
    The workers build only on one machine where each rank has a core
    (``kept.builds_together``: elsewhere they load the master's code at
    that call): there, or where none is left unbuilt, ``local()`` runs
    alone.  A worker's build that fails is left to the first call, which
    builds it again and raises its error.  Master only, after
    ``distribute()``.

    Raises:
        SynkStateError: not distributed, or a closed run.
        WorkerError: a worker failed outside its build (the command's own errors);
            ``local()``'s own exception is raised as it was.
    """
    ids = tuple(f.spec.id for f in functions
                if f.spec.compile_at_first_call and type(f.spec.fn) is Deferred)
    rt = functions[0].runtime() if functions else None
    if not ids or not builds_together(rt):
        return local()
    out = []

    def mine(seq):
        try:
            out.append((local(), None))
        except Exception as exc:  # noqa: BLE001 - raised as it was once the workers are done
            out.append((None, exc))

    run_command(rt, Command.BUILD, BuildMsg(ids), local=mine,
                what=f"{len(ids)} function(s) built ahead of their first call")
    result, exc = out[0]
    if exc is not None:
        raise exc
    return result


def adopt(function, fn):
    """Let the master's ``function`` (``function_at_first_call``'s, not built yet) run ``fn``.

    ``fn`` is a PyTensor function the master compiled of the same inputs, in
    the same order, and the same outputs as a list, in the same mode; it is
    not compiled again at the first call.  Where ``function`` is built
    already, nothing changes.
    """
    deferred = function.spec.fn
    if type(deferred) is Deferred:
        deferred.adopt(fn)
