"""A rank graph's elementwise loop over rows and the sums of its outputs, run as one loop in Numba.

A split term's logp and gradient end, for most models, in one fused
elementwise loop over the rows with several outputs (the term's value and a
partial derivative per parameter), each then summed.  PyTensor before 3.0
writes every output to an array of the rows' length and sums each in a pass
of its own: on a robust regression's 10^5 rows, a Student-t, six arrays of
800 KB for six sums, 19.5 us a thousand rows in PyMC 5.28's own Numba call.
PyTensor 3 fuses such loops and their sums itself (``FusedElemwise``; 6.0
us a thousand rows on the same model, one-off probe, bench/HISTORY.md), but
PyMC 5.27-5.28 pin PyTensor 2.  So there, and only in the Numba mode, a rank's
graph has each such loop replaced by ``RowSums``: one pass over the rows that
adds each row's outputs into scalars, nothing written per row.

A loop qualifies where it is one-dimensional, every output is float64 and
read only by full float64 sums (``Sum``), and at least one input has the
rows' length; the rest are left to PyTensor.  The sums are taken in the
rows' order, as PyTensor's own Numba sums are (not NumPy's pairwise order).

PyTensor computes both branches of an elementwise ``switch`` for every row.
Where the condition reads a parameter, rows cannot be grouped beforehand
(``branches``): a truncated normal's log-CDF takes ``erfcx`` below -1 and
``erfc`` above, by row, and its gradient reads the same values.  So in the
one loop, each value that switches read in one branch only is computed under
an ``if`` on their conditions, where it runs an op worth a branch
(``branches.COSTLY``): on a truncated regression's 10^5 rows, 3383 us a position
against 9144 (one-off probe, bench/HISTORY.md, 2026-12-07).
"""

import hashlib
import logging

import numpy as np
from pytensor.graph.basic import Apply, Constant
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import GraphRewriter
from pytensor.graph.utils import InconsistencyError
from pytensor.scalar import Composite, Switch, get_scalar_type
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.math import Sum
from pytensor.tensor.type import TensorType

from ... import compat
from . import branches

logger = logging.getLogger(__name__)

VERSION = 2
"""Part of the Numba cache key: raise it where the generated loop changes."""

POSITION = 49.4
"""Where the rewrite runs among PyTensor's: after its elementwise fusion (49), before the
destroy handler and the in-place rewrites (49.5 on)."""


def fuses_itself():
    """Whether this PyTensor fuses elementwise loops with their sums in Numba (3.0 on)."""
    try:
        from pytensor.tensor.rewriting import fused_elemwise  # noqa: F401
    except ImportError:
        return False
    return True


class RowSums(Op):
    """The sums over rows of each output of a one-dimensional elementwise loop.

    Inputs are the loop's (``Elemwise``) inputs, outputs a float64 scalar per loop
    output.  Numba runs it as one loop (``_numba_row_sums``); elsewhere it
    runs the loop and sums, as PyTensor would."""

    __props__ = ("scalar_op",)

    def __init__(self, scalar_op):
        self.scalar_op = scalar_op

    def make_node(self, *inputs):
        outputs = [TensorType("float64", shape=())() for _ in range(self.scalar_op.nout)]
        return Apply(self, list(inputs), outputs)

    def perform(self, node, inputs, output_storage):
        loop = Elemwise(self.scalar_op).make_node(*node.inputs)
        storage = [[None] for _ in loop.outputs]
        loop.op.perform(loop, inputs, storage)
        for out, (values,) in zip(output_storage, storage):
            out[0] = np.asarray(np.sum(values, dtype="float64"))


def _full_float_sum(client):
    node = client[0] if isinstance(client, tuple) else client
    if not isinstance(getattr(node, "op", None), Sum):
        return False
    op = node.op
    return (op.axis in (None, (0,)) and node.outputs[0].dtype == "float64"
            and getattr(op, "acc_dtype", None) in (None, "float64"))


def _summed(fgraph, node):
    """{output index: the sums reading it} where ``node`` is a loop whose outputs only
    full float64 sums read, else None."""
    if not isinstance(node.op, Elemwise) or node.op.inplace_pattern:
        return None
    if any(o.ndim != 1 or o.dtype != "float64" for o in node.outputs):
        return None
    if any(i.ndim != 1 for i in node.inputs) or all(i.type.broadcastable[0] for i in node.inputs):
        return None
    sums = {}
    for k, out in enumerate(node.outputs):
        clients = fgraph.clients.get(out, [])
        if not all(_full_float_sum(c) for c in clients):
            return None
        if clients:
            sums[k] = [c[0] for c in clients]
    return sums or None


