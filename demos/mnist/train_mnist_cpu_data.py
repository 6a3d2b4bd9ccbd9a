"""MNIST (or scikit-learn's digits), data-parallel, with the data on the host.

    python demos/mnist/train_mnist_cpu_data.py --epochs 10 --batch-size 64
    python demos/mnist/train_mnist_cpu_data.py --model mlp     # the MLP of the other demos

The model is a small CNN (``--model cnn``, the default here): two 3x3 ReLU
convolutions with 32 and 64 filters, a 2x2 max-pool, a 256-unit hidden layer;
Adam, minibatches of 512, 30 epochs.  Why this workload: data parallelism
pays where the serial program cannot use the second core.  An MLP is almost
all matrix products, which the serial twin's BLAS already splits over every
core, so on 2 cores the ranks at best tied it (0.70-1.06x in issue 14's
runs).  Here most of a step is the convolution Ops' Numba kernels (im2col,
pooling) and elementwise work, which run on one thread however many BLAS
threads there are, and the gradient to all-reduce is small (0.3 M values).
Why 512 rows: at batch 256 the ranks did not beat one thread in two runs on
a loaded machine, where batch 512 beat it.  The functions compile with
``FAST_COMPILE`` (both twins): the Ops run the same Numba kernels, compiled
once and cached, while PyTensor's default mode also compiles the whole graph
with Numba, minutes on a cold cache.  bench/RESULTS.md (issue 14) has the figures.

The training set lives in ``synk.Data`` objects (POSIX shared memory).  Each
step passes the whole set with ``batch=`` a shuffled list of row indices:
every rank gathers its own share of those rows itself, computes the gradient
of its share, the flat gradient is all-reduced once, and every rank applies
the same Adam update (``make_train_function``).  Test loss and accuracy come
from one call over the whole test set, split in slices on each rank.

At the end the serial twin (same model, initial values and minibatches, plain
PyTensor, run in this process after ``synk.close()``) trains for
``--serial-epochs`` epochs, and the ratio of median epoch times is printed as
the speedup.  Epoch times exclude compilation (a warm-up step runs first).
"""

import os
import sys
import time

import numpy as np
import pytensor.tensor as pt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import synkhronos as synk  # noqa: E402
from synkhronos.extensions import make_train_function  # noqa: E402


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv, model="cnn")
    data = common.load_data(args.data, args.seed)
    x_train, y_train, x_test, y_test, name = data
    n_parallel = synk.fork(args.n_parallel)   # before building any function
    print(f"data: {name}: {len(x_train)} train / {len(x_test)} test images; "
          f"{n_parallel} ranks", flush=True)

    x = pt.matrix("x")
    y = pt.lvector("y")
    forward, params = common.build_model(args, x_train.shape[1])
    loss, acc = common.loss_and_accuracy(forward, x, y)
    train_step = make_train_function(loss, params, x, y, update_rule="adam",
                                     update_kwargs={"learning_rate": args.learning_rate},
                                     mode=args.mode)
    f_test = synk.function([x, y], [loss, acc], mode=args.mode)   # both "avg": weighted by rows, exact
    synk.distribute()

    x_train_d, y_train_d = synk.data(x_train), synk.data(y_train)
    x_test_d, y_test_d = synk.data(x_test), synk.data(y_test)
    rng = np.random.default_rng(args.seed)
    train_step(x_train_d, y_train_d, batch=np.arange(min(args.batch_size, len(x_train))))
    log = common.EpochLog(f"{n_parallel} ranks")
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        losses = [train_step(x_train_d, y_train_d, batch=idx)
                  for idx in common.progress(common.batches(len(x_train), args.batch_size, rng),
                                             f"epoch {epoch}", args)]
        dt = time.perf_counter() - t0
        test_loss, test_acc = f_test(x_test_d, y_test_d, num_slices=2)
        log.record(epoch, dt, float(np.mean(losses)), float(test_loss), float(test_acc))
    common.finish(params, log, args, data, n_parallel)
    return log


if __name__ == "__main__":
    main()
