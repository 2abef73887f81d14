"""Several runs' evaluation curves against wall-clock minutes, in one PNG (for docs and for choosing settings).

    python scripts/compare_runs.py runs/a runs/b --labels sync async --key eval/ev_luck_corrected --out cmp.png
    python scripts/compare_runs.py runs/code --key eval/pass_at_1 eval/sampled_pass_at_1 --out code.png

Minutes count from each run's first metrics row (the reference policies' evaluation, just after start-up).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forge_rl.recipes.metrics import read_metrics  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="*", help="one per run (default: the directory names)")
    parser.add_argument("--key", nargs="+", default=["eval/ev_luck_corrected"], help="the metrics to plot (a line each)")
    parser.add_argument("--target", type=float, default=None, help="a horizontal line, e.g. -0.08")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    labels = args.labels or [d.name for d in args.run_dirs]
    if len(labels) != len(args.run_dirs):
        parser.error(f"{len(args.run_dirs)} run dirs but {len(labels)} labels")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run_dir, label in zip(args.run_dirs, labels):
        rows = read_metrics(run_dir)
        if not rows:
            parser.error(f"{run_dir}: no metrics.jsonl rows")
        for key in args.key:
            points = [((r["time"] - rows[0]["time"]) / 60, r[key]) for r in rows if key in r]
            ax.plot(*zip(*points), marker="o", label=label if len(args.key) == 1 else f"{label}: {key}")
    if args.target is not None:
        ax.axhline(args.target, color="grey", linestyle="--", linewidth=1, label=f"target {args.target:+g}")
    ax.set_xlabel("minutes since the reference evaluation")
    ax.set_ylabel(args.key[0] if len(args.key) == 1 else "value")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(args.out)


if __name__ == "__main__":
    main()
