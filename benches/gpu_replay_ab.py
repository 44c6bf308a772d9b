"""Plan launches on and off (ZYX_PLAN_LAUNCHES's switch, `device.plan_launches`) on
bench_gpu.py's MLP and convnet training steps, alternating in one process, beside zyx
on CUDA when it is there:

    python benches/gpu_replay_ab.py [device ...]        (default: vulkan:0 cuda:0)

Each step cycles bench_gpu's batches, as its benchmarks do (bench_gpu.zyx_training_step:
8 for the MLP, 4 for the convnet). Per device and setting it prints the median of ROUNDS
rounds of STEPS steps (AB_ROUNDS, AB_STEPS; a synchronize after each round), and for
Vulkan the recordings made and replayed (vulkan_replay.py)."""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zyx  # noqa: E402

import bench_gpu as bg  # noqa: E402

ROUNDS, STEPS = int(os.environ.get("AB_ROUNDS", 7)), int(os.environ.get("AB_STEPS", 20))


def rounds(step, device):
    """Median seconds per step over ROUNDS rounds of STEPS steps."""
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step()
        zyx.synchronize(device)
        times.append((time.perf_counter() - t0) / STEPS)
    return statistics.median(times)


def main(devices):
    names = {str(d) for d in zyx.devices()}
    for workload, opt_name in (("mlp", "sgd"), ("mlp", "adam"), ("convnet", "adam")):
        for name in devices:
            if name not in names:
                print(f"{name}: not listed, skipped")
                continue
            zyx.set_default_device(name)
            dev = zyx._RT.resolve(name)
            settings = (True, False) if hasattr(dev, "plan_launches") else (None,)
            _, step = bg.zyx_training_step(workload, opt_name)
            got = {s: [] for s in settings}
            for _ in range(3):                  # alternate the settings, warm each
                for s in settings:
                    if s is not None and dev.plan_launches != s:
                        dev.plan_launches = s
                        zyx._RT.plans.clear()
                    for _ in range(2 * STEPS):
                        step()
                    zyx.synchronize(name)
                    got[s].append(rounds(step, name))
            if settings[0] is not None:
                dev.plan_launches = True
                zyx._RT.plans.clear()
            extra = ""
            rec = getattr(getattr(dev, "ctx", None), "recordings", None)
            if rec is not None:
                extra = f"  (recordings made {rec.recorded}, replayed {rec.replayed})"
            cells = ", ".join(f"{'plan launches ' + ('on' if s else 'off') if s is not None else 'default'}"
                              f" {statistics.median(v) * 1e6:.0f} us" for s, v in got.items())
            print(f"{workload} {opt_name} on {name}: {cells}{extra}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["vulkan:0", "cuda:0"])
