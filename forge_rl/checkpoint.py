"""`python -m forge_rl.checkpoint export RUN_DIR [--step N] --out DIR`: a run's checkpoint as a plain HF directory.

What every checkpoint of a run now writes beside itself (`checkpoints/step_N/hf/`), made for any checkpoint of
any run, older runs included: the model built as the run's config.yaml says (LoRA layers included), the
checkpoint's weights loaded into it, and the HF directory written (forge_rl/engines/titan/export.py: config,
tokenizer and chat template, model.safetensors with LoRA merged, the adapter alone in PEFT's layout).
Bad input (no such run, no checkpoint, no such step) exits with status 2 and one line; nothing is written then.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def export(run_dir: Path, step: int | None, out: Path) -> Path:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from forge_rl.core.config import load_config
    from forge_rl.engines.titan.export import export_hf
    from forge_rl.engines.titan.model import build_model
    from forge_rl.models import resolve_model
    from forge_rl.recipes.grpo.checkpoint import checkpoint_dir, last_checkpoint

    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml")
    if step is None:
        latest = last_checkpoint(run_dir)
        if latest is None:
            raise ValueError(f"{run_dir} has no checkpoints (trainer.checkpoint_every was 0, or no step was taken)")
        path = Path(latest["path"])
    else:
        path = checkpoint_dir(run_dir) / f"step_{step:06d}"
        if not path.is_dir():
            steps = sorted(int(p.name.removeprefix("step_")) for p in checkpoint_dir(run_dir).glob("step_*"))
            raise ValueError(f"{run_dir} has no checkpoint of step {step} (it has: {steps or 'none'})")
    model_dir = resolve_model(cfg.model.path, cfg.model.dtype, run_dir / "tiny_model", cfg.model.tiny_seed)
    lora = cfg.trainer.lora
    model, adapter = build_model(model_dir, torch.device("cpu"), "float32", shard=False, lora=lora)
    state = {k: v for k, v in get_model_state_dict(model).items() if lora is None or ".lora_" in k}
    dcp.load({"model": state}, checkpoint_id=str(path))
    set_model_state_dict(model, state, options=StateDictOptions(strict=lora is None))
    export_hf(model, adapter, model_dir, out, lora)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m forge_rl.checkpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="write a checkpoint of RUN_DIR as a plain Hugging Face directory")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the latest)")
    p.add_argument("--out", type=Path, required=True, help="the directory to write (replaced if it exists)")
    args = parser.parse_args(argv)
    try:
        print(export(args.run_dir, args.step, args.out))
    except (ValueError, FileNotFoundError) as e:
        print(f"forge_rl.checkpoint: {str(e).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
