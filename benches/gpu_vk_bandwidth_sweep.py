"""The Vulkan / WebGPU lowering knobs swept over bench_vk's memory-bound cases, one
fresh process per setting (the knobs are environment variables read at lowering):

    python benches/gpu_vk_bandwidth_sweep.py vulkan [variant-substring ...]
    python benches/gpu_vk_bandwidth_sweep.py wgpu
    BENCH_SCALE=64 python benches/gpu_vk_bandwidth_sweep.py vulkan    (a CPU driver)

Cases: copy, ew (64M float32), sum (256M float32), softmax (16384 x 4096); each variant
runs the cases its knobs touch. Where zyx lists a CUDA device its figures are measured
in the same run (reference for "x zyx CUDA"), and PyTorch's once where it has CUDA.
Prints one markdown table: variant, case, ms, GB/s, % of the copy bandwidth (the best
copy any row reached, PyTorch's included) and the ratios to zyx CUDA and PyTorch
(time / reference time: below 1.25 is the issue's "80% of zyx CUDA")."""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "bench_vk.py")
EW = ("copy", "ew")
RED = ("sum", "softmax")
ALL = EW + RED

# (name, environment, cases): the first is the default of the branch
VARIANTS = {
    "vulkan": [
        ("default", {}, ALL),
        ("ew: old grid-stride scalar (stride=1)", {"ZYX_VK_EW": "stride=1"}, EW),
        ("ew: vec=4 items=1", {"ZYX_VK_EW": "items=1"}, EW),
        ("ew: vec=4 items=2", {"ZYX_VK_EW": "items=2"}, EW),
        ("ew: vec=4 items=8", {"ZYX_VK_EW": "items=8"}, EW),
        ("ew: vec=4 local=128", {"ZYX_VK_EW": "local=128"}, EW),
        ("ew: vec=4 local=512", {"ZYX_VK_EW": "local=512"}, EW),
        ("ew: 4 adjacent scalars (vload=0)", {"ZYX_VK_EW": "vload=0"}, EW),
        ("ew: vec=1 tiles", {"ZYX_VK_EW": "vec=1"}, EW),
        ("no float_controls modes", {"ZYX_VK_FLOAT_CONTROLS": "0"}, ALL),
        ("reduce: group=128", {"ZYX_VK_GROUP": "128"}, RED),
        ("reduce: group=512", {"ZYX_VK_GROUP": "512"}, RED),
        ("reduce: group=1024", {"ZYX_VK_GROUP": "1024"}, RED),
        ("sum: splits<=1024", {"ZYX_VK_SPLITS": "1024"}, ("sum",)),
        ("sum: splits<=16384", {"ZYX_VK_SPLITS": "16384"}, ("sum",)),
        # ZYX_VK_REDUCE (spirv/strategy.py): row cache, subgroup combine, split ilp
        ("reduce: before (cache=0 subgroup=0 ilp=1 vec=1)",
         {"ZYX_VK_REDUCE": "cache=0,subgroup=0,ilp=1,vec=1"}, RED),
        ("softmax: row cache (cache=1)", {"ZYX_VK_REDUCE": "cache=1"}, ("softmax",)),
        ("softmax: row cache, group=512", {"ZYX_VK_REDUCE": "cache=1", "ZYX_VK_GROUP": "512"},
         ("softmax",)),
        ("softmax: row cache, group=1024", {"ZYX_VK_REDUCE": "cache=1",
                                            "ZYX_VK_GROUP": "1024"}, ("softmax",)),
        ("reduce: tree combine (subgroup=0)", {"ZYX_VK_REDUCE": "subgroup=0"}, RED),
        ("sum: scalar loads (vec=1)", {"ZYX_VK_REDUCE": "vec=1"}, ("sum",)),
        ("sum: ilp=8 vec=1", {"ZYX_VK_REDUCE": "ilp=8,vec=1"}, ("sum",)),
        ("sum: ilp=1", {"ZYX_VK_REDUCE": "ilp=1"}, ("sum",)),
        ("sum: ilp=2", {"ZYX_VK_REDUCE": "ilp=2"}, ("sum",)),
        ("sum: ilp=8", {"ZYX_VK_REDUCE": "ilp=8"}, ("sum",)),
        ("sum: ilp=16", {"ZYX_VK_REDUCE": "ilp=16"}, ("sum",)),
        ("sum: ilp=8 splits<=1024", {"ZYX_VK_REDUCE": "ilp=8", "ZYX_VK_SPLITS": "1024"},
         ("sum",)),
        ("sum: ilp=8 group=512", {"ZYX_VK_REDUCE": "ilp=8", "ZYX_VK_GROUP": "512"},
         ("sum",)),
        ("softmax: group=128 (cache: 32 values a lane)", {"ZYX_VK_GROUP": "128"},
         ("softmax",)),
        ("softmax: group=512 subgroup=0", {"ZYX_VK_GROUP": "512",
                                           "ZYX_VK_REDUCE": "subgroup=0"}, ("softmax",)),
    ],
    "wgpu": [
        ("default", {}, ALL),
        ("ew: old grid-stride scalar (vec=1 per=4)", {"ZYX_WGSL_EW": "vec=1"}, EW),
        ("ew: vec4 per=1", {"ZYX_WGSL_EW": "per=1"}, EW),
        ("ew: vec4 per=2", {"ZYX_WGSL_EW": "per=2"}, EW),
        ("ew: vec4 per=8", {"ZYX_WGSL_EW": "per=8"}, EW),
        ("ew: vec4 wg=128", {"ZYX_WGSL_EW": "wg=128"}, EW),
        ("ew: vec4 wg=512", {"ZYX_WGSL_EW": "wg=512"}, EW),
        ("softmax: row cache (cache=1)", {"ZYX_WGSL_REDUCE": "cache=1"}, ("softmax",)),
        ("softmax: row cache, wg=128", {"ZYX_WGSL_REDUCE": "cache=1,wg=128"}, ("softmax",)),
        ("softmax: row cache, wg=512", {"ZYX_WGSL_REDUCE": "cache=1,wg=512"}, ("softmax",)),
        ("softmax: row cache, wg=1024", {"ZYX_WGSL_REDUCE": "cache=1,wg=1024"}, ("softmax",)),
        # wgpu_direct.py: naga's run-time checks (the default builds shaders without them)
        ("checks: standard (wgpu's create_shader_module)",
         {"ZYX_WGPU_SHADER_CHECKS": "standard"}, ALL),
        ("checks: bounds only", {"ZYX_WGPU_SHADER_CHECKS": "bounds"}, ALL),
        ("checks: loop counters only", {"ZYX_WGPU_SHADER_CHECKS": "loops"}, ALL),
        ("default, again", {}, ALL),
        ("reduce: wg=64", {"ZYX_WGSL_REDUCE": "wg=64"}, RED),
        ("reduce: wg=128", {"ZYX_WGSL_REDUCE": "wg=128"}, RED),
        ("reduce: wg=512", {"ZYX_WGSL_REDUCE": "wg=512"}, RED),
        ("reduce: wg=1024", {"ZYX_WGSL_REDUCE": "wg=1024"}, RED),
    ],
}


