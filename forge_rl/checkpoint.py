"""Checkpoints: the trainer's state (torch.distributed.checkpoint) plus where the loops were, and
resuming from them (docs/reliability.md)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from forge_rl.actor import call
from forge_rl.config import ConfigError

if TYPE_CHECKING:
    from forge_rl.grpo import Run

logger = logging.getLogger("forge_rl.checkpoint")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


async def save_checkpoint(run: Run) -> None:
    """The trainer's state, and beside it where the loops were (progress.json); latest.json is a copy of
    the newest one. Paths are relative to the checkpoints folder, so a run directory can be moved or
    copied, and any checkpoint resumed from by copying its progress.json over latest.json."""
    folder = checkpoint_dir(Path(run.cfg.run_dir))
    path = folder / f"step_{run.step:06d}"
    await call(run.trainer, "save_checkpoint", str(path), timeout_s=run.cfg.trainer.timeout_s)
    progress = json.dumps({"step": run.step, "version": run.version, "next_seed": run.next_seed, "path": path.name})
    for pointer in (path / "progress.json", folder / "latest.json"):
        pointer.with_suffix(".tmp").write_text(progress)
        pointer.with_suffix(".tmp").replace(pointer)  # atomic: a crash never leaves a half-written pointer


def last_checkpoint(run_dir: str | Path) -> dict | None:
    """What checkpoints/latest.json says (step, version, next_seed, path: made whole), None before the first checkpoint."""
    latest = checkpoint_dir(Path(run_dir)) / "latest.json"
    if not latest.exists():
        return None
    progress = json.loads(latest.read_text())
    # relative (an absolute path, as older runs wrote, stays as is)
    return {**progress, "path": str(latest.parent / progress["path"])}


async def resume(run: Run) -> None:
    progress = last_checkpoint(run.cfg.run_dir)
    if progress is None:
        latest = checkpoint_dir(Path(run.cfg.run_dir)) / "latest.json"
        raise ConfigError(f"resume=true but {latest} does not exist: no checkpoint to resume from")
    restored = await call(run.trainer, "load_checkpoint", progress["path"], timeout_s=run.cfg.trainer.timeout_s)
    run.step, run.version, run.next_seed = progress["step"], restored["policy_version"], progress["next_seed"]
    run.metrics.drop_after(run.step)  # the rows of steps after the checkpoint are logged again
    await call(run.trainer, "push_weights", run.version, timeout_s=run.cfg.trainer.timeout_s)
    await run.policy.fanout("update_weights", run.version)
    logger.info("resumed at step %d, policy version %d", run.step, run.version)
