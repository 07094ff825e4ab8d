"""Plot metrics from runs' metrics.jsonl (default: mean reward per step) into a PNG; several runs share each panel.

    python tools/plot_metrics.py outputs/run/metrics.jsonl --out docs/reward_curve.png
    python tools/plot_metrics.py outputs/run/metrics.jsonl --keys reward/mean response_length/mean --out m.png
    python tools/plot_metrics.py sync/metrics.jsonl one_step/metrics.jsonl --labels sync one-step --out c.png
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl of a run (several: one line per run)")
    parser.add_argument("--labels", nargs="+", default=None, help="one per run (default: the file names)")
    parser.add_argument("--keys", nargs="+", default=["reward/mean"])
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window (steps)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    labels = args.labels or args.metrics
    if len(labels) != len(args.metrics):
        raise SystemExit(f"--labels has {len(labels)} names for {len(args.metrics)} runs")
    runs = []
    for path in args.metrics:
        with open(path) as f:
            runs.append([json.loads(line) for line in f if line.strip()])
    fig, axes = plt.subplots(len(args.keys), 1, figsize=(6, 2.6 * len(args.keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], args.keys):
        for rows, path, name in zip(runs, args.metrics, labels):
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if not pts:
                raise SystemExit(f"no values of {key!r} in {path}")
            steps, values = zip(*pts)
            tag = key if len(runs) == 1 else name
            line, = ax.plot(steps, values, marker="o", ms=3, lw=1, alpha=0.5 if args.smooth > 1 else 1, label=tag)
            if args.smooth > 1:
                w = args.smooth
                avg = [sum(values[max(0, i - w + 1):i + 1]) / len(values[max(0, i - w + 1):i + 1])
                       for i in range(len(values))]
                ax.plot(steps, avg, lw=2, color=line.get_color(), label=f"{tag} ({w}-step mean)")
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
