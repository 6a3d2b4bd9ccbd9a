"""ResNet-14-small training images/s: synk 2 ranks vs. serial PyTensor (1 and 2 threads) vs. torch.

    python bench/resnet.py [--mode JAX] [--steps 20] [--no-torch]

One run measures, on the same model (the demo's bottleneck ResNet, width 8,
32x32 images, batch 64, momentum SGD) and prints the ratios side by side:
synk on every core, the serial twin with BLAS limited to 1 and to 2 threads,
and the same network in torch with 1 thread, 2 threads and
DistributedDataParallel (gloo, one process per core, 1 thread each).
Compilation is excluded (warm-up steps first).

``--plot PNG`` also runs synk on 1, 2, ... ranks up to the usable cores and
draws the speedup against ranks over the serial twin on one BLAS thread and
on every core's threads, like ``bench/scaling.py``'s MLP picture.  ``make
bench`` runs it small (width 4, 16x16 images, the shapes of the demo test's
tiny ResNet, so a compile cache that test filled is reused): in the default
mode a cold compile of the 32x32 network takes minutes.
"""

import argparse
import os
import sys
import time

import numpy as np

import common

demo = common.demo("resnet/train_resnet.py", "train_resnet")


def synk_figures(args):
    import threadpoolctl

    import synkhronos as synk

    dargs = demo.parse_args(["--steps", str(args.steps), "--batch-size", str(args.batch_size),
                             "--width", str(args.width), "--image-size", str(args.image_size)]
                            + (["--mode", args.mode] if args.mode else []))
    rng = np.random.default_rng(0)
    size = dargs.image_size
    images = rng.standard_normal((dargs.n_images, size, size, 3), dtype=np.float32)
    labels = rng.integers(0, 10, dargs.n_images)
    cores = len(os.sched_getaffinity(0))
    out = {}
    for n_ranks in range(1, cores + 1) if args.plot else [None]:
        n = synk.fork(n_ranks)
        step, _ = demo.build(dargs, parallel=True)
        synk.distribute()
        xd, yd = synk.data(images), synk.data(labels)
        par = max(demo.run_steps(step, xd, yd, dargs, np.random.default_rng(1))[0]
                  for _ in range(args.repeats))
        synk.close()
        out[f"synk {n} rank{'s' if n > 1 else ''}"] = par
    step, _ = demo.build(dargs, parallel=False, bn_groups=n)
    for threads in (1, cores):
        with threadpoolctl.threadpool_limits(threads):
            ips = max(demo.run_steps(step, images, labels, dargs, np.random.default_rng(1))[0]
                      for _ in range(args.repeats))
        out[f"serial {threads} thread(s)"] = ips
    return out


def plot_scaling(figures, args, path):
    """Draw synk's speedup against ranks over the serial twin on 1 and on every core's threads."""
    cores = len(os.sched_getaffinity(0))
    ranks = list(range(1, cores + 1))
    rates = [figures[f"synk {n} rank{'s' if n > 1 else ''}"] for n in ranks]
    one, every = figures["serial 1 thread(s)"], figures[f"serial {cores} thread(s)"]
    common.plot(ranks, {"vs serial, 1 thread": [r / one for r in rates],
                 f"vs serial, {cores} threads": [r / every for r in rates]}, path,
         f"ResNet-14, width {args.width}, {args.image_size}x{args.image_size}, "
         f"batch {args.batch_size}")


def torch_model(width=8, n_classes=10):
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, n_in, inner, stride):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(n_in, inner, 1, bias=False), nn.BatchNorm2d(inner), nn.ReLU(),
                nn.Conv2d(inner, inner, 3, stride, 1, bias=False), nn.BatchNorm2d(inner),
                nn.ReLU(), nn.Conv2d(inner, 4 * inner, 1, bias=False), nn.BatchNorm2d(4 * inner))
            self.short = None
            if stride != 1 or n_in != 4 * inner:
                self.short = nn.Sequential(nn.Conv2d(n_in, 4 * inner, 1, stride, bias=False),
                                           nn.BatchNorm2d(4 * inner))
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.body(x) + (x if self.short is None else self.short(x)))

    layers = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    n_in = width
    for stage in range(4):
        inner = width * 2 ** stage
        layers.append(Block(n_in, inner, 2 if stage else 1))
        n_in = 4 * inner
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(n_in, n_classes)]
    return nn.Sequential(*layers)


def torch_steps(model, batch, steps, size=32, warmup=2):
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 10, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return steps * batch / (time.perf_counter() - t0)


def _ddp_worker(rank, world, batch, steps, width, size, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch_model(width))
    ips = torch_steps(model, batch // world, steps, size) * world
    if rank == 0:
        queue.put(ips)
    dist.destroy_process_group()


def torch_figures(args):
    import torch
    import torch.multiprocessing as mp

    out = {}
    for threads in (1, len(os.sched_getaffinity(0))):
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        out[f"torch {threads} thread(s)"] = torch_steps(torch_model(args.width), args.batch_size,
                                                        args.steps, args.image_size)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = len(os.sched_getaffinity(0))
    procs = [ctx.Process(target=_ddp_worker, args=(r, world, args.batch_size, args.steps,
                                                   args.width, args.image_size, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    out[f"torch DDP gloo {world} procs"] = queue.get(timeout=600)
    for p in procs:
        p.join()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=8, help="channels of the first stage")
    p.add_argument("--image-size", type=int, default=32, help="square image side")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of --steps per synk and serial figure; the fastest counts")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--plot", default=None,
                   help="PNG of the speedup against ranks (runs synk on 1..cores ranks)")
    args = p.parse_args()
    print(f"# ResNet-14, width {args.width}, {args.image_size}x{args.image_size}, batch "
          f"{args.batch_size}, {args.steps} steps x {args.repeats}, "
          f"{len(os.sched_getaffinity(0))} cores, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    print(f"load before: {os.getloadavg()}", flush=True)
    figures = synk_figures(args)
    if not args.no_torch:
        figures.update(torch_figures(args))
    print(f"load after: {os.getloadavg()}", flush=True)
    base = figures["serial 1 thread(s)"]
    print(f"{'run':<28}{'images/s':>10}{'vs serial 1 thread':>20}")
    for name, ips in figures.items():
        print(f"{name:<28}{ips:>10.0f}{ips / base:>19.2f}x")
    if args.plot:
        plot_scaling(figures, args, args.plot)


if __name__ == "__main__":
    sys.exit(main())
