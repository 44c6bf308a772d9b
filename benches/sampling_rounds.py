"""Issue 31's sampling recipe (200 characters, greedy, context cropped to 64) with zyx and
PyTorch taking turns in one process: round r samples once with each, so both see the
same machine load, which on a small shared machine moves more between runs than the
libraries differ. Prints the median time of each and the median of the rounds' ratios.

    python benches/sampling_rounds.py [--rounds 9] [--tokens 200]

zyx runs on its default device (ZYX_DEVICE), PyTorch on CUDA when it has it. Both start
from the same weights and write the same text (checked)."""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recipe_lm as R  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    import zyx
    try:
        import torch
    except ImportError:
        sys.exit("sampling_rounds: needs PyTorch (the peer)")
    tdev = "cuda" if torch.cuda.is_available() else "cpu"
    zyx.manual_seed(0)
    zdev = zyx.get_default_device()
    zm = R.make_model(zyx, zdev)
    tm = R.make_model(torch, tdev)
    tm.load_state_dict({k: torch.from_numpy(v.numpy().copy()).to(tdev)
                        for k, v in zm.state_dict().items()})
    zs = zyx.tensor(np.zeros((1, 1), np.int64), device=zdev)
    ts = torch.zeros((1, 1), dtype=torch.long, device=tdev)

    def zyx_run():
        return R.generate(zyx, zm, zs, args.tokens)[0].tolist()

    def torch_run():
        return R.generate(torch, tm, ts, args.tokens)[0].tolist()
    if zyx_run()[:80] != torch_run()[:80]:
        sys.exit("sampling_rounds: the two libraries wrote different text")
    zt, tt = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        zyx_run()
        zt.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch_run()
        tt.append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(zt, tt)]
    print(f"sampling {args.tokens} tokens, {args.rounds} rounds: zyx ({zdev}) median "
          f"{np.median(zt) * 1e3:.0f} ms, torch ({tdev}) median {np.median(tt) * 1e3:.0f} ms; "
          f"zyx/torch per round {' '.join(f'{r:.2f}' for r in ratios)}, median "
          f"{np.median(ratios):.2f}")


if __name__ == "__main__":
    main()
