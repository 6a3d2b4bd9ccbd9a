"""Demo 5: ``batch_s`` selects rows of sliceable shared variables, in each rank after scattering.

    python demos/demo_5.py [--n-parallel N]

Data scattered into shared variables stays in each rank (device memory in GPU
mode).  A function lists such variables in ``sliceable_shareds``; a call then
picks rows of each rank's own share with ``batch_s``: one slice or index list
used by every rank, or a list with one per rank.  ``num_slices`` splits them
too.  Compare ``batch`` (demo_4.py), which selects from the whole data set
before scattering.
"""

import argparse

import numpy as np
import pytensor as theano
import pytensor.tensor as T

import synkhronos as synk


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-parallel", type=int, default=None)
    args = p.parse_args(argv)
    n = synk.fork(args.n_parallel)

    data_s = theano.shared(np.zeros((1, 2), dtype="float32"), name="data_s")
    y = T.vector("y")
    f = synk.function([], bcast_inputs=[y],
                      outputs=[(T.sum(data_s.dot(y)), "sum"), (data_s, "gather")],
                      sliceable_shareds=[data_s])
    synk.distribute()

    data = np.arange(40, dtype="float32").reshape(20, 2)
    synk.scatter(data_s, data)
    shares = np.array_split(data, n)            # what each rank now holds
    print(f"rows per rank: {synk.get_lengths(data_s)}")
    y_dat = synk.data(np.array([1, -1], dtype="float32"))

    def expect(selections):
        rows = np.concatenate([share[sel] for share, sel in zip(shares, selections)])
        return (rows @ y_dat.data).sum(), rows

    # The whole share of every rank.
    total, rows = f(y_dat)
    assert np.isclose(total, (data @ y_dat.data).sum()) and np.array_equal(rows, data)

    # One slice for every rank: rows 1..3 of each share.
    total, rows = f(y_dat, batch_s=slice(1, 4))
    exp_total, exp_rows = expect([slice(1, 4)] * n)
    print(f"batch_s=slice(1, 4): rows\n{rows}")
    assert np.isclose(total, exp_total) and np.array_equal(rows, exp_rows)

    # One index list per rank, e.g. each rank's own shuffle.
    rng = np.random.default_rng(0)
    lists = [rng.permutation(len(share))[:3] for share in shares]
    total, rows = f(y_dat, batch_s=lists)
    exp_total, exp_rows = expect(lists)
    assert np.isclose(total, exp_total) and np.array_equal(rows, exp_rows)
    print("batch_s with one index list per rank: ok")

    # Slices within each rank's selection.
    total, rows = f(y_dat, batch_s=[0, 2, 3, 4], num_slices=2)
    exp_total, exp_rows = expect([[0, 2, 3, 4]] * n)
    assert np.isclose(total, exp_total) and np.array_equal(rows, exp_rows)

    synk.close()
    print(f"{n} ranks. All assertions passed.")


if __name__ == "__main__":
    main()
