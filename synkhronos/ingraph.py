"""In-graph collectives: psum, pmean, pmax, pmin and all_gather as PyTensor Ops.

These Ops go inside the graph of a ``synk.function`` (like ``jax.lax.psum``
inside ``pmap``).  During a call every rank runs the same compiled graph, so
every rank reaches the same Ops in the same order; each Op blocks until every
rank has reached it and then returns the combined value, through the run's
host backend (shared memory on one machine).  Every rank runs a graph holding
these Ops, also a rank that got no rows of the selection (it joins with its
empty share and adds nothing to the call's output reductions), so no rank
waits for one that never comes.

Outside a synkhronos call (serial PyTensor, ``Function.as_theano``, before
``fork()``) every Op is the identity: the collective over one rank.  So one
graph serves the data-parallel step and its serial twin.

Gradients are defined (``grad(psum(x)) = psum(grad)``), so a whole training
step, statistics shared between ranks included, can be one graph.

Cost: in CPU mode the default (Numba) backend runs each Op's ``perform`` in
object mode, one Python call and one backend collective per Op and call; in
JAX mode each Op is an ordered ``jax.experimental.io_callback`` that copies
its operand to the host and back (see docs/ingraph.md).  In JAX mode the
length of ``all_gather``'s result is fixed when JAX traces the graph, so
every rank must hold the same number of rows there.
"""

import importlib.util
import logging
import warnings

import numpy as np
import pytensor.tensor as pt
from pytensor.gradient import grad_undefined
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

from . import compat
from .runtime.state import get_runtime

logger = logging.getLogger(__name__)

__all__ = ["psum", "pmean", "pmax", "pmin", "all_gather", "AllReduceOp", "AllGatherOp",
           "n_ranks", "in_call"]

# Object mode is how these Ops run under Numba, by design (one backend call
# each); the warning PyTensor gives at every compile says nothing new here.
warnings.filterwarnings("ignore", message="Numba will use object mode to run "
                        r"(AllReduceOp|AllGatherOp|_GatherGradOp)", category=UserWarning)

_REDUCE_KINDS = {"sum": "sum", "mean": "avg", "max": "max", "min": "min"}


def in_call():
    """Return the Runtime when this process runs a synkhronos call, else None.

    Runs in any process; in-graph collectives act as the identity where this is None.
    """
    rt = get_runtime()
    if rt is None or rt.closed or not rt.in_call:
        return None
    return rt


def n_ranks():
    """Return how many ranks an in-graph collective combines here: n_parallel in a call, else 1."""
    rt = in_call()
    return 1 if rt is None else rt.place.n_parallel


def _all_reduce(x, kind):
    """Combine ``x`` over the ranks of the running call (identity outside one)."""
    rt = in_call()
    x = np.asarray(x)
    if rt is None or rt.place.n_parallel == 1:
        return np.array(x)
    out = rt.backend.host.all_reduce([x], _REDUCE_KINDS[kind])[0]
    return np.asarray(out, dtype=x.dtype)


def _all_gather(x, equal_rows=False):
    """Concatenate every rank's ``x`` along axis 0, in rank order (identity outside a call).

    ``equal_rows``: refuse ranks holding different numbers of rows (JAX mode).
    """
    rt = in_call()
    x = np.asarray(x)
    if rt is None or rt.place.n_parallel == 1:
        return np.array(x)
    got = rt.backend.host.all_gather([np.ascontiguousarray(x)])
    lengths = [len(g[0]) for g in got]
    if equal_rows and len(set(lengths)) > 1:
        # Every rank sees the same lengths and raises alike: none waits for another.
        raise ValueError("all_gather: in JAX mode every rank must hold the same number of rows "
                         f"(JAX fixes the result's length when tracing); got {lengths}")
    # Views into communication buffers: concatenate copies them out.
    return np.concatenate([g[0] for g in got], axis=0).astype(x.dtype, copy=False)


def _all_gather_traced(x, n_traced):
    """``_all_gather`` where JAX fixed the result's length when tracing for ``n_traced`` ranks."""
    if n_ranks() != n_traced:
        raise RuntimeError(f"all_gather: this JAX-mode function was traced for {n_traced} "
                           f"rank(s) and now runs on {n_ranks()}; in JAX mode compile the "
                           "serial twin separately from the synkhronos function")
    return _all_gather(x, equal_rows=True)


def _gather_grad(n_rows, dtype, g):
    """This rank's ``n_rows`` rows of ``psum(g)``: the gradient of all_gather."""
    rt = in_call()
    g = np.asarray(g)
    if rt is None or rt.place.n_parallel == 1:
        return np.array(g, dtype=dtype)
    host = rt.backend.host
    total = np.asarray(host.all_reduce([g], "sum")[0], dtype=dtype)
    lengths = [int(v[0][0]) for v in host.all_gather([np.array([n_rows], dtype=np.int64)])]
    lo = sum(lengths[:rt.place.rank])
    return np.array(total[lo:lo + n_rows])


class _CollectiveOp(Op):
    """What every in-graph collective shares: never folded, marked for execution."""

    # functions/build.py reads this mark: a graph holding such an Op runs on every
    # rank, also one with no rows, so that every rank reaches the Op.
    synk_collective = True

    def do_constant_folding(self, fgraph, node):
        # Folding would run the collective once, at compile time, in one process.
        return False

    def __setstate__(self, state):
        # Unpickled in a worker (distribute()) that forked before the graph was
        # built: teach its JAX backend the Op before the function compiles.
        self.__dict__.update(state)
        _register_jax()


