"""ResNet (the ResNet-50 layout) on synthetic images: data-parallel and serial images/s.

    python demos/resnet/train_resnet.py                      # small: finishes in minutes
    python demos/resnet/train_resnet.py --depth 50 --width 64 --image-size 224 --classes 1000

The network is the bottleneck ResNet of He et al. (2016): a 7x7/2 convolution
and a 3x3/2 max-pool, four stages of bottleneck blocks (1x1, 3x3, 1x1
convolutions with batch norm; the stride sits in the 3x3, as in "v1.5") with
``width * (1, 2, 4, 8)`` channels inside and four times that outside, global
average pooling and a dense classifier.  ``--depth`` picks the blocks per
stage (50: 3-4-6-3, as the paper's benchmark), ``--width`` the first stage's
channels (64 in ResNet-50), ``--image-size`` the square inputs (224 in
ResNet-50).  Images and labels are random, as in the Synkhronos paper's
benchmark: only throughput is measured.

Data-parallel training keeps the images in a ``synk.Data`` set on the host and
passes random minibatches with ``batch=`` (index lists); the gradient is
all-reduced as one flat vector and every rank applies the same momentum-SGD
update.  Batch norm uses each rank's share of the minibatch (per-device batch
norm, as the original).  The serial twin then trains the same network in this
process with plain PyTensor, and images/s of both and the speedup are printed.
Timed steps exclude compilation (warm-up steps run first).

The first run compiles with Numba for several minutes (each op of the graph
once, per process); PyTensor caches compiled code on disk, so later runs of
the same configuration start within about a minute.
"""

import argparse
import time

import numpy as np
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.extensions import layers as L
from synkhronos.extensions import make_serial_train_function, make_train_function

