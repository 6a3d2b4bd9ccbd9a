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
norm, as the original) and each rank keeps its own running statistics; one
line averages them over the ranks (done here after training, at the end of an
"epoch")::

    synk.all_reduce(L.batch_norm_stats(model.bns), "avg")

The serial twin then trains the same network in this process with plain
PyTensor, its batch norm computing statistics over the same row groups as the
ranks (``n_groups``), so both follow the same loss trajectory; images/s of
both, the speedup and the largest loss difference are printed.  Timed steps
exclude compilation (warm-up steps run first).

Convolution and pooling are single Ops (``synkhronos.extensions.ops``), so the
same script runs in CPU mode (Numba kernels) and with ``--mode JAX`` (XLA;
cuDNN on a GPU).  Compiled code is cached on disk, so later runs of the same
configuration start faster.
"""

import argparse
import time

import numpy as np
import pytensor
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
    p.add_argument("--mode", default=None,
                   help="PyTensor mode of every function, e.g. JAX (default: the rank's mode)")
    return p.parse_args(argv)


class ResNet:
    """The bottleneck ResNet; ``forward(x)`` builds the graph, ``params`` are trained.

    Batch-norm layers record their running-statistics updates in training-mode
    calls; ``bn_updates()`` returns them for the training function.
    """

    def __init__(self, depth, width, n_classes, seed=0, bn_groups=1):
        rng = np.random.default_rng(seed)
        self.bn_groups = bn_groups
        self.stem = L.Conv2D(3, width, 7, stride=2, pad=3, rng=rng, bias=False, name="stem")
        self.stem_bn = L.BatchNorm(width, name="stem.bn", n_groups=bn_groups)
        self.blocks = []
        n_in = width
        for stage, n_blocks in enumerate(BLOCKS[depth]):
            inner = width * 2 ** stage
            for b in range(n_blocks):
                stride = 2 if (b == 0 and stage > 0) else 1
                self.blocks.append(self._block(n_in, inner, stride, rng, f"s{stage}b{b}",
                                               bn_groups))
                n_in = 4 * inner
        self.fc = L.Dense(n_in, n_classes, rng, init="glorot", name="fc")
        self.bns = [self.stem_bn] + [bn for blk in self.blocks for _, bn in blk["layers"]] + \
            [blk["short"][1] for blk in self.blocks if blk["short"]]
        convs = [self.stem] + [c for blk in self.blocks for c, _ in blk["layers"]] + \
            [blk["short"][0] for blk in self.blocks if blk["short"]]
        self.params = [p for layer in convs + self.bns + [self.fc] for p in layer.params]

    @staticmethod
    def _block(n_in, inner, stride, rng, name, bn_groups):
        def bn(n, suffix):
            return L.BatchNorm(n, name=f"{name}.{suffix}", n_groups=bn_groups)

        layers = [
            (L.Conv2D(n_in, inner, 1, rng=rng, bias=False, name=f"{name}.c1"), bn(inner, "bn1")),
            (L.Conv2D(inner, inner, 3, stride=stride, pad=1, rng=rng, bias=False, name=f"{name}.c2"),
             bn(inner, "bn2")),
            (L.Conv2D(inner, 4 * inner, 1, rng=rng, bias=False, name=f"{name}.c3"),
             bn(4 * inner, "bn3")),
        ]
        short = None
        if stride != 1 or n_in != 4 * inner:
            short = (L.Conv2D(n_in, 4 * inner, 1, stride=stride, rng=rng, bias=False,
                              name=f"{name}.short"),
                     bn(4 * inner, "short_bn"))
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


def build(args, parallel, bn_groups=1):
    """Return (train step, model) for the data-parallel (after fork) or serial run."""
    x = pt.tensor4("x", shape=(None, args.image_size, args.image_size, 3))
    y = pt.lvector("y")
    model = ResNet(args.depth, args.width, args.classes, args.seed, bn_groups)
    loss = L.softmax_cross_entropy(model.forward(x), y).mean()
    make = make_train_function if parallel else make_serial_train_function
    kwargs = {} if args.mode is None else {"mode": args.mode}
    step = make(loss, model.params, x, y, update_rule="momentum",
                update_kwargs={"learning_rate": args.learning_rate, "momentum": 0.9},
                extra_updates=model.bn_updates(), **kwargs)
    return step, model


def run_steps(step, x_data, y_data, args, rng, t_start=None):
    """Run warm-up then timed steps on random minibatches; return (images/s, losses)."""
    n = len(x_data)
    losses = []
    for _ in range(args.warmup):
        losses.append(float(step(x_data, y_data, batch=rng.choice(n, args.batch_size,
                                                                  replace=False))))
    if t_start is not None:
        print(f"first timed step starts {time.perf_counter() - t_start:.1f} s after start",
              flush=True)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        losses.append(float(step(x_data, y_data, batch=rng.choice(n, args.batch_size,
                                                                  replace=False))))
    dt = time.perf_counter() - t0
    return args.steps * args.batch_size / dt, losses


def main(argv=None):
    t_start = time.perf_counter()
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    images = rng.standard_normal((args.n_images, args.image_size, args.image_size, 3),
                                 dtype=np.float32).astype(pytensor.config.floatX)
    labels = rng.integers(0, args.classes, args.n_images)

    n_parallel = synk.fork(args.n_parallel)
    t0 = time.perf_counter()
    step, model = build(args, parallel=True)
    synk.distribute()
    n_values = sum(p.get_value(borrow=True).size for p in model.params)
    print(f"ResNet-{args.depth}: width {args.width}, {args.image_size}x{args.image_size} images, "
          f"{args.classes} classes, {n_values / 1e6:.2f} M parameters; built in "
          f"{time.perf_counter() - t0:.1f} s; {n_parallel} ranks; mode {args.mode or 'default'}",
          flush=True)
    x_data, y_data = synk.data(images), synk.data(labels)
    t0 = time.perf_counter()
    parallel_ips, losses = run_steps(step, x_data, y_data, args, np.random.default_rng(1), t_start)
    print(f"data-parallel ({n_parallel} ranks): {parallel_ips:.1f} images/s, last loss "
          f"{losses[-1]:.4f} ({time.perf_counter() - t0:.1f} s with warm-up)", flush=True)
    # End of an "epoch": every rank's batch-norm running statistics become their average.
    synk.all_reduce(L.batch_norm_stats(model.bns), "avg")
    bn_mean = model.stem_bn.mean.get_value()
    synk.close()

    if args.no_serial:
        return parallel_ips, None
    # The serial twin normalizes over the same row groups as the ranks: the same trajectory.
    step, serial_model = build(args, parallel=False, bn_groups=n_parallel)
    serial_ips, serial_losses = run_steps(step, images, labels, args, np.random.default_rng(1))
    print(f"serial: {serial_ips:.1f} images/s, last loss {serial_losses[-1]:.4f}", flush=True)
    print(f"speedup: {parallel_ips / serial_ips:.2f}x on {n_parallel} ranks", flush=True)
    diff = np.max(np.abs(np.subtract(losses, serial_losses)))
    bn_diff = np.max(np.abs(bn_mean - np.asarray(serial_model.stem_bn.mean.get_value())))
    print(f"loss trajectories ({len(losses)} steps): largest difference {diff:.2e}; "
          f"averaged batch-norm statistics differ by {bn_diff:.2e}", flush=True)
    return parallel_ips, serial_ips


if __name__ == "__main__":
    main()
