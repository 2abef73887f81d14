"""A trained policy as a plain Hugging Face directory: what transformers, vLLM and PEFT load.

    out/config.json, generation_config.json, the tokenizer files and chat template   copied from the model directory
                                                                                     (config.json's dtype: the weights')
    out/model.safetensors                                                            the weights (LoRA merged in)
    out/adapter/adapter_config.json, adapter_model.safetensors                       LoRA runs: the adapter alone, PEFT's layout

Written into a temporary directory beside `out` and renamed at the end: an export that fails leaves nothing.
`python -m forge_rl.checkpoint export RUN_DIR` exports a run's checkpoint the same way (forge_rl/checkpoint.py).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from forge_rl.engines.titan import lora as lora_layers
from forge_rl.engines.titan.value_head import policy_state

PEFT_PREFIX = "base_model.model."
TIED_HEAD = "lm_head.weight"  # HF's name of the output head, absent from a checkpoint whose embeddings it shares


def export_hf(model: torch.nn.Module, adapter, model_dir: str | Path, out: str | Path, lora=None) -> None:
    """Every rank calls it (the weights are gathered); rank 0 writes `out` (replacing what was there). The policy
    only: PPO's value head (value_head.py) stays in the run's checkpoints."""
    state = policy_state(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    model_dir, out = Path(model_dir), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for file in model_dir.iterdir():  # config, generation config, tokenizer, chat template
            if file.is_file() and not file.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy(file, tmp / file.name)
        weights = merged(state, model) if lora is not None else state
        hf = checkpoint_tensors(adapter.to_hf(weights), model_dir)
        save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_dtype(tmp / "config.json", {v.dtype for v in hf.values()})
        if lora is not None:
            write_peft_adapter(state, model, adapter, lora, model_dir, tmp / "adapter")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def checkpoint_tensors(converted: dict[str, torch.Tensor], model_dir: Path) -> dict[str, torch.Tensor]:
    """The converted tensors the model directory's checkpoint holds, and all of them: a name on one side only
    (but a tied output head, which HF rebuilds from the embeddings) would lose trained weights or leave
    transformers to initialise a weight at random (LoRA's merge once dropped Qwen2's q/k/v biases)."""
    saved = saved_names(model_dir)
    tied = json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    missing = sorted(k for k in converted.keys() ^ saved if not (tied and k == TIED_HEAD))
    if missing:
        raise ValueError(
            f"export: {len(missing)} tensors ({', '.join(missing[:3])}) are in only one of the trained model and {model_dir}'s "
            "checkpoint; only a tied output head may be left out: export against the model directory the run trained"
        )
    return {k: v.contiguous().clone() for k, v in converted.items() if k in saved}


def write_dtype(config: Path, dtypes: set[torch.dtype]) -> None:
    """config.json says the dtype model.safetensors holds: the trainer keeps fp32 master weights, so a model
    whose config says bf16 is written in fp32 (casting would round away small updates) and said so."""
    (dtype,) = dtypes
    hf_config = json.loads(config.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in [k for k in ("torch_dtype", "dtype") if k in hf_config] or ["torch_dtype"]:
        hf_config[key] = name
    config.write_text(json.dumps(hf_config, indent=2) + "\n")


def saved_names(model_dir: Path) -> set[str]:
    """The tensor names of the model directory's checkpoint (a tied head is not among them)."""
    names = set()
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def merged(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A full TorchTitan state dict of a model with LoRA layers -> the plain model's: W + scale * B @ A."""
    scale = lora_layers.scale(model)
    out = {k.replace(lora_layers.BASE, ""): v for k, v in state.items() if ".lora_" not in k}  # the base layer's bias too
    for name in lora_layers.lora_layers(model):
        a, b = state[f"{name}.lora_A{lora_layers.ADAPTER}.weight"], state[f"{name}.lora_B{lora_layers.ADAPTER}.weight"]
        out[f"{name}.weight"] = out[f"{name}.weight"] + scale * (b.double() @ a.double()).to(a.dtype)
    return out


def write_peft_adapter(state, model, adapter, config, model_dir: Path, out: Path) -> None:
    """The adapter alone in PEFT's layout (`PeftModel.from_pretrained(base, out)` loads it)."""
    import peft

    out.mkdir()
    _, sources = lora_layers.hf_adapter_sources(model, adapter, torch.float32)
    tensors = {PEFT_PREFIX + hf_name: (state[key] if rows is None else state[key][rows]).contiguous().clone()
               for hf_name, (key, _, rows) in sources.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config = peft.LoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=list(config.target_modules),
        task_type="CAUSAL_LM", base_model_name_or_path=str(model_dir),
    )
    peft_config.save_pretrained(str(out))
