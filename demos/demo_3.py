"""Demo 3: shared variables in every rank, and the collectives that move them.

    python demos/demo_3.py [--n-parallel N]

After ``distribute()`` every rank holds its own replica of each shared
variable.  Functions update the replicas locally; collectives move values
between ranks: broadcast, scatter, gather, all_gather, reduce, all_reduce,
set_value / get_value for one rank, get_lengths / get_shapes.
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

    s_init = np.ones(2, dtype="float32")
    x = T.matrix("x")
    s = theano.shared(s_init, name="s")
    f = synk.function([x], updates=[(s, T.sum(x * s, axis=0))])
    # A variable holding data, to scatter: rows split over the ranks.
    d = theano.shared(np.zeros((1, 3), dtype="float32"), name="d")
    g = synk.function([], outputs=(T.sum(d), "sum"))
    synk.distribute()

    x_dat = synk.data(np.array([[1, 1], [2, 2], [3, 3], [4, 4]], dtype="float32"))
    # The rows each rank gets (the first ranks get one more when uneven).
    shares = np.array_split(x_dat.data, n)
    print(f"s initial: {s.get_value()}")

    f.as_theano(x_dat.data)                     # master only, all rows
    print(f"s after the PyTensor call: {s.get_value()}")
    assert np.array_equal(s.get_value(), [10, 10])

    s.set_value(s_init)                         # master's replica only
    f(x_dat)                                    # every rank: its own rows
    gathered = synk.gather(s, nd_up=1)          # one row per rank
    print(f"gathered s after a synkhronos call:\n{gathered}")
    # Every replica started from ones (distribute() copied s_init), so each
    # rank's s is now the sum of its own rows.
    expected = [share.sum(axis=0) for share in shares]
    assert np.allclose(gathered, expected)

    synk.reduce(s, op="sum")                    # into the master (in place)
    print(f"master's s after reduce(sum): {s.get_value()}")
    assert np.array_equal(s.get_value(), [10, 10])
    assert np.allclose(synk.gather(s)[1:], expected[1:])   # workers unchanged

    synk.broadcast(s, s_init)                   # same value everywhere again
    f(x_dat)
    synk.all_reduce(s, op="sum")                # everyone gets the sum
    gathered = synk.gather(s, nd_up=1)
    print(f"gathered s after broadcast, call and all_reduce(sum):\n{gathered}")
    assert np.array_equal(gathered, np.full((n, 2), 10.0))

    # One rank at a time.
    synk.set_value(n - 1, s, np.array([7, 7], dtype="float32"))
    assert np.array_equal(synk.get_value(n - 1, s), [7, 7])
    synk.all_reduce(s, op="max")
    assert np.array_equal(synk.get_value(0, s), [10, 10])

    # Scatter rows of a data set; each rank keeps its share.
    data = np.arange(30, dtype="float32").reshape(10, 3)
    synk.scatter(d, data)
    lengths = synk.get_lengths(d)
    print(f"rows of d per rank: {lengths}, shapes {synk.get_shapes(d)}")
    assert sum(lengths) == 10
    assert np.array_equal(synk.gather(d, nd_up=0), data)   # nd_up=0: concatenate
    assert g() == data.sum()
    synk.all_gather(d)                          # every rank: all rows
    assert synk.get_lengths(d) == [10] * n
    assert g() == n * data.sum()

    synk.close()
    print(f"{n} ranks. All assertions passed.")


if __name__ == "__main__":
    main()
