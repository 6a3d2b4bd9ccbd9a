"""Run under ``mpiexec -n M python leaders_reset_job.py L``: collectives between machines after aborted ones.

A rank fails inside an in-graph psum while the other machines' leaders are
already inside MPI's all-reduce (which no one can cancel), on the last machine,
then on the controller's; after each, every collective between machines must
still give NumPy's result on every rank, and the controller must have moved
the leaders to a fresh communicator.  Prints ``OK <name>`` per check and
``ALL OK`` at the end.
"""

import os
import sys

import numpy as np
import pytensor
import pytensor.tensor as T

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helpers"))

import synkhronos as synk  # noqa: E402
from procs import FailInRank  # noqa: E402
from synkhronos import ingraph  # noqa: E402
from synkhronos.runtime.state import get_runtime  # noqa: E402

L = int(sys.argv[1])
n = synk.fork(L)
rt = get_runtime()
print("PIDS", " ".join(str(p) for p in rt.peers.pids), rt.config.prefix, flush=True)
F = pytensor.config.floatX
pytensor.config.compiler_verbose = False
x = T.matrix("x")
# 2.4 MB: a large message, several rounds of MPI's algorithm, left half done.
big = T.alloc(T.sum(x), 300000)
fails = {r: synk.function([x], T.sum(ingraph.psum(FailInRank(r)(big)))) for r in (n - 1, 0)}
good = synk.function([x], T.sum(ingraph.psum(big)))
W = pytensor.shared(np.zeros((2, 3), dtype=F), name="W")
B = pytensor.shared(np.zeros(70000, dtype=F), name="B")   # packed and unpacked messages
synk.function([], [W.sum(), B.sum()])
synk.distribute()
X = np.ones((10, 3), dtype=F)
d = synk.data(X)
rng = np.random.default_rng(1)


def close(a, b, rtol=1e-5, atol=1e-6):
    assert np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                       rtol=rtol, atol=atol), (a, b)


def check_all(tag):
    per_rank = [rng.normal(size=(2, 3)).astype(F) + 1 for _ in range(n)]
    for op, fn in (("avg", np.mean), ("sum", np.sum), ("max", np.max), ("min", np.min)):
        for r in range(n):
            synk.set_value(r, W, per_rank[r])
        synk.all_reduce(W, op=op)
        exp = fn(np.stack(per_rank).astype(np.float64), axis=0)
        got = [synk.get_value(r, W) for r in range(n)]
        for g in got:
            close(g, exp, rtol=1e-4)
            assert np.array_equal(g, got[0]), "ranks disagree on a bit"
    per_big = [rng.normal(size=70000).astype(F) for _ in range(n)]
    for r in range(n):
        synk.set_value(r, B, per_big[r])
    synk.all_reduce(B, op="sum")
    close(synk.get_value(n - 1, B), np.sum(per_big, axis=0), atol=1e-4)
    W.set_value(per_rank[0])
    synk.broadcast(W)
    for r in range(n):
        close(synk.get_value(r, W), per_rank[0])
    for r in range(n):
        synk.set_value(r, W, per_rank[r])
    close(synk.gather(W, nd_up=1), np.stack(per_rank))
    synk.all_gather(W)
    close(synk.get_value(n - 1, W), np.concatenate(per_rank))
    synk.scatter(W, np.concatenate(per_rank))
    for r in range(n):
        close(synk.get_value(r, W), per_rank[r])
    close(good(d), 30.0 * 300000, rtol=1e-6)  # psum: the whole sum on every rank
    print("OK", tag, flush=True)


check_all("before")
for round_ in range(2):
    for r, f in fails.items():
        gen = rt.peers.gen
        try:
            f(d)
            raise AssertionError("the planted failure did not raise")
        except ValueError as exc:
            assert exc.rank == r, exc
        assert rt.peers.gen == gen + 1, (rt.peers.gen, gen)
        check_all(f"after a failure in rank {r} ({round_})")
synk.close()
print("ALL OK", flush=True)
