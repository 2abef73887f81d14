"""Where a run's numbers go: TensorBoard, optionally Weights & Biases, a JSON-lines file, and a PNG curve.

One `log(step, values)` call sends a dict of scalars everywhere; the JSON-lines file (metrics.jsonl in
the run directory) is the record the learning-curve PNG is drawn from, and what tests read.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from forge_rl.core.config import LoggingConfig


class MetricsLogger:
    def __init__(self, run_dir: Path, config: LoggingConfig, run_config: dict | None = None):
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tensorboard = self.wandb = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        if config.wandb_project:
            try:
                import wandb
            except ImportError:
                raise SystemExit("logging.wandb_project is set but wandb is not installed: pip install wandb") from None
            self.wandb = wandb.init(project=config.wandb_project, dir=str(run_dir), config=run_config)

    def log(self, step: int, values: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        if self.tensorboard:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(values, step=step)

    def drop_after(self, step: int) -> None:
        """Forget the JSON-lines rows of steps after `step`: a run resumed from that step's checkpoint
        logs them again (TensorBoard and W&B keep both)."""
        kept = [json.dumps(r) + "\n" for r in read_metrics(self.path.parent) if r["step"] <= step]
        self.path.write_text("".join(kept))

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plot_curves(run_dir: Path, curves: dict[str, str], references: dict[str, float], out_name: str = "learning_curve.png") -> Path:
    """Draw each metric named in `curves` ({metric key: label}) against step, with horizontal reference
    lines ({label: value}); saved as a PNG in the run directory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in curves.items():
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, label=label)
    for label, value in references.items():
        ax.axhline(value, linestyle="--", linewidth=0.8, color="gray")
        # x in axes fraction (inside the axis whatever its step range), y in data
        ax.annotate(label, (0.01, value), xycoords=ax.get_yaxis_transform(), fontsize=7, color="gray", va="bottom")
    ax.set_xlabel("train step")
    ax.set_ylabel("reward")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    out = run_dir / out_name
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out