class AllReduceOp(_CollectiveOp):
    """Combine a tensor elementwise over the ranks: kind "sum", "mean", "max" or "min"."""

    __props__ = ("kind",)

    def __init__(self, kind):
        if kind not in _REDUCE_KINDS:
            raise ValueError(f"AllReduceOp: kind must be sum, mean, max or min; got {kind!r}")
        self.kind = kind
        super().__init__()

    def make_node(self, x):
        _register_jax()
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = _all_reduce(inputs[0], self.kind)

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        return [shapes[0]]

    def pullback(self, inputs, outputs, output_grads):
        (x,), (out,), (g,) = inputs, outputs, output_grads
        if self.kind == "sum":
            return [psum(g)]
        if self.kind == "mean":
            return [pmean(g)]
        # The summed upstream gradient flows to the elements holding the extreme.
        return [pt.cast(psum(g) * pt.eq(x, out), x.dtype)]


class AllGatherOp(_CollectiveOp):
    """Concatenate every rank's tensor along axis 0, in rank order."""

    __props__ = ()

    def make_node(self, x):
        _register_jax()
        x = pt.as_tensor_variable(x)
        if x.ndim == 0:
            raise ValueError("all_gather: needs a tensor with at least one axis (rows)")
        out = pt.tensor(dtype=x.dtype, shape=(None,) + x.type.shape[1:])
        return Apply(self, [x], [out])

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = _all_gather(inputs[0])

    def pullback(self, inputs, outputs, output_grads):
        (x,), (g,) = inputs, output_grads
        return [_GatherGradOp()(x, g)]


class _GatherGradOp(_CollectiveOp):
    """This rank's rows of the upstream gradient summed over the ranks."""

    __props__ = ()

    def make_node(self, x, g):
        _register_jax()
        x = pt.as_tensor_variable(x)
        g = pt.as_tensor_variable(g)
        return Apply(self, [x, g], [x.type()])

    def perform(self, node, inputs, output_storage):
        x, g = inputs
        output_storage[0][0] = _gather_grad(len(x), x.dtype, g)

    @compat.infer_shape

    def infer_shape(self, node, shapes):
        return [shapes[0]]

    def pullback(self, inputs, outputs, output_grads):
        return [grad_undefined(self, 0, inputs[0]), grad_undefined(self, 1, inputs[1])]


def psum(x):
    """Return the elementwise sum of ``x`` over every rank of the call (symbolic).

    Every rank gets the same result.  Outside a synkhronos call it returns ``x``.
    """
    return AllReduceOp("sum")(x)


def pmean(x):
    """Return the elementwise mean of ``x`` over the ranks, each rank weighing the same.

    For a mean over rows when ranks hold different numbers of rows, divide
    ``psum`` of the row sums by ``psum`` of the row counts instead.
    """
    return AllReduceOp("mean")(x)


def pmax(x):
    """Return the elementwise maximum of ``x`` over every rank of the call (symbolic)."""
    return AllReduceOp("max")(x)


def pmin(x):
    """Return the elementwise minimum of ``x`` over every rank of the call (symbolic)."""
    return AllReduceOp("min")(x)


def all_gather(x):
    """Return every rank's ``x`` concatenated along axis 0, in rank order (symbolic).

    Ranks may hold different numbers of rows, except in JAX mode: JAX fixes
    the result's length (n_parallel times this rank's rows) when it traces
    the graph, and a call whose ranks hold different numbers raises
    ValueError on every rank.  The gradient sends each rank its own rows of
    the upstream gradient summed over the ranks.
    """
    return AllGatherOp()(x)


_jax = {"registered": False}


def _register_jax():
    """Teach PyTensor's JAX backend the collective Ops, once, if JAX is installed.

    Importing JAX does not start its backend, so fork() stays possible.
    """
    if _jax["registered"]:
        return
    _jax["registered"] = True
    if importlib.util.find_spec("jax") is None:
        return
    from pytensor.link.jax.dispatch import jax_funcify

    @jax_funcify.register(AllReduceOp)
    def _jax_all_reduce(op, node=None, **kwargs):
        import jax
        from jax.experimental import io_callback

        kind = op.kind

        def host(a):
            return _all_reduce(np.asarray(a), kind)

        def all_reduce(x):
            # Ordered: every rank must reach its collectives in graph order, and
            # an unordered callback may be dropped or repeated by XLA.
            return io_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=True)

        return all_reduce

    @jax_funcify.register(AllGatherOp)
    def _jax_all_gather(op, node=None, **kwargs):
        import jax
        from jax.experimental import io_callback

        def all_gather(x):
            # Runs when JAX traces, inside the call that first meets these shapes.
            n = n_ranks()
            out = jax.ShapeDtypeStruct((n * x.shape[0],) + tuple(x.shape[1:]), x.dtype)
            return io_callback(lambda a: _all_gather_traced(a, n), out, x, ordered=True)

        return all_gather

    @jax_funcify.register(_GatherGradOp)
    def _jax_gather_grad(op, node=None, **kwargs):
        import jax
        from jax.experimental import io_callback

        def gather_grad(x, g):
            n_rows, dtype = x.shape[0], np.dtype(x.dtype)
            out = jax.ShapeDtypeStruct(x.shape, x.dtype)
            return io_callback(lambda b: _gather_grad(n_rows, dtype, b), out, g, ordered=True)

        return gather_grad
