"""MNIST (or scikit-learn's digits), data-parallel, with the data scattered into shared variables.

    python demos/mnist/train_mnist_gpu_data.py --epochs 10 --batch-size 128

The training and test sets are scattered once (``synk.scatter``) into shared
variables, so each rank keeps its share in its own memory (device memory in
GPU mode) and no input travels per step.  The functions name those variables
in ``sliceable_shareds``; each step selects rows with ``batch_s=``: one
shuffled index list per rank, into that rank's own share (shuffling stays
within a rank's share).  Evaluation runs over every rank's whole test share,
in slices (``num_slices``).

The speedup is measured as in ``train_mnist_cpu_data.py``: the serial twin
(plain PyTensor, same model and initial values) trains for ``--serial-epochs``
epochs in this process after ``synk.close()``; the ratio of median epoch times
is printed.
"""

import os
import sys
import time

import numpy as np
import pytensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import synkhronos as synk  # noqa: E402
from synkhronos.extensions import make_train_function  # noqa: E402


def shared_like(array, name):
    """A shared variable for data of ``array``'s dtype and ndim (filled by scatter later)."""
    return pytensor.shared(array[:1].copy(), name=name)


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv)
    data = common.load_data(args.data, args.seed)
    x_train, y_train, x_test, y_test, name = data
    n_parallel = synk.fork(args.n_parallel)
    print(f"data: {name}: {len(x_train)} train / {len(x_test)} test images; "
          f"{n_parallel} ranks", flush=True)

    x_train_s, y_train_s = shared_like(x_train, "x_train"), shared_like(y_train, "y_train")
    x_test_s, y_test_s = shared_like(x_test, "x_test"), shared_like(y_test, "y_test")
    forward, params = common.build_model(args, x_train.shape[1])
    loss, _ = common.loss_and_accuracy(forward, x_train_s, y_train_s)
    # x and y are shared variables here: they become sliceable_shareds.
    train_step = make_train_function(loss, params, x_train_s, y_train_s, update_rule="adam",
                                     update_kwargs={"learning_rate": args.learning_rate},
                                     mode=args.mode)
    test_loss, test_acc = common.loss_and_accuracy(forward, x_test_s, y_test_s)
    f_test = synk.function([], [test_loss, test_acc], sliceable_shareds=[x_test_s, y_test_s],
                           mode=args.mode)
    synk.distribute()

    synk.scatter([x_train_s, y_train_s], [x_train, y_train])
    synk.scatter([x_test_s, y_test_s], [x_test, y_test])
    lengths = synk.get_lengths(x_train_s)
    print(f"training rows per rank: {lengths}", flush=True)

    rng = np.random.default_rng(args.seed)
    per_rank = max(1, args.batch_size // n_parallel)
    n_steps = -(-min(lengths) // per_rank)

    def epoch_batches():
        """One list per step: for each rank, shuffled row indices into its own share."""
        orders = [rng.permutation(n) for n in lengths]
        return [[order[k * per_rank:(k + 1) * per_rank] for order in orders]
                for k in range(n_steps)]

    train_step(batch_s=[np.arange(min(per_rank, n)) for n in lengths])  # compile: warm-up
    log = common.EpochLog(f"{n_parallel} ranks")
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        losses = [train_step(batch_s=rows)
                  for rows in common.progress(epoch_batches(), f"epoch {epoch}", args)]
        dt = time.perf_counter() - t0
        loss_value, acc_value = f_test(num_slices=2)
        log.record(epoch, dt, float(np.mean(losses)), float(loss_value), float(acc_value))
    common.finish(params, log, args, data, n_parallel)
    return log


if __name__ == "__main__":
    main()
