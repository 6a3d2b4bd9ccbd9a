"""Run under ``mpiexec -n M python small_reduce_job.py``: small all-reduces on machines of one rank.

They take the latency path (comm/mpi_small.py), whose ballot spares every node
master's report.  Checked on every rank after each step: ops, dtypes and a
step counter in a loop; a node master whose share fails before the collective
(the controller, inside it, gets the error; the next ones are exact); a node
master on the general path while the others take the latency path (the
ballot fails, its report comes); an all_reduce after an idle pause (the node
masters' doorbells).  A node master's path is steered by a planted value in
its own copy of the variable.  Prints ``OK <name>`` per check and ``ALL OK``.
"""

import os
import sys
import time

import numpy as np
import pytensor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helpers"))

import synkhronos as synk  # noqa: E402
from synkhronos.comm.mpi_backend import MpiBackend  # noqa: E402
from synkhronos.runtime.state import get_runtime  # noqa: E402

FAIL, GENERAL = 99.0, 77.0
small_all_reduce = MpiBackend.small_all_reduce


def steered(self, keys, arrays, op):
    """In a node master: raise, or take the general path, where S's planted value says."""
    a = arrays[0]
    if self.link.node != 0 and a.dtype == np.float32 and a.shape == (3,):
        if a[0] == FAIL:
            raise ValueError("planted failure before the collective")
        if a[0] == GENERAL:
            return False
    return small_all_reduce(self, keys, arrays, op)


MpiBackend.small_all_reduce = steered

n = synk.fork(1)
rt = get_runtime()
print("PIDS", " ".join(str(p) for p in rt.peers.pids), rt.config.prefix, flush=True)
S = pytensor.shared(np.zeros(3, np.float32), name="S")
D = pytensor.shared(np.zeros((2, 2), np.float64), name="D")
N = pytensor.shared(np.zeros(4, np.int32), name="N")
step = pytensor.shared(np.zeros((), np.int64), name="step")
synk.function([], [S.sum(), D.sum(), N.sum(), step])
synk.distribute()
rng = np.random.default_rng(0)


def everywhere(var, values, op):
    for r in range(n):
        synk.set_value(r, var, values[r])
    synk.all_reduce(var, op=op)
    exp = {"sum": np.sum, "avg": np.mean, "prod": np.prod, "max": np.max, "min": np.min}[op](
        np.stack(values).astype(np.float64), axis=0)
    for r in range(n):
        got = synk.get_value(r, var)
        assert got.dtype == var.dtype and np.allclose(got, exp, rtol=1e-6), (op, r, got, exp)


for op in ("sum", "avg", "prod"):
    for var in (S, D):
        everywhere(var, [rng.normal(size=var.get_value().shape).astype(var.dtype)
                         for _ in range(n)], op)
for op in ("sum", "max", "min", "prod"):
    everywhere(N, [rng.integers(-5, 5, size=4).astype(np.int32) for _ in range(n)], op)
print("OK ops and dtypes", flush=True)

for r in range(n):
    synk.set_value(r, step, np.int64(0))
for k in range(1, 201):
    step.set_value(np.int64(k))  # the controller's copy: the others stay at 0
    synk.all_reduce(step, op="max")
    assert int(step.get_value()) == k
assert all(int(synk.get_value(r, step)) == 200 for r in range(n))
print("OK a loop", flush=True)

values = [np.full(3, 1.0 + r, np.float32) for r in range(n)]
values[-1][0] = FAIL
for r in range(n):
    synk.set_value(r, S, values[r])
try:
    synk.all_reduce(S, op="sum")
    raise AssertionError("the planted failure did not reach the controller")
except ValueError as exc:
    assert "planted failure" in str(exc) and exc.rank == n - 1, exc
values[-1][0] = 5.0
everywhere(S, values, "sum")
everywhere(S, values, "avg")
print("OK after a failure", flush=True)

values[-1][0] = GENERAL
for _ in range(3):
    everywhere(S, values, "sum")
    values = [np.full(3, 1.0 + r, np.float32) for r in range(n)]
    values[-1][0] = GENERAL
everywhere(S, [np.full(3, 2.0, np.float32)] * n, "sum")
print("OK the general path beside the latency path", flush=True)

time.sleep(0.2)  # every node master blocks on its doorbell
t0 = time.perf_counter()
everywhere(S, values, "avg")
print(f"OK after a pause ({time.perf_counter() - t0:.4f} s)", flush=True)

synk.close()
print("ALL OK", flush=True)