def case_bytes(case):
    """Bytes case moves at BENCH_SCALE, as bench_vk.cases sizes it (its printed GB/s is
    rounded to whole GB/s: a CPU driver's read 0)."""
    scale = int(os.environ.get("BENCH_SCALE", "1"))
    n_ew, n_sum = (64 << 20) // scale, (256 << 20) // scale
    return {"copy": 8 * n_ew, "ew": 8 * n_ew, "sum": 4 * n_sum,
            "softmax": 8 * max(16384 // scale, 1) * 4096}[case]


def run_bench(device, cases, env):
    """{case: (ms, GB/s, torch ms or None)} of bench_vk.py on `device` under `env`;
    a case whose run failed is absent (the error is printed)."""
    r = subprocess.run([sys.executable, BENCH, device, *cases], capture_output=True,
                       text=True, env={**os.environ, **env}, timeout=1800)
    out = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or cells[0] not in cases:
            continue
        try:
            ms = float(cells[1])
        except ValueError:
            continue
        gbs = case_bytes(cells[0]) / (ms * 1e6)
        torch_ms = float(cells[3]) if cells[3] else None
        out[cells[0]] = (ms, gbs, torch_ms)
    if r.returncode != 0 or not out:
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        print(f"<!-- {device} {env}: exit {r.returncode}: {' / '.join(tail)} -->", flush=True)
    return out


def has_device(name):
    """Whether zyx lists device `name` ("cuda:0": a device's str is its name)."""
    code = ("import zyx, sys\n"
            f"sys.exit(0 if any(str(d) == {name!r} for d in zyx.devices()) else 1)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def main(argv):
    if not argv or argv[0].split(":")[0] not in VARIANTS:
        sys.exit(f"usage: {sys.argv[0]} vulkan|wgpu[:N] [variant-substring ...]")
    device = argv[0] if ":" in argv[0] else argv[0] + ":0"
    backend = device.split(":")[0]
    wanted = argv[1:]
    variants = [v for v in VARIANTS[backend]
                if not wanted or v[0] == "default" or any(w in v[0] for w in wanted)]
    rows = []           # (variant, case, ms, GB/s)
    cuda, torch = {}, {}
    if has_device("cuda:0"):
        cuda = run_bench("cuda:0", list(ALL), {"BENCH_TORCH": "1"})
        torch = {c: t for c, (_, _, t) in cuda.items() if t}
        rows += [("zyx CUDA", c, ms, gbs) for c, (ms, gbs, _) in cuda.items()]
        rows += [("PyTorch CUDA", c, t, case_bytes(c) / (t * 1e6)) for c, t in torch.items()]
    for name, env, cases in variants:
        res = run_bench(device, list(cases), {**env, "BENCH_TORCH": "0"})
        rows += [(f"{backend}: {name}", c, ms, gbs) for c, (ms, gbs, _) in res.items()]
        print(f"<!-- done: {name} -->", file=sys.stderr, flush=True)
    copy = max((gbs for _, c, _, gbs in rows if c == "copy"), default=0.0)
    print(f"copy bandwidth (best copy row): {copy:.3g} GB/s\n")
    print("| variant | case | ms | GB/s | % of copy | x zyx CUDA (time) | x PyTorch (time) |")
    print("|---|---|---|---|---|---|---|")
    for case in ALL:
        for name, c, ms, gbs in rows:
            if c != case:
                continue
            pct = f"{100 * gbs / copy:.0f}%" if copy else ""
            xc = f"{ms / cuda[c][0]:.2f}" if c in cuda else ""
            xt = f"{ms / torch[c]:.2f}" if c in torch else ""
            print(f"| {name} | {c} | {ms:.3f} | {gbs:.3g} | {pct} | {xc} | {xt} |")
    best = {}
    for name, c, ms, _ in rows:
        if name.startswith(backend) and (c not in best or ms < best[c][1]):
            best[c] = (name, ms)
    print()
    for c, (name, ms) in best.items():
        print(f"best {c}: {name} ({ms:.3f} ms)")


if __name__ == "__main__":
    main(sys.argv[1:])