class FuseRowSums(GraphRewriter):
    """Replaces each qualifying loop and its sums by one ``RowSums``."""

    def add_requirements(self, fgraph):
        from pytensor.graph.features import ReplaceValidate
        fgraph.attach_feature(ReplaceValidate())

    def apply(self, fgraph):
        if not _register_numba():   # here too: a process given the mode, not made it, compiles
            return
        fused = 0
        for node in list(fgraph.toposort()):
            if node not in fgraph.apply_nodes:
                continue
            sums = _summed(fgraph, node)
            if sums is None:
                continue
            totals = RowSums(node.op.scalar_op)(*node.inputs, return_list=True)
            pairs = [(s.outputs[0], totals[k]) for k, nodes in sums.items() for s in nodes]
            try:
                fgraph.replace_all_validate(pairs, reason="synkhronos_row_sums")
            except InconsistencyError:      # the graph refused it: the loop stays PyTensor's
                continue
            fused += 1
        if fused:
            logger.debug("rank graph: %d elementwise loop(s) summed over rows in one pass", fused)


def with_row_sums(mode):
    """``mode`` with ``FuseRowSums`` where it compiles with Numba and PyTensor does not fuse
    loops and sums itself; else ``mode`` unchanged."""
    if fuses_itself() or compat.linker_name(mode) != "numba":
        return mode
    if not _register_numba():
        return mode
    return mode.register((FuseRowSums(), POSITION))


_REGISTERED = []


def _register_numba():
    """Teaches PyTensor's Numba backend ``RowSums`` (once); False where this PyTensor's Numba
    backend lacks the hooks (then nothing is fused)."""
    if _REGISTERED:
        return _REGISTERED[0] is not None
    try:
        from pytensor.link.numba.cache import compile_numba_function_src
        from pytensor.link.numba.dispatch import basic as numba_basic
        from pytensor.link.numba.dispatch.basic import (numba_funcify_and_cache_key,
                                                        register_funcify_and_cache_key)
    except ImportError as exc:
        logger.debug("rank graph: loops and sums left to PyTensor (%s)", exc)
        _REGISTERED.append(None)
        return False

    @register_funcify_and_cache_key(RowSums)
    def _numba_row_sums(op, node, **kwargs):
        scalar_node = op.scalar_op.make_node(*[get_scalar_type(i.dtype)() for i in node.inputs])
        core, core_key = numba_funcify_and_cache_key(op.scalar_op, node=scalar_node, **kwargs)
        lazy = None
        if isinstance(op.scalar_op, Composite):
            lazy = _lazy_source(op.scalar_op.fgraph, lambda n: numba_funcify_and_cache_key(
                n.op, node=n, **kwargs)[0])
        if lazy is not None:
            core = numba_basic.numba_njit(compile_numba_function_src(lazy[0], "lazy_core",
                                                                     {"np": np, **lazy[1]}))
        src = _loop_source([i.type.broadcastable[0] for i in node.inputs], op.scalar_op.nout)
        fn = compile_numba_function_src(src, "row_sums", {"core": core, "np": np})
        key = None
        if core_key is not None:
            bc = tuple(i.type.broadcastable for i in node.inputs)
            key = hashlib.sha256(str(("synkhronos.RowSums", VERSION, core_key, bc,
                                      op.scalar_op.nout, lazy is not None)).encode()).hexdigest()
        return numba_basic.numba_njit(fn), key

    _REGISTERED.append(_numba_row_sums)
    return True


def _guards(order, outputs):
    """Each variable's guard: the switch conditions (``(cond, taken)`` pairs, all to hold)
    under which a value of ``outputs`` reads it; ``frozenset()`` where always, absent where
    never.  Where it is read under two guards, it is needed under what both share."""
    need = {o: frozenset() for o in outputs}

    def add(var, guard):
        need[var] = guard if var not in need else need[var] & guard

    for node in reversed(order):
        guards = [need[o] for o in node.outputs if o in need]
        if not guards:
            continue
        guard = frozenset.intersection(*guards)
        for k, inp in enumerate(node.inputs):
            if isinstance(node.op, Switch) and k > 0:
                add(inp, guard | {(node.inputs[0], k == 1)})
            else:
                add(inp, guard)
    return need


