"""Bar chart of a bench_throughput.py --json result: each part against the raw library in the same run.

    python tools/plot_bench.py docs/perf_h200_all.json --out docs/perf_h200.png
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
    ap.add_argument("result")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    r = json.load(open(args.result))
    pairs = [p for p in PAIRS if p[1] in r and p[2] in r]
    fig, axes = plt.subplots(1, len(pairs), figsize=(3.2 * len(pairs), 3.2), squeeze=False)
    for ax, (label, ours, raw, unit, _) in zip(axes[0], pairs):
        ax.bar(["mcore-rl", "raw"], [r[ours], r[raw]], color=["tab:blue", "tab:gray"])
        ax.set_title(f"{label}\nratio {r[raw] / r[ours] if 's' == unit else r[ours] / r[raw]:.2f}", fontsize=9)
        ax.set_ylabel(unit)
    fig.suptitle(args.title or args.result, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
