"""One training step realized as one plan, or as two: the gradients first, then the
optimizer's update (what DistributedDataParallel does, since it needs the gradients'
values before the update). Issue 31's MNIST convnet recipe (bench_recipes.py's model and
batch) on zyx's default device, rounds alternating between the two ways,
and PyTorch eager in the same process for scale.

Run:  python benches/split_step.py [--rounds 7] [--steps 20]
GPU:  ZYX_DEVICE=cuda python benches/split_step.py

Prints a markdown table of medians (each step ends by reading the loss, as the recipes
do)."""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zyx  # noqa: E402
import zyx.nn.functional as F  # noqa: E402
from bench_conv import _convnet, _mnist_batch  # noqa: E402
from dist_nccl_step import per_step  # noqa: E402


def convnet(lib, ce, device):
    model = _convnet(lib.nn).to(device)
    opt = lib.optim.Adam(model.parameters(), 1e-3)
    xn, yn = _mnist_batch()
    x, y = lib.tensor(xn, device=device), lib.tensor(yn, device=device)
    return model, opt, lambda: ce(model(x), y)


def step_of(lib, setup, split):
    model, opt, loss_fn = setup

    def step():
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        if split:
            lib.realize(*[p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
        return loss.item()
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dev = zyx.get_default_device()
    cases = {}
    for name, make in (("MNIST convnet, Adam", convnet),):
        zyx.manual_seed(0)
        cases[(name, "zyx, one plan")] = step_of(zyx, make(zyx, F.cross_entropy, dev), False)
        zyx.manual_seed(0)
        cases[(name, "zyx, gradients then update")] = step_of(
            zyx, make(zyx, F.cross_entropy, dev), True)
        try:
            import torch
            tdev = "cuda" if dev.type == "cuda" and torch.cuda.is_available() else "cpu"
            torch.manual_seed(0)
            cases[(name, "torch eager")] = step_of(
                torch, make(torch, torch.nn.functional.cross_entropy, tdev), False)
        except ImportError:
            pass
    for fn in cases.values():
        for _ in range(3):
            fn()
    times = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, fn in cases.items():
            times[k].append(per_step(fn, args.steps))
    print(f"zyx on {dev!r}; medians of {args.rounds} rounds x {args.steps} steps")
    print("| recipe | how | median | min |")
    print("| --- | --- | --- | --- |")
    for (name, how), t in times.items():
        print(f"| {name} | {how} | {statistics.median(t) * 1e3:.3f} ms | "
              f"{min(t) * 1e3:.3f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