def _ordered(order, guard_of):
    """``order`` with each node after the nodes of its guard's conditions; None on a cycle.

    Among the nodes ready, the first in ``order`` whose guard is the one just emitted (one
    ``if`` for a run of them), else the first."""
    position = {n: k for k, n in enumerate(order)}
    deps = {n: {i.owner for i in n.inputs if i.owner in position}
            | {c.owner for c, _ in guard_of[n] if c.owner in position} for n in order}
    users = {n: [] for n in order}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    waiting = {n: len(ds) for n, ds in deps.items()}
    ready = sorted((n for n in order if not waiting[n]), key=position.get)
    out = []
    while ready:
        last = guard_of[out[-1]] if out else frozenset()
        k = next((j for j, r in enumerate(ready) if guard_of[r] == last), 0)
        n = ready.pop(k)
        out.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if not waiting[u]:
                ready.append(u)
        ready.sort(key=position.get)
    return out if len(out) == len(order) else None


def _lazy_source(fgraph, funcify):
    """The Python source and globals of ``fgraph`` (a Composite's scalar graph) as a function
    that computes each value a switch reads in one branch only where that branch is taken,
    or None where no such value runs an op worth a branch (``branches.COSTLY``)."""
    order = fgraph.toposort()
    need = _guards(order, fgraph.outputs)
    guard_of = {n: frozenset.intersection(*[need.get(o, frozenset()) for o in n.outputs])
                for n in order}
    if not any(g and isinstance(n.op, branches.COSTLY) for n, g in guard_of.items()):
        return None
    order = _ordered(order, guard_of)
    if order is None:
        return None
    env, names = {}, {}

    def name(v):
        if v not in names:
            names[v] = f"v{len(names)}"
            if isinstance(v, Constant):
                env[names[v]] = v.data
        return names[v]

    args = [name(i) for i in fgraph.inputs]
    lines, current = [f"def lazy_core({', '.join(args)}):"], frozenset()
    for node in order:     # a value computed under a guard is zero elsewhere (never read there)
        for o in node.outputs:
            if guard_of[node]:
                env[f"t_{name(o)}"] = np.dtype(o.dtype).type
                lines.append(f"    {name(o)} = t_{name(o)}(0)")
    for node in order:
        guard = guard_of[node]
        if guard != current and guard:
            test = " and ".join(f"{name(c)}" if taken else f"not {name(c)}"
                                for c, taken in sorted(guard, key=lambda p: name(p[0])))
            lines.append(f"    if {test}:")
        current = guard
        fn = f"f{len(env)}"
        env[fn] = funcify(node)
        pad = "        " if guard else "    "
        lines.append(f"{pad}{', '.join(name(o) for o in node.outputs)} = "
                     f"{fn}({', '.join(name(i) for i in node.inputs)})")
    outs = [name(o) for o in fgraph.outputs]
    lines.append(f"    return {outs[0] if len(outs) == 1 else ', '.join(outs)}")
    return "\n".join(lines) + "\n", env


def _loop_source(broadcast, nout):
    """The Python source of the one loop: inputs of one element read once, the others row by
    row; each output's row values added into a scalar."""
    args = [f"i{k}" for k in range(len(broadcast))]
    rows = [a for a, b in zip(args, broadcast) if not b]
    reads = [f"{a}[0]" if b else f"{a}[j]" for a, b in zip(args, broadcast)]
    lines = [f"def row_sums({', '.join(args)}):",
             f"    n = {rows[0]}.shape[0]"]
    lines += [f"    if {a}.shape[0] != n:\n"
              f"        raise ValueError('RowSums: inputs of unequal lengths')" for a in rows[1:]]
    lines += [f"    s{k} = 0.0" for k in range(nout)]
    lines += ["    for j in range(n):",
              f"        {', '.join(f't{k}' for k in range(nout))} = core({', '.join(reads)})"]
    lines += [f"        s{k} += t{k}" for k in range(nout)]
    lines += [f"    return {', '.join(f'np.asarray(s{k})' for k in range(nout))}"]
    return "\n".join(lines) + "\n"
