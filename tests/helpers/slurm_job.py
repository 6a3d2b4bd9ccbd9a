"""Run in a Slurm job under any launch route: ``python slurm_job.py L``; the controller checks and prints.

Forks L ranks per MPI process, then prints ``PIDS``, ``LAYOUT n_machines
n_local... hosts...``, ``CORES`` (each rank's cores, as a bit mask, machine by
machine), and ``OK`` per check against NumPy: a call over a Data (sum and
per-rank row counts), an all_reduce of per-rank values; ``ALL OK`` at the end.
tests/cluster/test_slurm.py reads it.
"""

import os
import sys
import warnings

import numpy as np
import pytensor
import pytensor.tensor as T
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
from synkhronos.runtime.state import get_runtime


class Cores(Op):
    """The cores this rank may run on, as a bit mask (an int64 scalar); its input is unused."""

    __props__ = ()

    def make_node(self, x):
        return Apply(self, [T.as_tensor_variable(x)], [T.lscalar()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = np.asarray(sum(1 << c for c in os.sched_getaffinity(0)), dtype=np.int64)


# Cores runs in Python (object mode under Numba): no news.
warnings.filterwarnings("ignore", message="Numba will use object mode")
L = int(sys.argv[1])
n = synk.fork(L)
lay = synk.layout()
rt = get_runtime()
print("PIDS", " ".join(str(p) for p in rt.peers.pids), rt.config.prefix, flush=True)
print("LAYOUT", lay.n_machines, *lay.n_local, *lay.hosts, flush=True)
assert n == lay.n_parallel == sum(lay.n_local), (n, lay)

F = pytensor.config.floatX
x = T.matrix("x")
W = pytensor.shared(np.zeros(3, dtype=F), name="W")
f = synk.function([x], [(T.sum(x), "sum"), (T.shape(x)[0], None), (Cores()(x), None),
                        (T.sum(W), "sum")])
synk.distribute()

X = np.random.default_rng(0).normal(size=(23, 3)).astype(F)
d = synk.data(X)
total, rows, cores, _ = f(d)
np.testing.assert_allclose(total, X.sum(), rtol=1e-5)
base, extra = divmod(len(X), n)
assert [int(r) for r in rows] == [base + (r < extra) for r in range(n)], rows
print("OK call", flush=True)
print("CORES", " ".join(",".join(str(int(cores[r])) for r in lay.ranks(m))
                        for m in range(lay.n_machines)), flush=True)

per_rank = [np.full(3, r + 1, dtype=F) for r in range(n)]
for r in range(n):
    synk.set_value(r, W, per_rank[r])
synk.all_reduce(W, op="sum")
for r in range(n):
    np.testing.assert_allclose(synk.get_value(r, W), np.sum(per_rank, axis=0))
print("OK all_reduce", flush=True)
synk.close()
print("ALL OK", flush=True)
