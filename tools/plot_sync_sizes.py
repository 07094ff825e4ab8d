"""Line plot of docs/perf_h200_weight_sync_sizes.json: ms per colocated weight sync against the bytes synced, per
layout, with the plain-copy baseline.

    python tools/plot_sync_sizes.py   # writes docs/perf_h200_weight_sync_sizes.png
"""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    d = json.load(open("docs/perf_h200_weight_sync_sizes.json"))
    sizes = ["0.5b", "1.5b", "3b"]
    gb = [d[s]["weight_sync.gbytes"] for s in sizes]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("weight_sync.hf.seconds", "hf layout"), ("weight_sync.engine.seconds", "engine layout"),
                       ("weight_sync.seconds", "shared layout (default)"), ("weight_sync.copy_seconds", "plain copy")):
        ax.plot(gb, [d[s][key] * 1e3 for s in sizes], "o-", label=label)
    for s, x in zip(sizes, gb):
        ax.annotate(f"Qwen2.5-{s.upper()} dims", (x, d[s]["weight_sync.hf.seconds"] * 1e3), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("weights synced (GB, bf16)")
    ax.set_ylabel("ms per sync")
    ax.set_title("Colocated weight sync on one H200 (SGLang 0.5.17)")
    ax.legend()
    fig.tight_layout()
    fig.savefig("docs/perf_h200_weight_sync_sizes.png", dpi=120)


if __name__ == "__main__":
    main()
