"""Data produced where it is used, checked against NumPy: ``mpiexec -n M python cluster_placed.py L``.

Also runs without mpiexec (one machine), where a produced Data is an ordinary
one and every check holds the same.  The controller prints ``OK <name>`` per
check and ``ALL OK`` at the end; tests/cluster/test_cluster_data.py runs it.
"""

import gc
import os
import sys
import tempfile

import numpy as np
import pytensor
import pytensor.tensor as T

import synkhronos as synk
from synkhronos.variables import checkpoint
from synkhronos.extensions.train import make_train_function
from synkhronos.runtime.state import get_runtime

L = int(sys.argv[1])
n = synk.fork(L)
lay = synk.layout()
M = lay.n_machines
rt = get_runtime()
if rt.peers.layout is not None:
    print("PIDS", " ".join(str(p) for p in rt.peers.pids), rt.config.prefix, flush=True)
F = pytensor.config.floatX
rng = np.random.default_rng(0)
N = 37  # no machine count here divides it


def ok(name):
    print("OK", name, flush=True)


def close(a, b, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                               rtol=rtol, atol=1e-6)


def whole_x(lo, hi):
    """Rows lo:hi of the whole input: a formula, so every machine makes its own."""
    i = np.arange(lo, hi, dtype=np.float64)[:, None]
    return (1 + 0.01 * np.sin(i * np.array([1.0, 2.0, 3.0]))).astype(F)


def whole_y(lo, hi):
    return np.cos(np.arange(lo, hi, dtype=np.float64)).astype(F)


asked = []


def make_x(part):
    asked.append(part)  # only the controller's own calls land in this list
    return whole_x(part.lo, part.hi)


x = T.matrix("x")
y = T.vector("y")
w = pytensor.shared(rng.normal(size=(3,)).astype(F), name="w")
outs = [(T.mean(T.dot(x, w)), "avg"), (T.sum(x), "sum"), (T.max(x), "max"), (T.min(x), "min"),
        (T.sum(x, axis=1), "gather")]
f = synk.function([x], outs)
f2 = synk.function([x, y], [(T.sum(T.dot(x, w) * y), "sum"), (T.mean(y), "avg")])
lr = np.asarray(0.05, dtype=F)
err = T.dot(x, w) - y
loss = T.mean(err ** 2)
# The training helper: each rank's gradient weighed by its rows, so uneven splits are exact.
step = make_train_function(loss, [w], x, y, update_rule="sgd",
                           update_kwargs={"learning_rate": float(lr)})
synk.distribute()
w0 = w.get_value().copy()

X = whole_x(0, N)
Y = whole_y(0, N)
d = synk.data(produce=make_x, length=N, var=x, name="x")
dy = synk.data(produce=lambda p: whole_y(p.lo, p.hi), length=N, var=y)
assert len(d) == N and d.shape == (N, 3), d.shape
if M > 1:
    # The controller made machine 0's rows only, and holds only those.
    parts = d.parts
    assert len(asked) == 1 and (asked[0].lo, asked[0].hi) == parts[0], (asked, parts)
    assert d.local.shape == (parts[0][1] - parts[0][0], 3), d.local.shape
    assert parts[-1][1] == N and all(a[1] == b[0] for a, b in zip(parts, parts[1:])), parts
    sizes = [hi - lo for lo, hi in parts]
    assert max(sizes) - min(sizes) <= L, sizes  # in proportion to the machines' ranks
ok("produced in parts")


def expect(rows):
    sel = X[rows]
    return [np.mean(sel @ w.get_value()), sel.sum(), sel.max(), sel.min()]


def check(got, rows, name):
    for g, e in zip(got, expect(rows)):
        close(g, e, rtol=1e-4)
    assert sorted(np.asarray(got[4]).round(4).tolist()) == \
        sorted(X[rows].sum(axis=1).round(4).tolist()), name
    ok(name)


check(f(d), np.arange(N), "call whole")
idx = rng.permutation(N)[:23]
check(f(d, batch=idx), idx, "call batch index")
check(f(d, batch=slice(4, 30)), np.arange(4, 30), "call batch slice")
check(f(d, batch=11), np.arange(11), "call batch int")
check(f(d, batch=idx, num_slices=2), idx, "call batch num_slices")

# Placed, replicated and NumPy inputs in one call pair rows by their index in the whole.
dy_plain = synk.data(Y)
for name, yy in (("placed", dy), ("replicated", dy_plain), ("numpy", Y)):
    got = f2(d, yy, batch=idx)
    close(got[0], np.sum((X[idx] @ w.get_value()) * Y[idx]), rtol=1e-4)
    close(got[1], np.mean(Y[idx]), rtol=1e-4)
    ok(f"call with a {name} input beside")

