"""MNIST (or scikit-learn's digits) with plain PyTensor: the serial baseline.

    python demos/mnist/train_mnist_serial.py --epochs 10 --batch-size 64

The same model, initial values, update rule (Adam) and minibatches as the two
data-parallel demos (the MLP by default, as ``train_mnist_gpu_data.py``;
``--model cnn`` for the CNN of ``train_mnist_cpu_data.py``), built with
``make_serial_train_function``: one PyTensor function per step, using the
machine as plain PyTensor does (its BLAS may use every core).  Prints train
loss and test accuracy per epoch.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def main(argv=None):
    args = common.parse_args(__doc__.splitlines()[0], argv, parallel=False)
    data = common.load_data(args.data, args.seed)
    x_train, _, x_test, _, name = data
    print(f"data: {name}: {len(x_train)} train / {len(x_test)} test images, "
          f"{x_train.shape[1]} pixels", flush=True)
    log = common.serial_epochs(args, data, args.epochs)
    print(f"final test accuracy {100 * log.last_accuracy:.2f}%, median epoch {log.epoch_time:.3f} s")
    return log


if __name__ == "__main__":
    main()
