"""GPU mode on one GPU: call overhead, NCCL all_reduce, ResNet images/s, two ranks sharing.

Prints, in one run on a machine with an NVIDIA GPU:
  1. an MLP training step (784-1024-1024-10, batch 512, SGD, float32) as a synk
     function on 1 GPU against the bare PyTensor JAX function (target: under 5%
     overhead);
  2. all_reduce latency and bandwidth through NCCL on that rank (a one-rank
     communicator), next to the host path (nccl=False) and a bare CuPy NCCL call;
  3. the ResNet demo's images/s on 1 GPU (demos/resnet/train_resnet.py, if present);
  4. two ranks sharing the GPU with nccl=False: results checked against NumPy.

Without a GPU it says so and exits with status 0.  Needs synkhronos[gpu].

Usage: python bench/gpu.py [--steps N] [--skip-resnet] [--profile]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LAYERS = (784, 1024, 1024, 10)
BATCH = 512
N_DATA = 16 * BATCH
LR = 0.01
SIZES = [("4 B", 1), ("4 KB", 1 << 10), ("1 MB", 1 << 18), ("16 MB", 1 << 22),
         ("64 MB", 1 << 24), ("256 MB", 1 << 26)]   # float32 elements


def median_time(fn, n, repeats=5):
    """Median over ``repeats`` of the mean seconds per call over ``n`` calls."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def fmt(seconds):
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def build_mlp(rng):
    import pytensor
    import pytensor.tensor as pt

    params = []
    for i, (n_in, n_out) in enumerate(zip(LAYERS[:-1], LAYERS[1:])):
        w = rng.normal(0, np.sqrt(2.0 / n_in), (n_in, n_out)).astype("float32")
        params.append(pytensor.shared(w, name=f"W{i}"))
        params.append(pytensor.shared(np.zeros(n_out, "float32"), name=f"b{i}"))
    x = pt.matrix("x", dtype="float32")
    y = pt.matrix("y", dtype="float32")   # one-hot: PyTensor's JAX arange overflows on indices
    h = x
    for i in range(0, len(params) - 2, 2):
        h = pt.maximum(h @ params[i] + params[i + 1], 0)
    logits = h @ params[-2] + params[-1]
    loss = -pt.mean(pt.sum(y * pt.special.log_softmax(logits, axis=-1), axis=-1))
    grads = pytensor.grad(loss, params)
    return x, y, loss, [(p, p - LR * g) for p, g in zip(params, grads)]


def build():
    """Every synk function of parts 1 and 2: one distribute() per fork."""
    import pytensor

    import synkhronos as synk

    x, y, loss, updates = build_mlp(np.random.default_rng(0))
    f = synk.function([x, y], loss, updates=updates)          # GPU mode: JAX
    shareds = [pytensor.shared(np.ones(n, "float32"), name=f"v{n}") for _, n in SIZES]
    synk.function([], sum(s.sum() for s in shareds))
    synk.distribute()
    return f, shareds


