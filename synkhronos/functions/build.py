"""synk.function(): check its arguments, compile, and the ``FunctionSpec`` every rank runs."""

import logging
from dataclasses import dataclass, field

import pytensor
from pytensor.compile import SharedVariable
from pytensor.graph.basic import Variable

from .. import compat
from ..comm import reduce_ops
from ..errors import SynkStateError
from ..runtime import devices
from ..runtime.state import require_forked, serialized
from .deferred import Deferred
from .function import Function

logger = logging.getLogger(__name__)


@serialized
def function(inputs, outputs=None, bcast_inputs=None, updates=None, givens=None,
             sliceable_shareds=None, **kwargs):
    """Build a data-parallel function; use it like ``pytensor.function``.  Master only.

    Call after ``fork()`` and before ``distribute()``.

    Args:
        inputs: variables whose data is scattered along axis 0 over the ranks.
        outputs: a variable, ``(variable, op)``, or a list of either.  ``op``
            is how per-rank results combine: "avg" (default; weighted by rows,
            so exact for uneven splits), "sum", "prod", "max", "min", None (the
            list of per-rank results, in rank order) or "gather" (per-rank
            results concatenated along axis 0, in rank order).
        bcast_inputs: variables whose data every rank uses whole.
        updates: ``(shared, update)`` pairs, or ``(shared, update, op)``
            triples; ``op`` ("avg" default, or sum/prod/max/min) combines the
            update over slices (``num_slices``) within a rank.  Updates apply in
            each rank locally.
        givens: as in ``pytensor.function``.
        sliceable_shareds: shared variables holding data-parallel data, to be
            selected by ``batch_s`` and split by ``num_slices``.
        **kwargs: passed on to every internal ``pytensor.function`` call.

    Returns:
        Function

    Raises:
        SynkStateError: not forked yet, or already distributed (a ``RuntimeError``);
            or a JAX-mode function when JAX ran in this process before fork().
        TypeError: an argument of the wrong form.
        ValueError: an unknown reduce op, or a sliceable shared variable the
            function does not use.
    """
    return _build(inputs, outputs, bcast_inputs, updates, givens, sliceable_shareds, kwargs,
                  deferred=False)


@serialized
def function_at_first_call(inputs, outputs=None, bcast_inputs=None, updates=None, givens=None,
                           sliceable_shareds=None, lazy=None, **kwargs):
    """``function()``, with the PyTensor function built at its first call, in each process.

    A seam for extensions (the PyMC extension's graphs at many positions,
    called only when several chains ask at once): ``pytensor.function``'s
    rewrites alone take up to seconds a graph, and ``distribute()`` compiles
    every Numba-linked function's code in the master so that the workers,
    started again from it, share the code; a function that may never be
    called then costs all that up front.  Deferred, every rank builds and
    compiles it at the first call: at once where each has a core, else the
    master first, so that the others load the code from PyTensor's cache
    instead of each compiling it (``deferred.py``).  A graph with updates, givens, sliceable shared
    variables, in-graph collectives or the JAX linker (unless lazy, in CPU mode) is built now, as
    ``function()`` builds it.  Master only, before ``distribute()``; takes
    ``function()``'s arguments, and ``lazy``: a ``deferred.Lazy`` whose
    ``make`` builds the output variables at the first call, in each
    process; ``outputs`` then gives their ops, on placeholder variables
    (one per output).
    """
    if lazy is not None and (updates or givens or sliceable_shareds):
        raise ValueError("function_at_first_call: lazy outputs take no updates, givens or "
                         "sliceable_shareds")
    return _build(inputs, outputs, bcast_inputs, updates, givens, sliceable_shareds, kwargs,
                  deferred=True, lazy=lazy)


