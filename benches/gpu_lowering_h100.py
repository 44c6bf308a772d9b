"""Time the kernels benches/gpu_lowering_export.py lowered, on a CUDA GPU with CuPy (no
zyx build needed there): effective bandwidth against a device-to-device copy, results
against CuPy, softmax against PyTorch.

python3 benches/gpu_lowering_h100.py kernels.json"""
import json
import sys

import cupy as cp
import numpy as np

NP = {"float32": np.float32, "float64": np.float64, "int32": np.int32}


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / reps * 1e-3


def copy_bandwidth():
    a = cp.ones(2 ** 28, cp.float32)
    b = cp.empty_like(a)
    t = timed(lambda: cp.copyto(b, a))
    return 2 * a.nbytes / t


def run_kernel(k, inputs):
    mod = cp.RawModule(code=k["source"], options=("-std=c++17",))
    bufs = []
    for j, (d, n, ro) in enumerate(k["args"]):
        if j > 0 and j - 1 < len(inputs) and inputs[j - 1] is not None:
            bufs.append(inputs[j - 1])
        else:
            bufs.append(cp.zeros(n, NP[d]) if not ro else (cp.random.random(n, dtype=cp.float32) + 1000).astype(NP[d]))
    scratch = [cp.empty(nb, cp.uint8) for nb in k["scratch"]]
    calls = []
    for entry, groups, local, args in k["launches"]:
        fn = mod.get_function(entry)
        a = tuple(bufs[i] if kind == "arg" else scratch[i] for kind, i in args)
        calls.append((fn, groups, local, a))

    def go():
        for fn, g, l, a in calls:
            fn((g,), (l,), a)
    t = timed(go)
    nbytes = sum(b.nbytes for b in bufs)
    return t, nbytes, bufs


def main(path):
    ks = json.load(open(path))
    bw = copy_bandwidth()
    print(f"device copy: {bw / 1e12:.3f} TB/s (read+write)")
    prev = {}
    for k in ks:
        name = k["bench"]
        inputs = []
        if name.startswith("softmax"):
            inputs = prev.get(name, [])
        t, nbytes, bufs = run_kernel(k, inputs)
        extra = ""
        if name.endswith("256M") and k["launches"][0][0] == "zyx_k":
            x = bufs[1]
            ref = {"sum": lambda: float(x.astype(cp.float64).sum()),
                   "mea": lambda: float(x.astype(cp.float64).mean()),
                   "max": lambda: float(x.max())}[name[:3]]()
            got = float(bufs[0][0])
            extra = f" result {got:.6g} ref {ref:.6g} rel.err {abs(got - ref) / max(abs(ref), 1e-30):.2e}"
            tc = timed(lambda: x.sum())
            extra += f" | cupy.sum {x.nbytes / tc / bw * 100:.1f}%"
        if name.startswith("softmax"):
            # chain: max -> sum(exp(x - max)) -> x / sum; feed buffers forward
            if len(bufs) == 2:
                prev[name] = [bufs[1]]
                prev[name + "max"] = bufs[0]
                prev["x"] = bufs[1]
            elif len(bufs) == 3:
                prev[name] = [prev["x"], bufs[0]]
                prev[name + "sum"] = bufs[0]
        print(f"{name:22s} {k['strategy']:15s} {t * 1e6:9.1f} us  {nbytes / t / 1e12:6.3f} TB/s "
              f"= {nbytes / t / bw * 100:5.1f}% of copy{extra}")
    import torch
    x = torch.randn(16384, 4096, device="cuda")
    st, sp = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        torch.softmax(x, -1)
    st.record()
    for _ in range(20):
        torch.softmax(x, -1)
    sp.record()
    torch.cuda.synchronize()
    print(f"torch.softmax 16384x4096: {st.elapsed_time(sp) / 20 * 1e3:.1f} us")


if __name__ == "__main__":
    main(sys.argv[1])
