"""What the three MNIST demos share: options, data loading, the model, progress output.

Data: ``--data PATH`` reads MNIST from a directory of the standard IDX files
(``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``, each optionally ``.gz``) or from an ``.npz`` with
``x_train, y_train, x_test, y_test``.  Without it the demos use the 8x8
handwritten digits that ship inside scikit-learn (1797 images; nothing is
downloaded), split 80/20 into train and test sets.
"""

import argparse
import gzip
import os
import struct
import sys
import time

import numpy as np

IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def parse_args(description, argv=None, parallel=True, model="mlp"):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", default=None,
                   help="MNIST IDX directory or .npz file (default: scikit-learn's digits)")
    # Batch 512: each rank's share (256 rows) keeps its core busy for tens of milliseconds
    # per step (the CNN: about 100), so one all-reduce of the gradient (CNN 0.3 M values,
    # MLP 1.1 M) costs little beside it; at 64 rows a step is mostly overhead.
    p.add_argument("--batch-size", type=int, default=512, help="global minibatch size")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--model", choices=("mlp", "cnn"), default=model,
                   help=f"mlp: two hidden layers; cnn: two 3x3 convolutions (32, 64 filters), "
                        f"a 2x2 max-pool and one hidden layer (default: {model})")
    p.add_argument("--hidden", type=int, default=None,
                   help="units per hidden layer (default: 1024 in the mlp, 256 in the cnn)")
    p.add_argument("--mode", default=None,
                   help="PyTensor mode of every function, e.g. NUMBA (default: FAST_COMPILE "
                        "for the cnn, PyTensor's own for the mlp)")
    p.add_argument("--learning-rate", type=float, default=0.002, help="Adam's step size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    if parallel:
        p.add_argument("--n-parallel", type=int, default=None,
                       help="ranks (default: every usable core)")
        p.add_argument("--serial-epochs", type=int, default=3,
                       help="epochs of the serial twin (on 1 and on all BLAS threads) timed "
                            "for the speedup (0: skip)")
    args = p.parse_args(argv)
    if args.hidden is None:
        args.hidden = 256 if args.model == "cnn" else 1024
    if args.mode is None and args.model == "cnn":
        # The conv and pool Ops run their Numba kernels (compiled once, cached on disk)
        # in every mode; PyTensor's default mode also compiles the whole graph with Numba:
        # minutes on a cold cache, to save 5-25% per step here.
        args.mode = "FAST_COMPILE"
    return args


def read_idx(path):
    """Read one IDX file (optionally gzipped) into a NumPy array."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code not in IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file")
    shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=IDX_DTYPES[dtype_code], offset=4 + 4 * ndim)
    return data.reshape(shape)


def _find(directory, stem):
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{directory}: no {stem}[.gz]")


def load_data(path=None, seed=0):
    """Return ``(x_train, y_train, x_test, y_test, name)``: float32 rows in [0, 1], int64 labels."""
    if path is None:
        from sklearn.datasets import load_digits
        digits = load_digits()
        x = (digits.data / 16.0).astype(np.float32)
        y = digits.target.astype(np.int64)
        order = np.random.default_rng(seed).permutation(len(x))
        n_train = int(0.8 * len(x))
        tr, te = order[:n_train], order[n_train:]
        return x[tr], y[tr], x[te], y[te], "scikit-learn digits (8x8)"
    if path.endswith(".npz"):
        with np.load(path) as f:
            parts = [f["x_train"], f["y_train"], f["x_test"], f["y_test"]]
        name = os.path.basename(path)
    else:
        parts = [read_idx(_find(path, s)) for s in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                                                    "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")]
        name = f"MNIST IDX files in {path}"
    x_train, y_train, x_test, y_test = parts

    def images(a):
        a = a.reshape(len(a), -1).astype(np.float32)
        return a / 255.0 if a.max() > 1 else a

    return (images(x_train), y_train.astype(np.int64), images(x_test), y_test.astype(np.int64), name)


def build_mlp(n_in, n_hidden, n_classes, seed):
    """Return ``(forward, params)``: a ReLU MLP with two hidden layers."""
    from synkhronos.extensions import layers as L
    rng = np.random.default_rng(seed)
    layers = [L.Dense(n_in, n_hidden, rng, name="h1"), L.Dense(n_hidden, n_hidden, rng, name="h2"),
              L.Dense(n_hidden, n_classes, rng, init="glorot", name="out")]

    def forward(x):
        h = L.relu(layers[0](x))
        h = L.relu(layers[1](h))
        return layers[2](h)

    return forward, [p for layer in layers for p in layer.params]


def build_cnn(n_in, n_hidden, n_classes, seed, channels=(32, 64)):
    """Return ``(forward, params)``: two 3x3 ReLU convolutions, a 2x2 max-pool, a hidden layer.

    ``forward`` takes the flat rows (square images, one channel) and reshapes them.
    """
    from synkhronos.extensions import layers as L
    side = int(round(n_in ** 0.5))
    if side * side != n_in:
        raise ValueError(f"--model cnn needs square images; got {n_in} pixels")
    rng = np.random.default_rng(seed)
    c1, c2 = channels
    pooled = (side // 2) ** 2 * c2
    layers = [L.Conv2D(1, c1, 3, pad=1, rng=rng, name="c1"),
              L.Conv2D(c1, c2, 3, pad=1, rng=rng, name="c2"),
              L.Dense(pooled, n_hidden, rng, name="h1"),
              L.Dense(n_hidden, n_classes, rng, init="glorot", name="out")]

    def forward(x):
        h = x.reshape((x.shape[0], side, side, 1))
        h = L.relu(layers[0](h))
        h = L.max_pool2d(L.relu(layers[1](h)), 2)
        h = L.relu(layers[2](L.flatten2d(h)))
        return layers[3](h)

    return forward, [p for layer in layers for p in layer.params]


def build_model(args, n_in, n_classes=10):
    """Return ``(forward, params)`` of the model ``--model`` names."""
    build = build_cnn if args.model == "cnn" else build_mlp
    return build(n_in, args.hidden, n_classes, args.seed)


def loss_and_accuracy(forward, x, y):
    """Return the mean cross-entropy loss and the accuracy of ``forward(x)`` on labels ``y``."""
    from synkhronos.extensions import layers as L
    logits = forward(x)
    return L.softmax_cross_entropy(logits, y).mean(), L.accuracy(logits, y)


def batches(n_rows, batch_size, rng):
    """Shuffled index arrays covering ``range(n_rows)``; the last one may be shorter."""
    order = rng.permutation(n_rows)
    return [order[i:i + batch_size] for i in range(0, n_rows, batch_size)]


def progress(iterable, desc, args, total=None):
    if args.no_progress:
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr)


def idle_cores(seconds=0.5):
    """How many of this process's usable cores were idle over ``seconds`` (/proc/stat).

    Other programs on the cores make a speedup meaningless: ranks wait for the
    slowest one at every step.  None where /proc/stat cannot be read.
    """
    cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}

    def snap():
        idle = total = 0
        with open("/proc/stat") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in cpus:
                    v = [int(x) for x in parts[1:9]]
                    idle += v[3] + v[4]          # idle and iowait
                    total += sum(v)
        return idle, total

    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
    except (OSError, ValueError, IndexError):
        return None
    return len(cpus) * (i1 - i0) / max(t1 - t0, 1)


class EpochLog:
    """Prints one line per epoch and keeps the epoch times (compile time excluded).

    Made right before the timed epochs, it first measures how many cores are
    idle (``idle``), so the speedup can say when the machine was busy.
    """

    def __init__(self, label):
        self.label = label
        self.times = []
        self.last_accuracy = None
        self.idle = idle_cores()

    def record(self, epoch, seconds, train_loss, test_loss, test_accuracy):
        self.times.append(seconds)
        self.last_accuracy = test_accuracy
        print(f"[{self.label}] epoch {epoch:3d}  {seconds:6.2f} s  train loss {train_loss:.4f}  "
              f"test loss {test_loss:.4f}  test accuracy {100 * test_accuracy:.2f}%", flush=True)

    @property
    def epoch_time(self):
        return float(np.median(self.times))


def serial_epochs(args, data, n_epochs, label="serial", threads=None):
    """Train the serial twin for ``n_epochs`` in this process; return its EpochLog.

    Same model, initial values, rule and batches as the data-parallel demos, in
    plain PyTensor, so its epoch time is the baseline of the speedup.  ``threads``
    limits the BLAS threads (None: every core's).
    """
    if threads is not None:
        from threadpoolctl import threadpool_limits
        with threadpool_limits(limits=threads):
            return serial_epochs(args, data, n_epochs, label)
    import pytensor.tensor as pt
    from synkhronos.extensions import make_serial_train_function
    import pytensor

    x_train, y_train, x_test, y_test, _ = data
    x = pt.matrix("x")
    y = pt.lvector("y")
    forward, params = build_model(args, x_train.shape[1])
    loss, acc = loss_and_accuracy(forward, x, y)
    step = make_serial_train_function(loss, params, x, y, update_rule="adam",
                                      update_kwargs={"learning_rate": args.learning_rate},
                                      mode=args.mode)
    f_test = pytensor.function([x, y], [loss, acc], mode=args.mode)
    rng = np.random.default_rng(args.seed)
    step(x_train, y_train, batch=np.arange(min(args.batch_size, len(x_train))))  # compile: warm-up
    log = EpochLog(label)
    for epoch in range(1, n_epochs + 1):
        t0 = time.perf_counter()
        losses = [step(x_train, y_train, batch=idx)
                  for idx in progress(batches(len(x_train), args.batch_size, rng), label, args)]
        dt = time.perf_counter() - t0
        test_loss, test_acc = f_test(x_test, y_test)
        log.record(epoch, dt, float(np.mean(losses)), float(test_loss), float(test_acc))
    return log


def finish(params, log, args, data, n_parallel):
    """Check the replicas agree, close synkhronos, train the serial twin and print the speedup."""
    import synkhronos as synk

    # Every rank applied the same updates: the replicas agree.
    for p in params:
        replicas = synk.gather(p, nd_up=1)
        assert np.array_equal(replicas[0], replicas[-1]), p.name
    synk.close()
    print(f"final test accuracy {100 * log.last_accuracy:.2f}%", flush=True)
    if not args.serial_epochs:
        return
    cores = len(os.sched_getaffinity(0))
    one = serial_epochs(args, data, args.serial_epochs, "serial, 1 thread", threads=1)
    every = serial_epochs(args, data, args.serial_epochs, f"serial, {cores} threads")
    report_speedup(log, one, n_parallel, "1 BLAS thread")
    report_speedup(log, every, n_parallel, f"{cores} BLAS threads")
    warn_if_busy([(log, min(n_parallel, cores)), (one, 1), (every, cores)], cores)


def warn_if_busy(phases, cores):
    """Say so when a timed phase began with fewer idle cores than it uses: then the
    speedup measures the other programs as much as synkhronos."""
    busy = [(log.label, log.idle, need) for log, need in phases
            if log is not None and log.idle is not None and log.idle < need - 0.3]
    if not busy:
        seen = [f"{log.label} {log.idle:.1f}" for log, _ in phases
                if log is not None and log.idle is not None]
        print(f"(cores idle before each timed phase: {', '.join(seen)} of {cores})", flush=True)
        return
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for label, idle, need in busy:
        print(f"WARNING: the machine was busy: {idle:.1f} of {cores} cores were idle before the "
              f"'{label}' epochs, which use {need} (load average {load:.2f}); other programs "
              "shared the cores, so the speedups above do not mean much. Run it again on a "
              "quiet machine.", flush=True)


def report_speedup(parallel, serial, n_parallel, how=""):
    """Print the speedup of the data-parallel epochs over the serial twin's (median epochs)."""
    if serial is None or not serial.times:
        return
    speedup = serial.epoch_time / parallel.epoch_time
    on = f" on {how}" if how else ""
    print(f"epoch time: serial{on} {serial.epoch_time:.3f} s, data-parallel on {n_parallel} "
          f"ranks {parallel.epoch_time:.3f} s: speedup {speedup:.2f}x", flush=True)