def _build(inputs, outputs, bcast_inputs, updates, givens, sliceable_shareds, kwargs, deferred,
           lazy=None):
    rt = require_forked("function()")
    if rt.registry.distributed:
        raise SynkStateError("function() must be called before distribute()")
    inputs = var_list(inputs, "inputs")
    bcast_inputs = var_list(bcast_inputs, "bcast_inputs")
    seen = set()
    for v in inputs + bcast_inputs:
        if id(v) in seen:
            raise ValueError(f"function: variable {v} appears twice among inputs and bcast_inputs")
        seen.add(id(v))
    out_vars, out_ops, return_list = parse_outputs(outputs)
    upd_pairs, upd_ops = parse_updates(updates)
    sliceable = var_list(sliceable_shareds, "sliceable_shareds", shared=True)
    if rt.config.device == "gpu":
        # GPU mode: shared variables live on the device as JAX arrays.
        kwargs.setdefault("mode", "JAX")
    args = (inputs + bcast_inputs, out_vars)
    jax = _jax_mode(kwargs.get("mode"))
    # A lazy graph in JAX runs on the CPU's NumPy arrays like any other (the PyMC
    # extension's rank graphs); GPU mode's JAX functions hold device arrays: built now.
    deferred = (deferred and not upd_pairs and not givens and not sliceable
                and (not jax or (lazy is not None and rt.config.device == "cpu"))
                and not _graph_holds_collective(out_vars))
    if lazy is not None:
        if not deferred or _graph_holds_collective(lazy.base):
            raise ValueError("function_at_first_call: lazy outputs need a plain graph (no "
                             "in-graph collective, not the JAX linker in GPU mode)")
        fn = Deferred(args, kwargs, lazy, uses_jax=jax)
    elif deferred:
        fn = Deferred(args, kwargs)
    else:
        fn = pytensor.function(*args, updates=upd_pairs or None, givens=givens, **kwargs)
    used = {id(s) for s in fn.get_shared()}
    for s in sliceable:
        if id(s) not in used:
            raise ValueError(f"function: sliceable_shareds entry {s} is not used by this function")
    if devices.uses_jax(fn) and rt.jax_before_fork:
        raise SynkStateError(
            "function: JAX already ran in this process before fork(), so the workers "
            "cannot run JAX-mode functions (their first JAX call would hang). Call "
            "synk.fork() before any JAX computation, or use another mode.")
    spec = FunctionSpec(len(rt.registry.functions), fn, inputs, bcast_inputs, out_vars, out_ops,
                        return_list, upd_pairs, upd_ops, givens, sliceable, kwargs,
                        compile_at_first_call=deferred)
    f = Function(spec)
    f.attach(rt)
    rt.registry.functions.append(f)
    return f


@dataclass
class FunctionSpec:
    """What every rank needs to run a synkhronos function: the compiled function and its parts."""

    id: int                     # the function's index in the run (Registry.functions)
    fn: object                  # the compiled pytensor function
    inputs: list                # scattered inputs
    bcast_inputs: list
    outputs: list
    output_ops: list
    return_list: bool
    updates: list               # (shared, update) pairs
    update_ops: list
    givens: object
    sliceable: list
    kwargs: dict
    variants: dict = field(default_factory=dict)  # per process: compiled slicing variants
    compile_at_first_call: bool = False           # built at the first call (function_at_first_call)
    simple: bool = field(init=False)              # one output with a collective op
    collective: bool = field(init=False)          # the graph holds in-graph collectives
    jax: bool = field(init=False)                 # runs on PyTensor's JAX backend

    def __post_init__(self):
        self.simple = (len(self.outputs) == 1
                       and self.output_ops[0] in reduce_ops.COLLECTIVE_OPS)
        # A deferred graph holds none (function_at_first_call builds those now).
        self.collective = (not isinstance(self.fn, Deferred)
                           and _holds_collective(self.fn.maker.fgraph, set()))
        self.jax = devices.uses_jax(self.fn)

    def ready(self):
        """The compiled PyTensor function; a deferred one is built here first and kept."""
        fn = self.fn
        if type(fn) is Deferred:
            fn = self.fn = fn.build()
        return fn

    def __getstate__(self):
        state = dict(self.__dict__)
        state["variants"] = {}  # compiled again where needed
        return state


def _jax_mode(mode):
    """Whether ``mode`` (a name or a ``Mode``) links with JAX."""
    if isinstance(mode, str):
        return mode.upper() == "JAX"
    return mode is not None and "JAX" in type(getattr(mode, "linker", None)).__name__


