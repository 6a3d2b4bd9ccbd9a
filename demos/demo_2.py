"""Demo 2: synk.Data, the NumPy arrays in shared memory that functions take as inputs.

    python demos/demo_2.py [--n-parallel N]

A Data object has a fixed dtype and ndim (like a PyTensor variable); its shape
may change.  Reads and writes go to the underlying NumPy array with ordinary
indexing.  Memory can be allocated with headroom (``oversize``) so that
growing later does not reallocate.  Every rank sees the same memory, so a
call passes only the object's id, never the data.
"""

import argparse

import numpy as np
import pytensor.tensor as T

import synkhronos as synk


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-parallel", type=int, default=None)
    args = p.parse_args(argv)
    n = synk.fork(args.n_parallel)

    x = T.matrix("x")
    f = synk.function([x], outputs=(T.sum(x, axis=0), "sum"))
    synk.distribute()      # Data objects can be made before or after distribute()

    # From a value: dtype, ndim and shape follow it.
    a = np.arange(12, dtype="float32").reshape(6, 2)
    d = synk.data(a, name="d")
    print(d)
    assert d.dtype == np.float32 and d.ndim == 2 and d.shape == (6, 2) and len(d) == 6
    assert np.array_equal(d[2:4], a[2:4])      # NumPy indexing reads...
    d[0] = [100, 200]                          # ...and writes
    assert np.array_equal(f(d), a[1:].sum(axis=0) + [100, 200])

    # From a variable: dtype and ndim come from it; allocate with headroom.
    e = synk.data(var=x, shape=(4, 2), oversize=2)
    print(f"shape {e.shape}, alloc_size {e.alloc_size} items (oversize=2)")
    assert e.alloc_size == 16
    e.set_value(np.ones((8, 2), dtype="float32"))    # fits: no reallocation
    assert e.alloc_size == 16 and e.shape == (8, 2)
    assert np.array_equal(f(e), [8.0, 8.0])
    e.set_length(3)                                 # shrink the view, keep the rows
    assert e.shape == (3, 2) and np.array_equal(f(e), [3.0, 3.0])
    e.set_value(np.ones((20, 2), dtype="float32"))  # too big: reallocates (workers follow)
    assert e.alloc_size >= 40 and np.array_equal(f(e), [20.0, 20.0])

    # dtypes are strict unless you ask for a cast.
    try:
        e.set_value(np.ones((2, 2)))                # float64
    except TypeError as exc:
        print(f"TypeError as expected: {exc}")
    else:
        raise AssertionError("a float64 value must not be stored silently")
    e.set_value(np.ones((2, 2)), force_cast=True)
    assert e.dtype == np.float32
    print(f"condition_data: {e.condition_data([[1, 2]], force_cast=True).dtype}")

    # build_inputs: one Data per function input, from values given as for a call.
    b = f.build_inputs(np.full((5, 2), 2, dtype="float32"))
    assert isinstance(b, synk.Data) and np.array_equal(f(b), [10.0, 10.0])

    # Data holding integers (e.g. labels), and the minibatch flag used with batch=
    # (see demo_4.py).
    labels = synk.data(np.arange(10), minibatch=False)
    assert labels.dtype == np.int64 and not labels.minibatch

    # free_memory releases the segment in every process; set_value allocates anew.
    e.free_memory()
    assert e.data is None and e.alloc_size == 0
    e.set_value(np.zeros((3, 2), dtype="float32"))
    assert np.array_equal(f(e), [0.0, 0.0])

    synk.close()
    print(f"{n} ranks. All assertions passed.")


if __name__ == "__main__":
    main()
