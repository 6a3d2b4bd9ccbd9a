"""Demo 1: a function computed on every rank, and how its outputs are reduced.

    python demos/demo_1.py [--n-parallel N]

Build graphs as usual, make the function with ``synk.function`` instead of
``pytensor.function``, call ``distribute()``, then call the function: each rank
computes over its share of the scattered inputs, and each output is combined
by its reduce op ("avg" by default; "sum", "prod", "max", "min", None for the
list of per-rank results, "gather" to concatenate them).
"""

import argparse

import numpy as np
import pytensor as theano          # old Theano scripts: only this import changes
import pytensor.tensor as T

import synkhronos as synk


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-parallel", type=int, default=None)
    args = p.parse_args(argv)

    n = synk.fork(args.n_parallel)       # 1. fork first
    print(f"forked: {n} ranks")

    x = T.matrix("x")                    # 2. build variables and graphs
    y = T.vector("y")
    z = T.mean(x.dot(y), axis=0)
    f_th = theano.function(inputs=[x, y], outputs=z)
    # 3. build functions through synkhronos: x is scattered, y broadcast.
    f = synk.function(inputs=[x], bcast_inputs=[y], outputs=z)

    s = x.dot(y)
    g = synk.function(inputs=[x], bcast_inputs=[y],
                      outputs=[(T.sum(s), "sum"), (T.max(s), "max"), (T.min(s), "min"),
                               (T.prod(T.ones_like(s) * 1.01), "prod"),
                               (s.shape[0], None), (s, "gather")])
    synk.distribute()                    # 4. replicate the functions in the workers

    rng = np.random.default_rng(0)       # 5. data in shared memory, then call
    x_dat = rng.standard_normal((101, 10)).astype("float32")   # 101: an uneven split
    y_dat = rng.standard_normal(10).astype("float32")
    x_synk = synk.data(x_dat)
    y_synk = synk.data(y_dat)

    r_th = f_th(x_dat, y_dat)
    r = f(x_synk, y_synk)
    print(f"avg over ranks: {r:.6f}   pytensor on the whole x: {r_th:.6f}")
    # "avg" is weighted by each rank's rows, so it equals the serial mean exactly.
    assert np.allclose(r, r_th, rtol=1e-5)

    total, biggest, smallest, prod, rows, s_all = g(x_synk, y_synk)
    s_ref = x_dat @ y_dat
    print(f"sum {total:.4f}  max {biggest:.4f}  min {smallest:.4f}  prod {prod:.4f}")
    print(f"rows per rank (op None): {[int(k) for k in rows]}")
    assert np.allclose(total, s_ref.sum(), rtol=1e-4)
    assert np.isclose(biggest, s_ref.max()) and np.isclose(smallest, s_ref.min())
    assert np.isclose(prod, np.float32(1.01) ** 101, rtol=1e-4)
    assert len(rows) == n and sum(rows) == 101 and max(rows) - min(rows) <= 1
    assert np.allclose(s_all, s_ref, rtol=1e-5)         # "gather": in rank order

    # NumPy arrays work too (copied into shared memory on each call).
    assert np.allclose(f(x_dat, y_dat), r_th, rtol=1e-5)
    # as_theano runs the plain PyTensor function in the master only.
    assert np.allclose(f.as_theano(x_dat, y_dat), r_th, rtol=1e-6)
    print(f"output modes of g: {g.output_modes}")

    synk.close()
    print("All assertions passed.")


if __name__ == "__main__":
    main()