def _graph_holds_collective(outputs):
    """Whether the graph of ``outputs``, as given (not compiled), holds an in-graph collective."""
    for var in compat.ancestors(outputs):
        if var.owner is None:
            continue
        op = var.owner.op
        inner = getattr(op, "fgraph", None)
        if getattr(op, "synk_collective", False) or (
                hasattr(inner, "apply_nodes") and _holds_collective(inner, set())):
            return True
    return False


def _holds_collective(fgraph, seen):
    """Whether a graph holds an in-graph collective, also inside inner graphs (Scan, OpFromGraph)."""
    for node in fgraph.apply_nodes:
        op = node.op
        if getattr(op, "synk_collective", False):
            return True
        inner = getattr(op, "fgraph", None)
        if hasattr(inner, "apply_nodes") and id(inner) not in seen:
            seen.add(id(inner))
            if _holds_collective(inner, seen):
                return True
    return False


def var_list(value, what, shared=False):
    """``value`` (a variable, a list of them, or None) as a list, checked."""
    if value is None:
        return []
    if isinstance(value, Variable):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"function: {what} must be a variable or a list of variables; "
                        f"got {type(value).__name__}")
    for v in value:
        if not isinstance(v, Variable):
            raise TypeError(f"function: {what} must hold PyTensor variables; got {type(v).__name__}")
        if shared and not isinstance(v, SharedVariable):
            raise TypeError(f"function: {what} must hold shared variables; got {v}")
        if not shared and isinstance(v, SharedVariable):
            raise TypeError(f"function: {what} cannot hold shared variable {v}; "
                            "shared variables are implicit inputs")
    return list(value)


def _is_op_pair(x):
    return (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], Variable)
            and (x[1] is None or isinstance(x[1], str)))


def _check_not_a_long_pair(x):
    """A tuple of a variable and strings is a malformed (variable, op) pair: say so."""
    if (isinstance(x, tuple) and len(x) != 2 and x and isinstance(x[0], Variable)
            and any(isinstance(e, str) for e in x[1:])):
        raise TypeError(f"function: an output with its op is a (variable, op) pair of 2 "
                        f"entries; got a {len(x)}-tuple {x!r}")


def parse_outputs(outputs):
    """Return (variables, ops, whether a list was given) from ``outputs`` as function() takes it."""
    if outputs is None:
        return [], [], True
    _check_not_a_long_pair(outputs)
    single = isinstance(outputs, Variable) or _is_op_pair(outputs)
    entries = [outputs] if single else outputs
    if not isinstance(entries, (list, tuple)):
        raise TypeError(f"function: outputs must be a variable, a (variable, op) pair or a "
                        f"list of them; got {type(outputs).__name__}")
    out_vars, out_ops = [], []
    for e in entries:
        _check_not_a_long_pair(e)
        if _is_op_pair(e):
            var, op = e
        elif isinstance(e, Variable):
            var, op = e, "avg"
        else:
            raise TypeError(f"function: each output must be a variable or a (variable, op) "
                            f"pair; got {e!r}")
        out_vars.append(var)
        out_ops.append(reduce_ops.check_op(op, "function: output op", reduce_ops.OUTPUT_OPS))
    return out_vars, out_ops, not single


def parse_updates(updates):
    """Return ((shared, update) pairs, their ops) from ``updates`` as function() takes it."""
    if updates is None:
        return [], []
    if isinstance(updates, dict):
        updates = list(updates.items())
    if not isinstance(updates, (list, tuple)):
        raise TypeError("function: updates must be a list of (shared, update) pairs or "
                        f"(shared, update, op) triples; got {type(updates).__name__}")
    pairs, ops = [], []
    for u in updates:
        if not isinstance(u, (list, tuple)) or len(u) not in (2, 3):
            raise TypeError("function: each update must be a (shared, update) pair or a "
                            f"(shared, update, op) triple; got {u!r}")
        if not isinstance(u[0], SharedVariable):
            raise TypeError(f"function: an update must target a shared variable; got {u[0]!r}")
        op = u[2] if len(u) == 3 else "avg"
        ops.append(reduce_ops.check_op(op, "function: update op"))
        pairs.append((u[0], u[1]))
    return pairs, ops
