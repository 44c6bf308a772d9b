"""The first training step of a fresh process with empty caches: issue 31's "the first step
(empty cache) no slower than torch.compile's", on the recipes of bench_recipes.py.

Each row runs in its own Python process with a new, empty cache directory (zyx's kernel
cache under XDG_CACHE_HOME; TorchInductor's under TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR),
so nothing compiled by an earlier row or an earlier run is reused. Printed per workload:
the time from the start of the first step to its loss on the host (what a user waits for
before training starts; building the model is not in it), the second step, and the median
of steps 3 to 10.

    python benches/first_step.py [--device cuda] [--workloads convnet,lm]

Columns: zyx (its default device, or --device), PyTorch eager and torch.compile with
mode="reduce-overhead" (CUDA graphs) on the same device; a library or mode that cannot run
here (torch missing, torch.compile without a working Triton) is reported as such."""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

_CHILD = r"""
import json, sys, time
sys.path.insert(0, {here!r})
import numpy as np
lib_name, workload, device = {lib!r}, {workload!r}, {device!r}
if lib_name == "zyx":
    import zyx as lib
    if device:
        lib.set_default_device(device)
    dev = lib.get_default_device()
    sync = lib.synchronize
else:
    import torch as lib
    dev = device or ("cuda" if lib.cuda.is_available() else "cpu")
    sync = lib.cuda.synchronize if str(dev).startswith("cuda") else (lambda: None)
lib.manual_seed(0)
F = lib.nn.functional
if workload == "convnet":
    from bench_conv import _convnet, _mnist_batch
    model = _convnet(lib.nn).to(dev)
    opt = lib.optim.Adam(model.parameters(), 1e-3)
    xn, yn = _mnist_batch()
    batch = (lib.tensor(xn, device=dev), lib.tensor(yn, device=dev))

    def body(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss
else:
    import recipe_lm as R
    model = R.make_model(lib, dev)
    model.train()
    raw = R.make_step(lib, model)
    get_batch = R.batcher(lib, R.text_codes(), dev)
    batch = get_batch()
    body = raw
step = body
if lib_name == "compile":
    # the whole step compiled, as the reduce-overhead recipe is used for training loops
    step = lib.compile(body, mode="reduce-overhead")
sync()
times = []
for i in range(10):
    t0 = time.perf_counter()
    loss = float(step(*batch).item())
    sync()
    times.append(time.perf_counter() - t0)
print("RESULT " + json.dumps({{"times": times, "loss": loss}}))
"""


def _run_one(lib, workload, device, timeout):
    """The step times of one fresh process, or a string saying why there are none."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, XDG_CACHE_HOME=cache,
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"))
        code = _CHILD.format(here=HERE, lib=lib, workload=workload, device=device)
        try:
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"over {timeout} s"
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["times"]
    err = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return f"failed: {err[:120]}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="", help="zyx's device (default: zyx's default); "
                    "torch uses cuda when it has it")
    ap.add_argument("--workloads", default="convnet,lm")
    ap.add_argument("--libs", default="zyx,eager,compile")
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args()
    print("| workload | library | first step | second step | median of steps 3-10 |")
    print("| --- | --- | --- | --- | --- |")
    for workload in args.workloads.split(","):
        for lib in args.libs.split(","):
            t0 = time.perf_counter()
            times = _run_one(lib, workload, args.device if lib == "zyx" else "", args.timeout)
            name = {"zyx": "zyx", "eager": "PyTorch eager",
                    "compile": 'torch.compile(mode="reduce-overhead")'}[lib]
            if isinstance(times, str):
                print(f"| {workload} | {name} | {times} | | |", flush=True)
                continue
            rest = sorted(times[2:])
            med = rest[len(rest) // 2] if rest else float("nan")
            print(f"| {workload} | {name} | {times[0] * 1e3:.0f} ms | {times[1] * 1e3:.1f} ms | "
                  f"{med * 1e3:.2f} ms |", flush=True)
            print(f"  ({name}: process {time.perf_counter() - t0:.1f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
