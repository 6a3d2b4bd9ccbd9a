"""Demo 4: ``batch`` selects rows of the inputs before scattering; ``num_slices`` splits the work.

    python demos/demo_4.py [--n-parallel N]

Pass a whole data set and select the rows of this call with ``batch``: an int
``k`` (rows ``[:k]``), a slice, or an index list (a shuffled minibatch; each
rank gathers its own rows, in parallel).  A Data made with ``minibatch=True``
holds only the minibatch: its row ``j`` pairs with ``batch[j]``.
``num_slices`` runs each rank's rows in that many pieces and accumulates the
outputs (and updates) — for evaluating a large set without running out of
memory.
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

    x = T.matrix("x")
    w = T.vector("w")
    f = synk.function([x], outputs=[(T.sum(x, axis=0), "sum"), T.mean(x)])
    f_w = synk.function([x, w], outputs=(T.sum(x * w[:, None], axis=0), "sum"))
    # An update accumulated over slices with op "sum" (the default "avg" averages them).
    acc = theano.shared(np.zeros(3, dtype="float32"), name="acc")
    f_acc = synk.function([x], updates=[(acc, T.sum(x, axis=0), "sum")])
    synk.distribute()

    rng = np.random.default_rng(0)
    data = rng.standard_normal((50, 3)).astype("float32")
    x_dat = synk.data(data)

    for batch in (20, slice(10, 27), [3, 1, 4, 1, 5, 9, 2, 6], rng.permutation(50)[:17]):
        total, mean = f(x_dat, batch=batch)
        rows = data[:batch] if isinstance(batch, int) else data[batch]
        print(f"batch={batch!r:.40}: {len(rows)} rows, sum {np.round(total, 3)}")
        assert np.allclose(total, rows.sum(axis=0), atol=1e-4)
        assert np.allclose(mean, rows.mean(), atol=1e-5)   # "avg" is weighted by rows

    # A minibatch input: weights for exactly the rows a batch selects.
    idx = rng.permutation(50)[:12]
    weights = synk.data(np.linspace(0, 1, 12).astype("float32"), minibatch=True)
    got = f_w(x_dat, weights, batch=idx)
    assert np.allclose(got, (data[idx] * weights.data[:, None]).sum(axis=0), atol=1e-4)
    print("minibatch input: row j paired with batch[j]")

    # num_slices: the same results, each rank running its rows in pieces.
    for k in (1, 2, 3):
        total, mean = f(x_dat, num_slices=k)
        assert np.allclose(total, data.sum(axis=0), atol=1e-4)
        assert np.allclose(mean, data.mean(), atol=1e-5)
    f_acc(x_dat, num_slices=4)            # updates accumulate ("sum") and apply once
    per_rank = synk.gather(acc, nd_up=1)
    assert np.allclose(per_rank.sum(axis=0), data.sum(axis=0), atol=1e-4)
    print(f"acc per rank after num_slices=4:\n{per_rank}")

    synk.close()
    print(f"{n} ranks. All assertions passed.")


if __name__ == "__main__":
    main()
