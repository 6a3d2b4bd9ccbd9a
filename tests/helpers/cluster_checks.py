"""Run under ``mpiexec -n M python cluster_checks.py L``: the cluster contract, checked against NumPy.

The controller prints ``OK <name>`` per check and ``ALL OK`` at the end;
tests/cluster/test_cluster.py runs it with several machine counts and local ranks.
"""

import sys
import time

import numpy as np
import pytensor
import pytensor.tensor as T

import synkhronos as synk
from synkhronos import ingraph
from synkhronos.runtime.state import get_runtime

L = int(sys.argv[1])
n = synk.fork(L)
lay = synk.layout()
print("PIDS", " ".join(str(p) for p in get_runtime().peers.pids), get_runtime().config.prefix,
      flush=True)
F = pytensor.config.floatX
rng = np.random.default_rng(0)


def ok(name):
    print("OK", name, flush=True)


def close(a, b, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                               rtol=rtol, atol=1e-6)


def rank_ranges(n_rows):
    base, extra = divmod(n_rows, n)
    out, lo = [], 0
    for r in range(n):
        hi = lo + base + (1 if r < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


assert n == L * lay.n_machines, (n, lay)
assert lay.n_local == [L] * lay.n_machines
assert list(lay.ranks(1)) == list(range(L, 2 * L))
ok("layout")

# -- functions -------------------------------------------------------------------------------
x = T.matrix("x")
w = pytensor.shared(rng.normal(size=(3, 2)).astype(F), name="w")
outs = [(T.mean(T.dot(x, w)), "avg"), (T.sum(x), "sum"), (T.max(x), "max"), (T.min(x), "min"),
        (T.prod(x[:, 0]), "prod"), (T.sum(x, axis=1), "gather")]
f = synk.function([x], outs)
f_none = synk.function([x], [(T.sum(x), None)])
S = pytensor.shared(np.zeros((1, 3), dtype=F), name="S")
fs = synk.function([], [(T.sum(S), "sum"), (T.sum(S, axis=1), "gather")], sliceable_shareds=[S])
lr = np.asarray(0.1, dtype=F)
v = pytensor.shared(np.zeros(3, dtype=F), name="v")
step = synk.function([x], T.sum(x), updates=[(v, v + lr * T.sum(x, axis=0))])
W = pytensor.shared(np.zeros((2, 3), dtype=F), name="W")
fw = synk.function([x], T.sum(T.dot(x[:, :2], W)))
fin = synk.function([x], [(ingraph.psum(T.sum(x, axis=0)), "avg"),
                          (T.sum(ingraph.all_gather(T.sum(x, axis=1))), "avg")])
# Outputs large enough (>= 64 KiB a rank) that each machine combines its ranks' before they travel.
xb = T.matrix("xb", dtype="float64")
fbig = synk.function([xb], [(T.sum(xb, axis=0), "sum"), (T.mean(xb, axis=0), "avg"),
                            (T.max(xb, axis=0), "max"), (2 * xb, "gather"),
                            (T.sum(xb, axis=0), None), (T.mean(xb), "avg")])
synk.distribute()

X = (1 + 0.01 * rng.normal(size=(23, 3))).astype(F)
d = synk.data(X)
Wd = X @ w.get_value()


def expect(rows):
    sel = X[rows]
    return [np.mean(sel @ w.get_value()), sel.sum(), sel.max(), sel.min(),
            np.prod(sel[:, 0].astype(np.float64)), sel.sum(axis=1)]


def check_f(got, rows, name, data=None):
    exp = expect(rows)
    for g, e in zip(got, exp):
        close(g, e, rtol=1e-4)
    if data is None:
        ok(name)
        return
    per_rank = f_none(data)[0]
    assert len(per_rank) == n, name
    ranges = rank_ranges(len(rows))
    for r, (lo, hi) in enumerate(ranges):
        close(per_rank[r], X[rows[lo:hi]].sum(), rtol=1e-4)
    ok(name)


check_f(f(d), np.arange(23), "call whole", d)
sel = rng.permutation(23)[:17]
check_f(f(d, batch=sel), sel, "call batch")
check_f(f(d, batch=sel, num_slices=2), sel, "call batch num_slices")
check_f(f(X[:11]), np.arange(11), "call numpy input")

XB = rng.normal(size=(4 * n + 3, 9000))
db = synk.data(XB)
for rows, batch in ((np.arange(len(XB)), None), (rng.permutation(len(XB))[:3 * n + 1], "list")):
    got = fbig(db, batch=None if batch is None else rows)
    picked = XB[rows]
    ranges = rank_ranges(len(rows))
    close(got[0], picked.sum(axis=0), rtol=1e-12)
    close(got[1], picked.mean(axis=0), rtol=1e-12)
    np.testing.assert_array_equal(got[2], picked.max(axis=0))
    np.testing.assert_array_equal(got[3], 2 * picked)
    assert len(got[4]) == n
    for r, (lo, hi) in enumerate(ranges):
        close(got[4][r], picked[lo:hi].sum(axis=0), rtol=1e-12)
    close(got[5], picked.mean(), rtol=1e-12)
ok("large outputs combined machine by machine")

# -- Data mirroring ---------------------------------------------------------------------------
X[3] = 5.0
d[3] = 5.0
check_f(f(d), np.arange(23), "mirror setitem row", d)
X[5:9] = 0.5
d[5:9] = 0.5
check_f(f(d), np.arange(23), "mirror setitem slice")
X[:, 1] = 2.0
d[:, 1] = 2.0
check_f(f(d), np.arange(23), "mirror setitem column")
X = (1 + 0.01 * rng.normal(size=(40, 3))).astype(F)
d.set_value(X)
check_f(f(d), np.arange(40), "mirror set_value grow")
d.set_length(30)
X = X[:30]
check_f(f(d), np.arange(30), "mirror set_length", d)
for how in ("data", "view"):
    try:
        if how == "data":
            d.data[0, 0] = 1.0
        else:
            row = d[0]
            row[:] = 1.0
    except ValueError:
        ok(f"raw write refused ({how})")
    else:
        raise AssertionError(f"a raw write ({how}) to a Data object went through in a cluster")
d.free_memory()
d.set_value(X)
check_f(f(d, batch=sel), sel, "mirror after free_memory")

# -- batch_s with data scattered into the ranks --------------------------------------------
Y = rng.normal(size=(26, 3)).astype(F)
synk.scatter(S, Y)
ranges = rank_ranges(26)
lengths = synk.get_lengths(S)
assert [int(v) for v in lengths] == [hi - lo for lo, hi in ranges], lengths
shapes = synk.get_shapes(S)
assert [tuple(s) for s in shapes] == [(hi - lo, 3) for lo, hi in ranges], shapes
got = fs()
close(got[0], Y.sum(), rtol=1e-4)
close(got[1], Y.sum(axis=1), rtol=1e-4)
ok("scatter, get_lengths, get_shapes, sliceable whole")
got = fs(batch_s=[0, 1])
rows = [lo + k for lo, _ in ranges for k in (0, 1)]
close(got[0], Y[rows].sum(), rtol=1e-4)
close(got[1], Y[rows].sum(axis=1), rtol=1e-4)
got = fs(batch_s=[0, 1], num_slices=2)
close(got[0], Y[rows].sum(), rtol=1e-4)
ok("batch_s and num_slices")
mine = synk.get_value(n - 1, S)
lo, hi = ranges[n - 1]
close(mine, Y[lo:hi])
ok("get_value of a remote rank")

# -- collectives on a shared variable -----------------------------------------------------------
per_rank = [rng.normal(size=(2, 3)).astype(F) + 1 for _ in range(n)]
for op, fn in (("avg", np.mean), ("sum", np.sum), ("prod", np.prod), ("max", np.max),
               ("min", np.min)):
    for r in range(n):
        synk.set_value(r, W, per_rank[r])
    synk.all_reduce(W, op=op)
    exp = fn(np.stack(per_rank).astype(np.float64), axis=0)
    for r in range(n):
        close(synk.get_value(r, W), exp, rtol=1e-4)
    for r in range(n):
        synk.set_value(r, W, per_rank[r])
    synk.reduce(W, op=op)
    close(W.get_value(), exp, rtol=1e-4)
    ok(f"all_reduce and reduce {op}")
for r in range(n):
    synk.set_value(r, W, per_rank[r])
g = synk.gather(W, nd_up=1)
close(g, np.stack(per_rank))
g = synk.gather(W, nd_up=0)
close(g, np.concatenate(per_rank))
ok("gather")
synk.all_gather(W)
close(synk.get_value(n - 1, W), np.concatenate(per_rank))
ok("all_gather")
W.set_value(per_rank[0])
synk.broadcast(W)
for r in range(n):
    close(synk.get_value(r, W), per_rank[0])
synk.broadcast(W, per_rank[1])
for r in range(n):
    close(synk.get_value(r, W), per_rank[1])
ok("broadcast")
synk.scatter(W, np.concatenate(per_rank))
for r in range(n):
    close(synk.get_value(r, W), per_rank[r])
ok("scatter")

# -- updates in every rank, then one all_reduce: a training step ---------------------------------
v.set_value(np.zeros(3, dtype=F))
synk.broadcast(v)
step(d)
synk.all_reduce(v, op="sum")
ranges = rank_ranges(len(X))
exp = sum(0.1 * X[lo:hi].sum(axis=0) for lo, hi in ranges)
for r in range(n):
    close(synk.get_value(r, v), exp, rtol=1e-4)
ok("updates and all_reduce")

# -- in-graph collectives span the machines ------------------------------------------------------
got = fin(d)
close(got[0], X.sum(axis=0), rtol=1e-4)
close(got[1], X.sum(), rtol=1e-4)
ok("in-graph psum and all_gather")

# -- bad input: a clear error in the controller, and the run goes on ------------------------------
try:
    f(d, batch=[0, 1000])
except ValueError:
    pass
else:
    raise AssertionError("an out-of-range batch index went through")
try:
    synk.all_reduce(W, op="mean")
except ValueError as exc:
    assert "op" in str(exc) and "mean" in str(exc), exc
else:
    raise AssertionError("all_reduce(op='mean') went through")
check_f(f(d), np.arange(len(X)), "bad input, then a good call")

synk.close()
print("ALL OK", flush=True)
# The script goes on after close() while the node masters exit: mpiexec must
# take their exit for a normal end and leave this process running.
time.sleep(1.5)
print("AFTER CLOSE OK", flush=True)
