"""A probe of misuse anyone can rerun: bad arguments to the public API, one by one.

    python tests/helpers/misuse_probe.py [--n 2]

Each case calls the API with one bad argument and is classified:
  clear   - raised in the master, and the message names the argument (or setting);
  vague   - raised, but the message does not name it;
  silent  - accepted.
After every case a real call must still give the right answer (the library stays usable).
Prints one line per case and a summary; exits 1 if any case is not "clear".
tests/test_misuse_probe.py runs it.
"""

import argparse
import math
import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import train


def cases(f, d, w):
    """(label, what the message must name, callable) for every probe."""
    ok_x = np.ones((4, 3), "float32")
    return [
        ("batch: uint64 past int64", "batch", lambda: f(d, batch=np.array([2**64 - 1], "uint64"))),
        ("batch: float index", "batch", lambda: f(d, batch=[0.5])),
        ("batch: bool in a list", "batch", lambda: f(d, batch=[0, True])),
        ("batch: out of range", "batch", lambda: f(d, batch=[0, 1000])),
        ("output_subset: float", "output_subset", lambda: f(d, output_subset=[0.7])),
        ("output_subset: string", "output_subset", lambda: f(d, output_subset=["1"])),
        ("output_subset: bool", "output_subset", lambda: f(d, output_subset=[True])),
        ("num_slices: zero", "num_slices", lambda: f(d, num_slices=0)),
        ("num_slices: bool", "num_slices", lambda: f(d, num_slices=True)),
        ("data shape: float", "shape", lambda: synk.data(shape=(2.5, 3), dtype="float32")),
        ("data shape: string", "shape", lambda: synk.data(shape="ab", dtype="float32")),
        ("data shape: nan", "shape", lambda: synk.data(shape=[math.nan, 3], dtype="float32")),
        ("data shape: negative", "shape", lambda: synk.data(shape=(-1, 3), dtype="float32")),
        ("data force_cast: string", "force_cast",
         lambda: synk.data(ok_x.astype("float64"), var=pt.matrix("q"), force_cast="no")),
        ("data minibatch: string", "minibatch", lambda: synk.data(ok_x, minibatch="no")),
        ("Data: an id in use", "ID", lambda: synk.Data(d._ID, "float32", 2)),
        ("set_value oversize: below 1", "oversize", lambda: d.set_value(ok_x, oversize=0.5)),
        ("all_reduce op: mean", "op", lambda: synk.all_reduce(w, op="mean")),
        ("all_reduce in_place: string", "in_place",
         lambda: synk.reduce(w, op="sum", in_place="no")),
        ("all_reduce: unknown variable name", "nope", lambda: synk.all_reduce("nope")),
        ("broadcast nccl: string", "nccl", lambda: synk.broadcast(w, nccl="no")),
        ("get_value rank: out of range", "rank", lambda: synk.get_value(99, w)),
        ("gather nd_up: float", "nd_up", lambda: synk.gather(w, nd_up=1.0)),
        ("make_train_function: all_reduce_op max", "all_reduce_op", _train_op_max),
    ]


def _train_op_max():
    a, b = pt.matrix("a"), pt.ivector("b")
    p = pytensor.shared(np.zeros((3, 2), "float32"), name="p")
    loss = pt.sum(a.dot(p)) + pt.sum(b)
    train.make_train_function(loss, [p], a, b, all_reduce_op="max")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2)
    args = ap.parse_args()
    synk.fork(args.n, use_gpu=False)
    x = pt.matrix("x")
    w = pytensor.shared(np.ones((4, 3), "float32"), name="w")
    f = synk.function([x], [(x.sum(), "sum"), (x.max(), "max")], updates=[(w, w + 0)])
    synk.distribute()
    data = np.arange(12, dtype="float32").reshape(4, 3)
    d = synk.data(data)
    results = []
    for label, name, run in cases(f, d, w):
        try:
            run()
            kind = "silent"
            text = ""
        except Exception as exc:  # noqa: BLE001 - classified below
            text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            kind = "clear" if name in str(exc) and not isinstance(exc, synk.WorkerError) \
                else "vague"
        got = f(d)
        usable = float(got[0]) == float(data.sum()) and float(got[1]) == float(data.max())
        results.append(kind if usable else "broke the library")
        print(f"{kind:8s} {label:40s} {text[:110]}")
        if not usable:
            break
    synk.close()
    summary = {k: results.count(k) for k in sorted(set(results))}
    print(f"{len(results)} cases: " + ", ".join(f"{n} {k}" for k, n in summary.items()))
    return 0 if set(results) == {"clear"} else 1


if __name__ == "__main__":
    sys.exit(main())
