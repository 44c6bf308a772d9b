"""A/B timing of two checkouts of zyx on the same pytest-benchmark benchmarks: the trees
take turns, round after round, so both share the same minutes of a shared machine.

    python benches/tree_ab.py BEFORE_DIR AFTER_DIR [--rounds 3] \
        [--bench benches/bench_transformer.py::test_transformer_step_zyx ...]

Each checkout must be built in place (`python setup.py build_ext --inplace`). Every round
runs, for each tree, `python -m pytest <its benches> --benchmark-only` in that tree with
that tree first on PYTHONPATH (each tree's own benchmark files: a benchmark moved or
renamed in one tree is named by the same node id there). Prints each benchmark's median
per round and tree, the median over rounds, and AFTER / BEFORE. The peers (PyTorch,
numpy) are in the benchmark selection as ordinary benchmarks, so their row is the
machine's noise floor for the same minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

DEFAULT = (
    "benches/bench_transformer.py::test_transformer_step_zyx",
    "benches/bench_transformer.py::test_transformer_step_torch",
    "benches/bench_conv.py::test_convnet_step_zyx",
    "benches/bench_conv.py::test_convnet_step_torch",
    "benches/bench_core.py::test_sum_zyx",
    "benches/bench_core.py::test_sum_torch",
    "benches/bench_core.py::test_softmax_zyx",
    "benches/bench_core.py::test_softmax_torch",
)


def run(tree, benches, env):
    """{benchmark name: median seconds} of one pytest-benchmark run in `tree`."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "b.json")
        env = dict(env, PYTHONPATH=tree + os.pathsep + env.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-m", "pytest", *benches, "--benchmark-only",
                               "-q", "-p", "no:cacheprovider", f"--benchmark-json={out}"],
                              cwd=tree, env=env, capture_output=True, text=True)
        if not os.path.exists(out):
            sys.exit(f"{tree}: pytest wrote no results\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(out) as f:
            data = json.load(f)
    return {b["name"]: b["stats"]["median"] for b in data["benchmarks"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bench", nargs="+", default=list(DEFAULT),
                    help="pytest node ids, relative to each tree's root")
    args = ap.parse_args(argv)
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    results = {name: [] for name in trees}          # per tree: one dict per round
    for r in range(args.rounds):
        for name, tree in trees.items():
            results[name].append(run(tree, args.bench, os.environ))
            print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr)
    names = list(results["before"][0])
    print("| benchmark | before, per round (ms) | after, per round (ms) | before median | "
          "after median | after / before |")
    print("|---|---|---|---|---|---|")
    for b in names:
        row = {}
        for name in trees:
            row[name] = [rnd[b] * 1e3 for rnd in results[name] if b in rnd]
        if not row["before"] or not row["after"]:
            continue
        mb, ma = statistics.median(row["before"]), statistics.median(row["after"])
        print(f"| {b} | {', '.join(f'{v:.3f}' for v in row['before'])} | "
              f"{', '.join(f'{v:.3f}' for v in row['after'])} | {mb:.3f} | {ma:.3f} | "
              f"{ma / mb:.3f} |")


if __name__ == "__main__":
    main()