BLOCKS = {14: (1, 1, 1, 1), 26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3),
          152: (3, 8, 36, 3)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=14, choices=sorted(BLOCKS),
                   help="layers: blocks per stage 14: 1-1-1-1, 26: 2-2-2-2, 50: 3-4-6-3, ...")
    p.add_argument("--width", type=int, default=8, help="channels of the first stage (ResNet-50: 64)")
    p.add_argument("--image-size", type=int, default=32, help="square image side (ResNet-50: 224)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="global minibatch size")
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
    p.add_argument("--n-images", type=int, default=256, help="synthetic images in the data set")
    p.add_argument("--learning-rate", type=float, default=0.01)
    p.add_argument("--n-parallel", type=int, default=None, help="ranks (default: every core)")
    p.add_argument("--no-serial", action="store_true", help="skip the serial twin")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class ResNet:
    """The bottleneck ResNet; ``forward(x)`` builds the graph, ``params`` are trained.

    Batch-norm layers record their running-statistics updates in training-mode
    calls; ``bn_updates()`` returns them for the training function.
    """

    def __init__(self, depth, width, n_classes, seed=0):
        rng = np.random.default_rng(seed)
        self.stem = L.Conv2D(3, width, 7, stride=2, pad=3, rng=rng, bias=False, name="stem")
        self.stem_bn = L.BatchNorm(width, name="stem.bn")
        self.blocks = []
        n_in = width
        for stage, n_blocks in enumerate(BLOCKS[depth]):
            inner = width * 2 ** stage
            for b in range(n_blocks):
                stride = 2 if (b == 0 and stage > 0) else 1
                self.blocks.append(self._block(n_in, inner, stride, rng, f"s{stage}b{b}"))
                n_in = 4 * inner
        self.fc = L.Dense(n_in, n_classes, rng, init="glorot", name="fc")
        self.bns = [self.stem_bn] + [bn for blk in self.blocks for _, bn in blk["layers"]] + \
            [blk["short"][1] for blk in self.blocks if blk["short"]]
        convs = [self.stem] + [c for blk in self.blocks for c, _ in blk["layers"]] + \
            [blk["short"][0] for blk in self.blocks if blk["short"]]
        self.params = [p for layer in convs + self.bns + [self.fc] for p in layer.params]

    @staticmethod
    def _block(n_in, inner, stride, rng, name):
        layers = [
            (L.Conv2D(n_in, inner, 1, rng=rng, bias=False, name=f"{name}.c1"),
             L.BatchNorm(inner, name=f"{name}.bn1")),
            (L.Conv2D(inner, inner, 3, stride=stride, pad=1, rng=rng, bias=False, name=f"{name}.c2"),
             L.BatchNorm(inner, name=f"{name}.bn2")),
            (L.Conv2D(inner, 4 * inner, 1, rng=rng, bias=False, name=f"{name}.c3"),
             L.BatchNorm(4 * inner, name=f"{name}.bn3")),
        ]
        short = None
        if stride != 1 or n_in != 4 * inner:
            short = (L.Conv2D(n_in, 4 * inner, 1, stride=stride, rng=rng, bias=False,
                              name=f"{name}.short"),
                     L.BatchNorm(4 * inner, name=f"{name}.short_bn"))
        return {"layers": layers, "short": short}

    def forward(self, x, deterministic=False):
        h = L.relu(self.stem_bn(self.stem(x), deterministic))
        h = L.max_pool2d(h, 3, stride=2, pad=1)
        for blk in self.blocks:
            out = h
            for i, (conv, bn) in enumerate(blk["layers"]):
                out = bn(conv(out), deterministic)
                if i < 2:
                    out = L.relu(out)
            if blk["short"]:
                conv, bn = blk["short"]
                h = bn(conv(h), deterministic)
            h = L.relu(out + h)
        return self.fc(L.global_avg_pool(h))

    def bn_updates(self):
        return [u for bn in self.bns for u in bn.updates]


def build(args, parallel):
    """Return (train step, model) for the data-parallel (after fork) or serial run."""
    x = pt.tensor4("x", shape=(None, args.image_size, args.image_size, 3))
    y = pt.lvector("y")
    model = ResNet(args.depth, args.width, args.classes, args.seed)
    loss = L.softmax_cross_entropy(model.forward(x), y).mean()
    make = make_train_function if parallel else make_serial_train_function
    step = make(loss, model.params, x, y, update_rule="momentum",
                update_kwargs={"learning_rate": args.learning_rate, "momentum": 0.9},
                extra_updates=model.bn_updates())
    return step, model


def run_steps(step, x_data, y_data, args, rng):
    """Run warm-up then timed steps on random minibatches; return (images/s, last loss)."""
    n = len(x_data)
    for _ in range(args.warmup):
        step(x_data, y_data, batch=rng.choice(n, args.batch_size, replace=False))
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step(x_data, y_data, batch=rng.choice(n, args.batch_size, replace=False))
    dt = time.perf_counter() - t0
    return args.steps * args.batch_size / dt, float(loss)


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    images = rng.standard_normal((args.n_images, args.image_size, args.image_size, 3),
                                 dtype=np.float32)
    labels = rng.integers(0, args.classes, args.n_images)

    n_parallel = synk.fork(args.n_parallel)
    t0 = time.perf_counter()
    step, model = build(args, parallel=True)
    synk.distribute()
    n_values = sum(p.get_value(borrow=True).size for p in model.params)
    print(f"ResNet-{args.depth}: width {args.width}, {args.image_size}x{args.image_size} images, "
          f"{args.classes} classes, {n_values / 1e6:.2f} M parameters; built in "
          f"{time.perf_counter() - t0:.1f} s; {n_parallel} ranks", flush=True)
    x_data, y_data = synk.data(images), synk.data(labels)
    t0 = time.perf_counter()
    parallel_ips, loss = run_steps(step, x_data, y_data, args, np.random.default_rng(1))
    print(f"data-parallel ({n_parallel} ranks): {parallel_ips:.1f} images/s, last loss {loss:.3f} "
          f"({time.perf_counter() - t0:.1f} s with warm-up)", flush=True)
    synk.close()

    if args.no_serial:
        return parallel_ips, None
    step, _ = build(args, parallel=False)
    serial_ips, loss = run_steps(step, images, labels, args, np.random.default_rng(1))
    print(f"serial: {serial_ips:.1f} images/s, last loss {loss:.3f}", flush=True)
    print(f"speedup: {parallel_ips / serial_ips:.2f}x on {n_parallel} ranks", flush=True)
    return parallel_ips, serial_ips


if __name__ == "__main__":
    main()
