"""Call overhead, a 4-byte all_reduce and MLP training throughput against their baselines, in one run.

Prints:
  1. latency of a synk call on tiny inputs (2 ranks) against the bare PyTensor call;
  2. a 4-byte ``synk.all_reduce`` (2 ranks) against MPICH's ``Allreduce`` of 4 bytes
     between 2 processes (mpi4py, where mpiexec is installed);
  3. samples/s of an MLP (784-1024-1024-10, batch 512, SGD) trained data-parallel on
     2 ranks against the serial PyTensor step with 1 and with 2 BLAS threads.

``--markdown`` prints the figures as the table of the README.

Usage: python bench/call_overhead.py [--steps N] [--calls N] [--markdown]
"""

import argparse
import os
import platform
import statistics
import time

import numpy as np
import pytensor
import pytensor.tensor as pt
from threadpoolctl import threadpool_limits

import synkhronos as synk

from common import BATCH, LAYERS, LR, N_DATA, build_mlp, mpich_4b


def timed_calls(fn, n, repeats=7):
    """Median over ``repeats`` of the mean seconds per call over ``n`` calls."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def paired_calls(fns, n, rounds=9):
    """Per function, the mean seconds per call in each of ``rounds`` rounds of ``n`` calls.

    The functions take turns round by round, so a machine that slows down
    mid-run slows them alike.
    """
    out = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, out):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t0) / n)
    return out


def two_at_once(rng, data_x, data_y, steps):
    """The machine's own ceiling: two processes, one per core, each running the serial step
    on half the batch at the same time (no communication); samples/s of the pair."""
    x, y, params, loss = build_mlp(rng)
    grads = pytensor.grad(loss, params)
    step = pytensor.function([x, y], loss, updates=[(p, p - LR * g) for p, g in zip(params, grads)])
    half = BATCH // 2
    r, w = os.pipe()
    pids = []
    for core in sorted(os.sched_getaffinity(0))[:2]:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            try:
                os.sched_setaffinity(0, {core})
                with threadpool_limits(limits=1):
                    def one():
                        i = rng.integers(0, N_DATA, half)
                        step(data_x[i], data_y[i])
                    one()
                    os.write(w, f"{timed_calls(one, steps, repeats=3)}\n".encode())
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(w)
    times = [float(v) for v in os.read(r, 4096).decode().split()]
    os.close(r)
    return BATCH / max(times)


def serial_throughput(rng, data_x, data_y, steps, threads):
    x, y, params, loss = build_mlp(rng)
    grads = pytensor.grad(loss, params)
    step = pytensor.function([x, y], loss, updates=[(p, p - LR * g) for p, g in zip(params, grads)])
    idx = rng.integers(0, N_DATA, BATCH)
    step(data_x[idx], data_y[idx])  # compile and load every library first
    with threadpool_limits(limits=threads):
        def one():
            i = rng.integers(0, N_DATA, BATCH)
            step(data_x[i], data_y[i])
        one()
        sec = timed_calls(one, steps, repeats=3)
    return BATCH / sec


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="training steps per repeat")
    parser.add_argument("--calls", type=int, default=4000, help="tiny calls per round")
    parser.add_argument("--markdown", action="store_true", help="print the README's table")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    data_x = rng.normal(size=(N_DATA, LAYERS[0])).astype("float32")
    data_y = rng.integers(0, LAYERS[-1], N_DATA).astype("int32")

    # Serial baselines before fork() (which limits every process to one BLAS thread
    # and pins it to a core) and again after close(): their mean stands for the run.
    serial1 = [serial_throughput(rng, data_x, data_y, args.steps, 1)]
    serial2 = [serial_throughput(rng, data_x, data_y, args.steps, 2)]

    tiny_x = pt.matrix("tx")
    bare = pytensor.function([tiny_x], pt.sum(tiny_x))
    tiny = rng.normal(size=(8, 4)).astype("float32")

    synk.fork(2, use_gpu=False)
    f_tiny = synk.function([tiny_x], pt.sum(tiny_x))
    x, y, params, loss = build_mlp(np.random.default_rng(1))
    grads = pytensor.grad(loss, params)
    sizes = [int(np.prod(p.get_value().shape)) for p in params]
    flat = pytensor.shared(np.zeros(sum(sizes), "float32"), name="flat_grad")
    # Each gradient written into the flat vector in place, as make_flat_grad does: the
    # vector keeps its memory, which the all-reduce reads where it is.
    new, start = flat, 0
    for g, n in zip(grads, sizes):
        new = pt.set_subtensor(new[start:start + n], g.flatten())
        start += n
    f_grad = synk.function([x, y], loss, updates=[(flat, new)])
    upd, offset = [], 0
    for p, n in zip(params, sizes):
        upd.append((p, p - LR * flat[offset:offset + n].reshape(p.shape)))
        offset += n
    f_update = synk.function([], updates=upd)
    s4 = pytensor.shared(np.ones(1, "float32"), name="s4")
    synk.function([], s4.sum())
    synk.distribute()

    tiny_d = synk.data(tiny)
    for _ in range(1000):
        bare(tiny)
        f_tiny(tiny_d)
        synk.all_reduce(s4, op="sum")
    bare_t, synk_t = paired_calls([lambda: bare(tiny), lambda: f_tiny(tiny_d)], args.calls)
    ar_t = paired_calls([lambda: synk.all_reduce(s4, op="sum")], args.calls)[0]

    xd = synk.data(data_x)
    yd = synk.data(data_y)

    def train_step():
        idx = rng.integers(0, N_DATA, BATCH)
        f_grad(xd, yd, batch=idx)
        synk.all_reduce(flat, op="avg")
        f_update()
    train_step()
    synk_tp = BATCH / timed_calls(train_step, args.steps, repeats=3)
    fused = f_grad.then_all_reduce(flat, "avg", f_update)

    def fused_step():
        fused(xd, yd, batch=rng.integers(0, N_DATA, BATCH))
    fused_step()
    fused_tp = BATCH / timed_calls(fused_step, args.steps, repeats=3)
    synk.close()
    serial1.append(serial_throughput(rng, data_x, data_y, args.steps, 1))
    serial2.append(serial_throughput(rng, data_x, data_y, args.steps, 2))
    ceiling = two_at_once(rng, data_x, data_y, args.steps)
    mpi = mpich_4b(args.calls * 5, 9)

    s1, s2 = statistics.mean(serial1), statistics.mean(serial2)
    bare_med, synk_med = statistics.median(bare_t) * 1e6, statistics.median(synk_t) * 1e6
    ar_med = statistics.median(ar_t) * 1e6
    mpi_med = None if mpi is None else statistics.median(mpi)
    if args.markdown:
        print(f"# bench/call_overhead.py --markdown, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"load {os.getloadavg()[0]:.2f}")
        print(f"| figure (2 ranks, {time.strftime('%Y-%m-%d', time.gmtime())}, "
              f"{os.cpu_count()} cores) | synkhronos | baseline, same run | ratio |")
        print("|---|---|---|---|")
        print(f"| tiny call, `x.sum()` on 8x4 float32 | {synk_med:.1f} us | bare PyTensor call "
              f"{bare_med:.1f} us | {synk_med / bare_med:.2f}x |")
        if mpi_med is not None:
            print(f"| `all_reduce` of 4 bytes | {ar_med:.1f} us | MPICH `Allreduce`, 2 processes "
                  f"{mpi_med:.1f} us | {ar_med / mpi_med:.2f}x |")
        print(f"| MLP 784-1024-1024-10 training, batch 512 | {fused_tp:.0f} samples/s | serial, "
              f"1 BLAS thread {s1:.0f} | {fused_tp / s1:.2f}x |")
        print(f"| the same | | serial, 2 BLAS threads {s2:.0f} | {fused_tp / s2:.2f}x |")
        print(f"| the same | | two serial processes at once, half the batch each (the "
              f"machine's ceiling, {ceiling / s1:.2f}x) {ceiling:.0f} | {fused_tp / ceiling:.2f}x |")
        return
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, "
          f"pytensor {pytensor.__version__}, load {os.getloadavg()[0]:.2f}")
    print("\n== call latency, tiny input (8x4 float32, sum), 2 ranks ==")
    print("                         best    median  (of 9 alternating rounds)")
    for label, t in (("bare pytensor call", bare_t), ("synk call (2 ranks)", synk_t)):
        print(f"{label:22s} {min(t) * 1e6:6.1f} us {statistics.median(t) * 1e6:6.1f} us")
    best = (min(synk_t) - min(bare_t)) * 1e6
    med = (statistics.median(synk_t) - statistics.median(bare_t)) * 1e6
    print(f"{'overhead':22s} {best:6.1f} us {med:6.1f} us")
    print(f"{'ratio':22s} {min(synk_t) / min(bare_t):6.2f}x   {synk_med / bare_med:6.2f}x  "
          "(target <= 2.0x, aim 1.5x)")
    print("\n== all_reduce, 4 bytes, 2 ranks ==")
    print(f"{'synk.all_reduce':22s} {min(ar_t) * 1e6:6.2f} us {ar_med:6.2f} us")
    if mpi is not None:
        print(f"{'MPICH Allreduce':22s} {min(mpi):6.2f} us {mpi_med:6.2f} us")
        print(f"{'ratio':22s} {min(ar_t) * 1e6 / min(mpi):6.2f}x   {ar_med / mpi_med:6.2f}x  "
              "(target <= 1.5x)")
    print(f"\n== MLP {'-'.join(map(str, LAYERS))}, batch {BATCH}, SGD: samples/s ==")
    print(f"serial, 1 BLAS thread   {s1:8.0f}   (before fork {serial1[0]:.0f}, after close "
          f"{serial1[1]:.0f})")
    print(f"serial, 2 BLAS threads  {s2:8.0f}   (before fork {serial2[0]:.0f}, after close "
          f"{serial2[1]:.0f})")
    print(f"synk, 2 ranks, 3 cmds   {synk_tp:8.0f}   (f_grad, all_reduce, f_update)")
    print(f"synk, 2 ranks, fused    {fused_tp:8.0f}   (one command: then_all_reduce)")
    print(f"fused vs 1 thread       {fused_tp / s1:8.2f}x  (target >= 1.95x)")
    print(f"fused vs 2 threads      {fused_tp / s2:8.2f}x  (target >= 1.3x)")
    print(f"two serial processes    {ceiling:8.0f}   (one per core, half the batch each, no "
          f"communication: {ceiling / s1:.2f}x the serial step, the machine's ceiling)")
    print(f"fused vs that ceiling   {fused_tp / ceiling:8.2f}x")


if __name__ == "__main__":
    main()
