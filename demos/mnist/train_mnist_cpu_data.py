"""MNIST (or scikit-learn's digits), data-parallel, with the data on the host.

    python demos/mnist/train_mnist_cpu_data.py --epochs 10 --batch-size 64

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
    args = common.parse_args(__doc__.splitlines()[0], argv)
    data = common.load_data(args.data, args.seed)
    x_train, y_train, x_test, y_test, name = data
    n_parallel = synk.fork(args.n_parallel)   # before building any function
    print(f"data: {name}: {len(x_train)} train / {len(x_test)} test images; "
          f"{n_parallel} ranks", flush=True)

    x = pt.matrix("x")
    y = pt.lvector("y")
    forward, params = common.build_mlp(x_train.shape[1], args.hidden, 10, args.seed)
    loss, acc = common.loss_and_accuracy(forward, x, y)
    train_step = make_train_function(loss, params, x, y, update_rule="adam",
                                     update_kwargs={"learning_rate": args.learning_rate})
    f_test = synk.function([x, y], [loss, acc])   # both "avg": weighted by rows, exact
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
