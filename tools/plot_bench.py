"""Bar chart of bench_throughput.py --json results: each part against the raw library in the same run, one row of
panels per result file.

    python tools/plot_bench.py docs/perf_h200_0.5b.json docs/perf_h200_1.5b.json --out docs/perf_h200.png
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PAIRS = [  # (label, ours, raw, unit, higher is better)
    ("train tok/s", "train.tokens_per_s", "train.raw_tokens_per_s", "tokens/s", True),
    ("rollout tok/s", "rollout.tokens_per_s", "rollout.raw_tokens_per_s", "tokens/s", True),
    ("weight sync s", "weight_sync.seconds", "weight_sync.copy_seconds", "s", False),
    ("e2e step s", "e2e.step_s", "e2e.raw_parts_s", "s", False),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    rows = []
    for path in args.results:
        with open(path) as f:
            r = json.load(f)
        rows.append((path, r, [p for p in PAIRS if r.get(p[1]) is not None and r.get(p[2]) is not None]))
    width = max(len(pairs) for _, _, pairs in rows)
    fig = plt.figure(figsize=(3.2 * width, 3.6 * len(rows)), layout="constrained")
    subfigs = fig.subfigures(len(rows), 1, squeeze=False)[:, 0]
    for sub, (path, r, pairs) in zip(subfigs, rows):
        axes = sub.subplots(1, width, squeeze=False)[0]
        for col, ax in enumerate(axes):
            if col >= len(pairs):
                ax.axis("off")
                continue
            label, ours, raw, unit, _ = pairs[col]
            ax.bar(["mcore-rl", "raw"], [r[ours], r[raw]], color=["tab:blue", "tab:gray"])
            ratio = r[raw] / r[ours] if unit == "s" else r[ours] / r[raw]
            ax.set_title(f"{label}\nratio {ratio:.2f}", fontsize=9)
            ax.set_ylabel(unit)
        sub.suptitle(r.get("title") or path, fontsize=10, fontweight="bold")
    if args.title:
        fig.suptitle(args.title, fontsize=11)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