# A NumPy input alone: each machine is sent only its ranks' rows (checked by results here,
# by bytes in bench/cluster_data.py).
for rows in (None, idx, slice(3, 20)):
    got = f(X, batch=rows) if rows is not None else f(X)
    sel = np.arange(N) if rows is None else (np.arange(N)[rows])
    check(got, sel, f"call numpy input batch={'none' if rows is None else type(rows).__name__}")
got = f(X[:5])
check(got, np.arange(5), "call numpy input, fewer rows than ranks")

# Uneven parts: each machine has whatever rows it has (its "files"), stacked in machine order.
counts = [3 + 5 * m for m in range(M)]
starts = np.concatenate([[0], np.cumsum(counts)])


def own_files(part):
    assert part.lo is None and part.hi is None, part
    m = part.machine
    return whole_x(starts[m], starts[m + 1])


du = synk.data(produce=own_files, var=x)
assert du.shape == (starts[-1], 3), du.shape
if M > 1:
    assert du.parts == [(int(starts[m]), int(starts[m + 1])) for m in range(M)], du.parts
Xu = whole_x(0, starts[-1])
got = f(du)
close(got[1], Xu.sum(), rtol=1e-4)
close(got[0], np.mean(Xu @ w.get_value()), rtol=1e-4)
ok("uneven parts whole")
iu = rng.permutation(len(Xu))[:9]
got = f(du, batch=iu)
close(got[0], np.mean(Xu[iu] @ w.get_value()), rtol=1e-4)
close(got[2], Xu[iu].max())
ok("uneven parts batch")

# Training with shuffled batches drawn machine by machine, against the same steps in NumPy,
# with a checkpoint in the middle: saving, training on, loading and training again agree.
def numpy_step(wv, rows):
    xb, yb = X[rows].astype(np.float64), Y[rows].astype(np.float64)
    grad = 2 * xb.T @ (xb @ wv - yb) / len(rows)
    return (wv - float(lr) * grad).astype(F), np.mean((xb @ wv - yb) ** 2)


w.set_value(w0)
synk.broadcast(w)
wv = w0.copy()
order = list(synk.batches(d, 8, np.random.default_rng(1)))
assert sorted(np.concatenate(order).tolist()) == list(range(N)), "an epoch uses every row once"
if M > 1:
    for b in order:  # every machine has rows in every batch
        assert all(np.any((b >= lo) & (b < hi)) for lo, hi in d.parts), (b, d.parts)
losses = []
path = os.path.join(tempfile.mkdtemp(), "ckpt")
for k, rows in enumerate(order):
    if k == 2:
        checkpoint.save(path, metadata={"k": k})
    got = step(d, dy, batch=rows)
    wv, expected = numpy_step(wv, rows)
    close(got, expected, rtol=1e-4)
    losses.append(float(got))
close(synk.get_value(0, w), wv, rtol=1e-4)
ok("training with batches")
meta = checkpoint.load(path)
assert meta == {"k": 2}, meta
again = [float(step(d, dy, batch=rows)) for rows in order[2:]]
close(again, losses[2:], rtol=1e-6)
close(synk.get_value(0, w), wv, rtol=1e-4)
ok("checkpoint resume")

# Misuse: a clear error, and the run goes on.
if M > 1:
    misuse = (("set_value", lambda: d.set_value(X)), ("setitem", lambda: d.__setitem__(0, 1)),
              ("data", lambda: d.data), ("broadcast", lambda: synk.broadcast(w, dy)),
              ("scatter", lambda: synk.scatter(w, dy)))
    for what, call in misuse:
        try:
            call()
        except (TypeError, ValueError) as exc:
            assert "produced where it is used" in str(exc) or "live on the machines" in str(exc) \
                or "rows" in str(exc), (what, exc)
        else:
            raise AssertionError(f"{what} of a placed Data went through")
    ok("placed misuse refused")
    try:
        f2(du, dy)
    except ValueError as exc:
        assert "different parts" in str(exc) or "equal lengths" in str(exc), exc
    else:
        raise AssertionError("inputs placed in different parts were paired")
    ok("different parts refused")


def bad(part):
    if part.machine == M - 1:
        raise RuntimeError("no such file on this machine")
    return whole_x(part.lo, part.hi)


try:
    synk.data(produce=bad, length=N, var=x)
except synk.WorkerError as exc:
    assert "no such file" in str(exc), exc
    ok("produce error named")
except RuntimeError as exc:  # one machine: produce runs here
    assert M == 1 and "no such file" in str(exc), exc
    ok("produce error named")
else:
    raise AssertionError("a failing produce went through")
try:
    synk.data(produce=lambda p: whole_x(0, 2), length=N, var=x)
except (synk.WorkerError, TypeError) as exc:
    assert "asked for" in str(exc), exc
    ok("produce wrong rows named")
check(f(d, batch=idx), idx, "call after errors")
d = None
gc.collect()
check(f(X), np.arange(N), "call after a placed Data is dropped")
print("ALL OK", flush=True)
synk.close()