def mlp_overhead(f, steps, profile=False):
    """Part 1: the synk step on 1 GPU vs the bare PyTensor JAX step; both in this process."""
    import pytensor

    import synkhronos as synk

    rng = np.random.default_rng(1)
    X = rng.standard_normal((N_DATA, LAYERS[0])).astype("float32")
    Y = np.eye(LAYERS[-1], dtype="float32")[rng.integers(0, LAYERS[-1], N_DATA)]
    dx, dy = synk.data(X), synk.data(Y)
    xb, yb, loss_b, updates_b = build_mlp(np.random.default_rng(0))
    bare = pytensor.function([xb, yb], loss_b, updates=updates_b, mode="JAX")
    k = [0]

    def synk_step():
        lo = (k[0] % (N_DATA // BATCH)) * BATCH
        k[0] += 1
        f(dx, dy, batch=slice(lo, lo + BATCH))              # returns a host float: synced

    def bare_step():
        lo = (k[0] % (N_DATA // BATCH)) * BATCH
        k[0] += 1
        float(np.asarray(bare(X[lo:lo + BATCH], Y[lo:lo + BATCH])))  # the same host copy

    for _ in range(5):                                       # compile, warm up
        synk_step()
        bare_step()
    # Interleaved repeats, so drifts (clocks, other jobs) hit both alike.
    t_synk, t_bare = [], []
    for _ in range(5):
        t_synk.append(median_time(synk_step, steps, repeats=1))
        t_bare.append(median_time(bare_step, steps, repeats=1))
    ts, tb = statistics.median(t_synk), statistics.median(t_bare)
    print("\n## 1. MLP training step on 1 GPU (784-1024-1024-10, batch 512, float32)\n")
    print("| function | per step | samples/s |")
    print("|---|---|---|")
    print(f"| bare PyTensor, mode=JAX | {fmt(tb)} | {BATCH / tb:,.0f} |")
    print(f"| synk.function, 1 rank | {fmt(ts)} | {BATCH / ts:,.0f} |")
    print(f"\nsynk overhead: {100 * (ts / tb - 1):+.1f}% (target: under 5%)")
    if profile:   # where the synk step's extra time goes: the master is the one rank
        print_profile(synk_step, 200, "synk steps", lines=25)
        print_profile(synk_step, 200, "synk steps", sort="cumulative", lines=40)
        print_profile(bare_step, 200, "bare steps", sort="cumulative", lines=20)


def print_profile(fn, n, title, sort="tottime", lines=22):
    """cProfile ``n`` calls of ``fn``; print the top ``lines`` by ``sort``."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(lambda: [fn() for _ in range(n)])
    print(f"\ncProfile of {n} {title}, by {sort}:\n```")
    pstats.Stats(prof, stream=sys.stdout).sort_stats(sort).print_stats(lines)
    print("```")


def pieces(cupy):
    """What an all_reduce of 4 B is made of on this GPU: each hand-over, timed alone."""
    import jax
    import jax.numpy as jnp

    host = np.ones(1, "float32")
    j = jnp.ones(1, "float32").block_until_ready()
    c = cupy.ones(1, "float32")
    stream = cupy.cuda.Stream(non_blocking=True)

    def fetched():
        r = j + 0
        r.copy_to_host_async()
        r.block_until_ready()
        np.asarray(r)

    def put_copy():
        jnp.array(host, copy=True).block_until_ready()

    def put_device():
        jax.device_put(host).block_until_ready()

    def put_noblock():
        jax.device_put(host)

    def in_stream(fn):
        def run():
            with stream:
                fn()
        return run

    steps = [
        ("np.asarray(jax array) (device to host)", lambda: np.asarray(j + 0)),
        ("jax array + 0, block_until_ready", lambda: (j + 0).block_until_ready()),
        ("jax array + 0, copy_to_host_async, block, np.asarray", fetched),
        ("block_until_ready on a ready array", lambda: j.block_until_ready()),
        ("jnp.array(host, copy=True) + block", put_copy),
        ("jax.device_put(host) + block", put_device),
        ("jax.device_put(host), no block", put_noblock),
        ("cupy.from_dlpack(jax array)", lambda: cupy.from_dlpack(j)),
        ("cupy.from_dlpack(jax array) in a stream", in_stream(lambda: cupy.from_dlpack(j))),
        ("jnp.from_dlpack(cupy array) + block", lambda: jnp.from_dlpack(c).block_until_ready()),
        ("jnp.from_dlpack(cupy array), no block", lambda: jnp.from_dlpack(c)),
        ("cupy.empty(1) in a stream", in_stream(lambda: cupy.empty(1, "float32"))),
        ("cupy array .get()", lambda: c.get()),
        ("cupy.asarray(host) in a stream", in_stream(lambda: cupy.asarray(host))),
        ("stream.done", lambda: stream.done),
    ]
    print("\n| piece (4 B, float32) | us |\n|---|---|")
    for label, fn in steps:
        try:
            for _ in range(20):
                fn()
            print(f"| {label} | {median_time(fn, 200) * 1e6:.1f} |")
        except Exception as exc:  # noqa: BLE001 - a piece this stack lacks: say so, go on
            print(f"| {label} | failed: {type(exc).__name__}: {exc} |")


def nccl_all_reduce(shareds, profile=False):
    """Part 2: all_reduce on one rank through NCCL, the host path, and bare CuPy NCCL."""
    import synkhronos as synk
    from synkhronos.runtime import devices as gpu
    from synkhronos.runtime.state import get_runtime

    print("\n## 2. all_reduce on one rank, float32, op sum\n")
    rt = get_runtime()
    try:
        cupy, nccl = gpu.import_cupy()
    except synk.BackendUnavailableError as exc:
        print(f"not measured: {exc}")
        return
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    alone = {}
    for label, n in SIZES[:1]:    # one rank gives back its inputs: no GPU work at all
        s = shareds[0]
        alone[label] = median_time(lambda: synk.all_reduce(s, "sum"), 200)
    print(f"one rank, 4 B, as a program on 1 GPU runs it: {fmt(alone['4 B'])}\n")
    rt.backend.nccl_alone = True  # below: the NCCL path itself, on a one-rank communicator
    stream = cupy.cuda.Stream(non_blocking=True)
    print("| size | NCCL via synk | host path (nccl=False) | bare CuPy NCCL | GB/s (synk NCCL) |")
    print("|---|---|---|---|---|")
    for (label, n), s in zip(SIZES, shareds):
        calls = 200 if n < (1 << 20) else 20
        t_nccl = median_time(lambda: synk.all_reduce(s, "sum"), calls)
        t_host = median_time(lambda: synk.all_reduce(s, "sum", nccl=False), calls)
        a = cupy.ones(n, "float32")
        b = cupy.empty_like(a)

        def bare():
            comm.allReduce(a.data.ptr, b.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           stream.ptr)
            stream.synchronize()
        t_bare = median_time(bare, calls)
        print(f"| {label} | {fmt(t_nccl)} | {fmt(t_host)} | {fmt(t_bare)} | "
              f"{4 * n / t_nccl / 1e9:.2f} |")
    assert rt.backend.device_arrays and rt.backend.comm is not None, "NCCL was not used"
    comm.destroy()
    if profile:   # where the fixed cost of a small all_reduce goes
        small = shareds[0]
        print_profile(lambda: synk.all_reduce(small, "sum"), 500, "all_reduce of 4 B via NCCL")
        print_profile(lambda: synk.all_reduce(small, "sum"), 500, "all_reduce of 4 B via NCCL",
                      sort="cumulative", lines=30)
        print_profile(lambda: synk.all_reduce(small, "sum", nccl=False), 500,
                      "all_reduce of 4 B, nccl=False")
        pieces(cupy)


def resnet():
    """Part 3: the ResNet demo on 1 GPU, in its own process."""
    demo = ROOT / "demos" / "resnet" / "train_resnet.py"
    print("\n## 3. ResNet demo on 1 GPU\n")
    if not demo.exists():
        print("not measured: demos/resnet/train_resnet.py is not there")
        return
    args = ["--n-parallel", "1", "--no-serial", "--depth", "50", "--width", "64",
            "--image-size", "224", "--classes", "1000", "--batch-size", "64",
            "--steps", "20", "--warmup", "3", "--n-images", "512"]
    out = subprocess.run([sys.executable, str(demo), *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=3600)
    text = out.stdout + out.stderr
    m = re.search(r"data-parallel \(1 ranks?\): ([0-9.]+) images/s", text)
    if out.returncode != 0 or not m:
        print(f"failed (status {out.returncode}):\n{text[-3000:]}")
        return
    print(f"ResNet-50, 224x224, batch 64: {float(m.group(1)):.1f} images/s "
          f"(python demos/resnet/train_resnet.py {' '.join(args)})")


def shared_gpu():
    """Part 4 (own process): two ranks on one GPU, nccl=False; results checked."""
    import pytensor
    import pytensor.tensor as pt

    import synkhronos as synk

    n = synk.fork(2, use_gpu=True)
    rng = np.random.default_rng(1)
    v = pytensor.shared(np.zeros(1000, "float32"), name="v")
    x = pt.matrix("x", dtype="float32")
    f = synk.function([x], [(x.sum(axis=0) + v.sum(), "sum"), (x * 2, "gather")])
    synk.distribute()
    vals = [rng.standard_normal(1000).astype("float32") for _ in range(n)]
    for r in range(n):
        synk.set_value(r, v, vals[r])
    synk.all_reduce(v, "avg", nccl=False)
    ok = all(np.allclose(synk.get_value(r, v), np.mean(vals, axis=0), rtol=1e-5)
             for r in range(n))
    synk.broadcast(v, np.arange(1000, dtype="float32"), nccl=False)
    ok &= all(np.array_equal(synk.get_value(r, v), np.arange(1000)) for r in range(n))
    X = rng.standard_normal((10, 4)).astype("float32")
    total, doubled = f(X)
    ok &= np.allclose(total, X.sum(axis=0) + n * np.arange(1000).sum(), rtol=1e-5)
    ok &= np.allclose(doubled, 2 * X)
    g = synk.gather(v, nccl=False)
    ok &= g.shape == (n, 1000)
    synk.close()
    print(f"2 ranks on one GPU, nccl=False: all_reduce, broadcast, a call and gather "
          f"{'match NumPy' if ok else 'DO NOT match NumPy'}")
    return 0 if ok else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="timed MLP steps per repeat")
    p.add_argument("--skip-resnet", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the synk MLP step and a 4 B all_reduce; time its pieces")
    p.add_argument("--part", choices=["shared"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part == "shared":
        return shared_gpu()

    from synkhronos.runtime import devices as gpu

    n_gpus = gpu.count_gpus()
    if n_gpus == 0:
        print("bench/gpu.py: no NVIDIA GPU found (NVML / nvidia-smi); nothing to measure.")
        return 0
    import synkhronos as synk

    # Part 4 first, in its own process: GPU mode forks only from a process where CUDA
    # never started, and this one's JAX would then hold most of the GPU's memory.
    out = subprocess.run([sys.executable, __file__, "--part", "shared"], capture_output=True,
                         text=True, timeout=1800, env=dict(os.environ))
    # Its result line is on stdout; XLA's allocator logs (long) go to stderr.
    shared_result = out.stdout.strip()[-3000:]
    if out.returncode != 0:
        shared_result += "\n" + out.stderr.strip()[-3000:]
    shared_status = out.returncode
    synk.fork(1)                                   # GPU mode, before anything starts CUDA
    import jax

    platform = jax.devices()[0].platform
    if platform != "gpu":
        synk.close()
        print(f"bench/gpu.py: JAX runs on {platform}, not on the GPU: "
              "pip install synkhronos[gpu] (jax[cuda12]).")
        return 0
    print(f"# bench/gpu.py on {jax.devices()[0].device_kind} ({n_gpus} GPU(s) present, "
          f"using 1); jax {jax.__version__}")
    f, shareds = build()
    mlp_overhead(f, args.steps, args.profile)
    nccl_all_reduce(shareds, args.profile)
    synk.close()
    if not args.skip_resnet:
        resnet()
    print("\n## 4. Two ranks sharing the GPU, nccl=False (run first)\n")
    print(shared_result)
    return shared_status


if __name__ == "__main__":
    sys.exit(main())
