"""ResNet-14-small training images/s: synk 2 ranks vs. serial PyTensor (1 and 2 threads) vs. torch.

    python bench/resnet.py [--mode JAX] [--steps 20] [--no-torch]

One run measures, on the same model (the demo's bottleneck ResNet, width 8,
32x32 images, batch 64, momentum SGD) and prints the ratios side by side:
synk on every core, the serial twin with BLAS limited to 1 and to 2 threads,
and the same network in torch with 1 thread, 2 threads and
DistributedDataParallel (gloo, one process per core, 1 thread each).
Compilation is excluded (warm-up steps first).
"""

import argparse
import importlib.util
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "train_resnet", os.path.join(HERE, "..", "demos", "resnet", "train_resnet.py"))
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)


def synk_figures(args):
    import threadpoolctl

    import synkhronos as synk

    dargs = demo.parse_args(["--steps", str(args.steps), "--batch-size", str(args.batch_size)]
                            + (["--mode", args.mode] if args.mode else []))
    rng = np.random.default_rng(0)
    images = rng.standard_normal((dargs.n_images, 32, 32, 3), dtype=np.float32)
    labels = rng.integers(0, 10, dargs.n_images)
    n = synk.fork()
    step, _ = demo.build(dargs, parallel=True)
    synk.distribute()
    par, _ = demo.run_steps(step, synk.data(images), synk.data(labels), dargs,
                            np.random.default_rng(1))
    synk.close()
    out = {f"synk {n} ranks": par}
    step, _ = demo.build(dargs, parallel=False, bn_groups=n)
    for threads in (1, 2):
        with threadpoolctl.threadpool_limits(threads):
            ips, _ = demo.run_steps(step, images, labels, dargs, np.random.default_rng(1))
        out[f"serial {threads} thread(s)"] = ips
    return out


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


def torch_steps(model, batch, steps, warmup=2):
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return steps * batch / (time.perf_counter() - t0)


def _ddp_worker(rank, world, batch, steps, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch_model())
    ips = torch_steps(model, batch // world, steps) * world
    if rank == 0:
        queue.put(ips)
    dist.destroy_process_group()


def torch_figures(args):
    import torch
    import torch.multiprocessing as mp

    out = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        out[f"torch {threads} thread(s)"] = torch_steps(torch_model(), args.batch_size,
                                                        args.steps)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    world = len(os.sched_getaffinity(0))
    procs = [ctx.Process(target=_ddp_worker, args=(r, world, args.batch_size, args.steps, queue))
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
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args()
    print(f"load before: {os.getloadavg()}", flush=True)
    figures = synk_figures(args)
    if not args.no_torch:
        figures.update(torch_figures(args))
    print(f"load after: {os.getloadavg()}", flush=True)
    base = figures["serial 1 thread(s)"]
    print(f"{'run':<28}{'images/s':>10}{'vs serial 1 thread':>20}")
    for name, ips in figures.items():
        print(f"{name:<28}{ips:>10.0f}{ips / base:>19.2f}x")


if __name__ == "__main__":
    sys.exit(main())
