"""Training-step variants on the MNIST demo's model: 16-bit all-reduce and overlap (double buffering).

In one run, the MNIST demo's MLP (demos/mnist/common.py: 2 hidden ReLU layers,
Adam, the demo's data: MNIST from --data, else scikit-learn's digits) trains
on 2 ranks with the same initial values and minibatches in six variants:
the plain step, ``all_reduce_dtype="bfloat16"`` and ``"float16"``,
``overlap=True``, the same step with the all-reduce run before the
gradient instead of beside it ("overlap-no-thread": one command per step
like overlap, but nothing overlapped), and ``overlap=True`` with bfloat16.  Prints per variant the
median step time (compilation excluded), its ratio to the plain step measured
in this run, and the final test loss and accuracy; and the load average,
since the machine is shared.

Usage: python bench/training_variants.py [--data PATH] [--epochs 8] [--hidden 1024]
       [--batch-size 128] [--variants plain,bfloat16,...]
"""

import argparse
import os
import statistics
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.functions import overlap as overlap_mod
from synkhronos.extensions import make_train_function

from common import demo

# The MNIST demos' shared module (model, data, batches), loaded from its file.
mnist = demo("mnist/common.py", "mnist_common")

VARIANTS = {
    "plain": {},
    "bfloat16": {"all_reduce_dtype": "bfloat16"},
    "float16": {"all_reduce_dtype": "float16"},
    "overlap": {"overlap": True},
    "overlap-no-thread": {"overlap": True},
    "overlap+bfloat16": {"overlap": True, "all_reduce_dtype": "bfloat16"},
}


class _InlineThread:
    """A Thread stand-in running its target at start(): the overlapped step, not overlapped."""

    def __init__(self, target, **kwargs):
        self.target = target

    def start(self):
        self.target()

    def join(self):
        pass


def run(variant, args, data):
    x_train, y_train, x_test, y_test, _ = data
    # Set before fork, so every rank runs the one-command step without overlap: this
    # separates the gain of overlapping from that of one command per step instead of three.
    overlap_mod.threading = (SimpleNamespace(Thread=_InlineThread)
                             if variant == "overlap-no-thread" else threading)
    synk.fork(2, use_gpu=False)
    try:
        x, y = pt.matrix("x"), pt.lvector("y")
        forward, params = mnist.build_mlp(x_train.shape[1], args.hidden, 10, args.seed)
        loss, acc = mnist.loss_and_accuracy(forward, x, y)
        step = make_train_function(loss, params, x, y, update_rule="adam",
                                   update_kwargs={"learning_rate": args.learning_rate},
                                   **VARIANTS[variant])
        f_test = synk.function([x, y], [loss, acc])
        synk.distribute()
        xd, yd = synk.data(x_train), synk.data(y_train)
        rng = np.random.default_rng(args.seed)
        times = []
        for epoch in range(args.epochs):
            for k, idx in enumerate(mnist.batches(len(x_train), args.batch_size, rng)):
                t0 = time.perf_counter()
                step(xd, yd, batch=idx)
                if epoch or k >= 3:  # compilation and first touches excluded
                    times.append(time.perf_counter() - t0)
        step.flush()
        test_loss, test_acc = f_test(synk.data(x_test), synk.data(y_test))
    finally:
        synk.close()
    return statistics.median(times), float(test_loss), float(test_acc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=None)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--learning-rate", type=float, default=0.002)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    data = mnist.load_data(args.data, args.seed)
    print(f"data: {data[4]}, {len(data[0])} train / {len(data[2])} test; hidden {args.hidden}, "
          f"batch {args.batch_size}, {args.epochs} epochs, 2 ranks")
    print(f"load average before: {os.getloadavg()}")
    print("| variant | median step | vs plain | test loss | test accuracy |")
    print("|---|---|---|---|---|")
    base = None
    for variant in args.variants.split(","):
        t, test_loss, test_acc = run(variant, args, data)
        base = t if variant == "plain" else base
        ratio = f"{base / t:.2f}x" if base else "-"
        print(f"| {variant} | {t * 1e3:.2f} ms | {ratio} | {test_loss:.4f} | {test_acc:.4f} |",
              flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
