"""A training run that checkpoints every step, for tests/variables/test_checkpoint.py (run as a script).

    python ckpt_train.py N_RANKS CKPT N_STEPS [--resume] [--pause] [--dropout]

Prints ``step K LOSS`` (the loss in hex, exact) after each step's checkpoint;
with --pause it then waits for a line on stdin, so a test can kill it between
steps.  With --resume it starts from CKPT.
"""

import sys

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.variables import checkpoint
from synkhronos.extensions import layers as L
from synkhronos.extensions import train


def build(dropout):
    """Return (step function, x data, y data) of a small MLP trained with Adam."""
    rng = np.random.default_rng(0)
    x, y = pt.matrix("x"), pt.ivector("y")
    d1 = L.Dense(6, 16, rng=rng, name="d1")
    d2 = L.Dense(16, 3, rng=rng, init="glorot", name="d2")
    h = L.relu(d1(x))
    extra = []
    if dropout:
        gen = pytensor.shared(np.random.default_rng(42), name="dropout_rng")
        next_gen, keep = pt.random.bernoulli(0.8, size=h.shape, rng=gen, return_next_rng=True)
        h = h * pt.cast(keep, h.dtype) / 0.8
        extra = [(gen, next_gen)]
    loss = L.softmax_cross_entropy(d2(h), y).mean()
    step = train.make_train_function(loss, d1.params + d2.params, x, y, update_rule="adam",
                                     update_kwargs={"learning_rate": 0.01},
                                     extra_updates=extra, mode="FAST_COMPILE")
    data_rng = np.random.default_rng(1)
    x_data = data_rng.normal(size=(64, 6)).astype("float32")
    y_data = data_rng.integers(0, 3, size=64).astype("int32")
    return step, x_data, y_data


def main(argv):
    n, path, n_steps = int(argv[0]), argv[1], int(argv[2])
    synk.fork(n, use_gpu=False)
    step, x_data, y_data = build("--dropout" in argv)
    synk.distribute()
    start = checkpoint.load(path)["step"] if "--resume" in argv else 0
    for k in range(start, n_steps):
        idx = np.random.default_rng((7, k)).choice(64, size=21, replace=False)
        loss = float(step(x_data, y_data, batch=idx))
        checkpoint.save(path, metadata={"step": k + 1})
        print(f"step {k} {loss.hex()}", flush=True)
        if "--pause" in argv:
            sys.stdin.readline()
    synk.close()


if __name__ == "__main__":
    main(sys.argv[1:])
