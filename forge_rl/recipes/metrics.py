"""Where a run's numbers go: TensorBoard, optionally Weights & Biases, a JSON-lines file, and a PNG curve.

metrics.jsonl is the record the PNG is drawn from and tests read; samples.jsonl holds a few games as text:
what the model answers, not only how it scores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from forge_rl.core.config import LoggingConfig


class MetricsLogger:
    def __init__(self, run_dir: Path, config: LoggingConfig, run_config: dict | None = None):
        self.path, self.samples_path = run_dir / "metrics.jsonl", run_dir / "samples.jsonl"
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

    def log_samples(self, step: int, kind: str, samples: list[dict]) -> None:

        with self.samples_path.open("a") as f:
            for sample in samples:
                f.write(json.dumps({"step": step, "kind": kind, **sample}, default=str) + "\n")
        if self.tensorboard and samples:
            self.tensorboard.add_text(f"samples/{kind}", "\n\n".join(f"```\n{transcript(s)}\n```" for s in samples), step)
        if self.wandb and samples:
            import wandb

            rows = [[s["reward"], s["invalid"], transcript(s)] for s in samples]
            self.wandb.log({f"samples/{kind}": wandb.Table(columns=["reward", "invalid", "game"], data=rows)}, step=step)

    def drop_after(self, step: int) -> None:
        """A run resumed from `step`'s checkpoint logs later steps again (TensorBoard and W&B keep both)."""
        for path in (self.path, self.samples_path):
            if path.exists():
                path.write_text("".join(r for r in path.read_text().splitlines(True) if json.loads(r)["step"] <= step))

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()


def transcript(sample: dict) -> str:
    """One game of samples.jsonl as text: each turn's prompt, answer and action, then the reward."""
    turns = [f"[prompt] {t['prompt']}\n[answer] {t['answer']!r} -> {t['action']}" for t in sample["turns"]]
    return "\n".join(turns) + f"\n[reward] {sample['reward']:+.3f}{' (invalid answer)' if sample['invalid'] else ''}"


def sample_line(sample: dict, width: int = 110) -> str:
    """One game on one console line: the end of its last prompt, the answer, the action, the reward."""
    last = sample["turns"][-1]
    prompt = " ".join(last["prompt"].split())
    prompt = prompt if len(prompt) <= width else "..." + prompt[-width:]
    return f"  e.g. {prompt!r} -> {last['answer']!r} {last['action']} reward {sample['reward']:+.3f} (more: samples.jsonl)"


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plot_curves(run_dir: Path, curves: dict[str, str], references: dict[str, float], out_name: str = "learning_curve.png") -> Path:
    """`curves`: {metric key: label}; `references`: horizontal lines {label: value}."""
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
