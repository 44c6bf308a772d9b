"""Run benchmarks and print a markdown table of times, throughput and ratios to the peers.

    python benches/report.py [pytest args...]      e.g. benches/bench_core.py
"""
import json
import os
import subprocess
import sys
import tempfile


def main(argv):
    targets = argv or [os.path.join(os.path.dirname(__file__), "bench_core.py")]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "b.json")
        subprocess.run([sys.executable, "-m", "pytest", *targets, "--benchmark-only", "-q",
                        "-p", "no:cacheprovider", f"--benchmark-json={out}"], check=False)
        with open(out) as f:
            data = json.load(f)
    groups = {}
    for b in data["benchmarks"]:
        # a round of bench_gpu runs `reps` calls then waits for the device: per call
        b["stats"]["median"] /= b.get("extra_info", {}).get("reps", 1)
        groups.setdefault(b["group"], []).append(b)
    # the device's copy bandwidth in this run (bench_gpu's "copy" group), for "of copy"
    copy_bw = max((b["extra_info"]["bytes"] / b["stats"]["median"]
                   for b in groups.get("copy", ()) if "bytes" in b.get("extra_info", {})),
                  default=None)
    print("| group | impl | median | throughput | zyx speedup vs this |")
    print("|---|---|---|---|---|")
    for g, bs in groups.items():
        # the reference is the group's first zyx entry (in bench_train: the PyTorch habit,
        # with the Tape path beside it)
        zyx_b = [b for b in bs if "zyx" in b["name"]]
        ref = zyx_b[0]["stats"]["median"] if zyx_b else None
        for b in bs:
            med = b["stats"]["median"]
            info = b.get("extra_info", {})
            thr = ""
            if "flops" in info:
                thr = f"{info['flops'] / med / 1e9:.1f} GFLOP/s"
            elif "bytes" in info:
                thr = f"{info['bytes'] / med / 1e9:.1f} GB/s"
                if copy_bw and g != "copy":
                    thr += f" ({info['bytes'] / med / copy_bw:.0%} of copy)"
            elif "ops" in info:
                thr = f"{med / info['ops'] * 1e6:.2f} us/op"
            ratio = f"{med / ref:.2f}x" if ref and "zyx" not in b["name"] else ""
            name = b["name"].split("[")[0].replace("test_", "")
            if "[" in b["name"]:
                name += "[" + b["name"].split("[")[1]
            unit = f"{med * 1e3:.3f} ms" if med >= 1e-3 else f"{med * 1e6:.1f} us"
            print(f"| {g} | {name} | {unit} | {thr} | {ratio} |")
            for impl, ms in info.get("median_ms", {}).items():   # same-window peers
                r = info["median_ms"].get("zyx")
                rel = f"{ms / r:.2f}x" if r and impl != "zyx" else ""
                print(f"| {g} | {name} {impl} per step | {ms:.3f} ms |  | {rel} |")


if __name__ == "__main__":
    main(sys.argv[1:])
