"""Checkpoints: the trainer's state (torch.distributed.checkpoint, written by every rank) plus the run's
state (state.py) beside it, and resuming from them (docs/reliability.md).

    run_dir/checkpoints/step_000025/     the trainer's DCP files and progress.json (the RunState, its path)
    run_dir/checkpoints/step_000025/hf/  the policy as a plain HF directory (engines/titan/export.py)
    run_dir/checkpoints/latest.json      a copy of the newest progress.json
    run_dir/final/hf/                    the policy at the end of the run
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from forge_rl.core.config import ConfigError
from forge_rl.recipes.grpo.state import RunState
from forge_rl.runtime.actor import call

logger = logging.getLogger(__name__)


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


async def save_checkpoint(trainer, run_dir: str, state: RunState, timeout_s: float) -> dict[str, float]:
    """Paths are relative to the checkpoints folder, so a run directory can be moved, and any checkpoint resumed
    from by copying its progress.json over latest.json."""
    folder = checkpoint_dir(run_dir)
    path = folder / f"step_{state.step:06d}"
    clock = time.perf_counter()
    await call(trainer, "save_checkpoint", str(path), timeout_s=timeout_s)
    saved = time.perf_counter()
    await call(trainer, "export_hf", str(path / "hf"), timeout_s=timeout_s)
    exported = time.perf_counter()
    progress = json.dumps({**state.as_dict(), "path": path.name})
    for pointer in (path / "progress.json", folder / "latest.json"):
        pointer.with_suffix(".tmp").write_text(progress)
        pointer.with_suffix(".tmp").replace(pointer)  # atomic: a crash never leaves a half-written pointer
    return {
        "checkpoint/dcp_bytes": sum(f.stat().st_size for f in path.glob("*.distcp")),
        "checkpoint/hf_bytes": sum(f.stat().st_size for f in (path / "hf").glob("*.safetensors")),
        "checkpoint/adapter_bytes": sum(f.stat().st_size for f in (path / "hf" / "adapter").glob("*.safetensors")),
        "time/checkpoint_s": saved - clock,
        "time/export_hf_s": exported - saved,
    }


def last_checkpoint(run_dir: str | Path) -> dict | None:
    """What checkpoints/latest.json says (step, version, next_seed, path: made whole), None before the first checkpoint."""
    latest = checkpoint_dir(run_dir) / "latest.json"
    if not latest.exists():
        return None
    progress = json.loads(latest.read_text())
    # relative (an absolute path, as older runs wrote, stays as is)
    return {**progress, "path": str(latest.parent / progress["path"])}


async def resume(trainer, run_dir: str, timeout_s: float) -> RunState:
    """The caller publishes the restored weights to the generators."""
    progress = last_checkpoint(run_dir)
    if progress is None:
        raise ConfigError(f"resume=true but {checkpoint_dir(run_dir) / 'latest.json'} does not exist: no checkpoint to resume from")
    restored = await call(trainer, "load_checkpoint", progress["path"], timeout_s=timeout_s)
    state = RunState(step=progress["step"], version=restored["policy_version"], next_seed=progress["next_seed"])
    logger.info("resumed at step %d, policy version %d", state.step, state.version)
    return state
