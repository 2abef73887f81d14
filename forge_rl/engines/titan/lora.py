"""LoRA on a TorchTitan model, with PEFT's LoRA layers, and its tensors under Hugging Face / PEFT names.

PEFT wraps each targeted layer: its frozen weight moves to `<layer>.base_layer.weight`, and it computes
base(x) + scale * B(A(dropout(x))), scale = alpha / rank (one autograd node without dropout: compat/peft.py).
Only the adapters train and have optimizer state; with them switched off the model is the base model: the KL
term's reference, with no second copy.

Under HF names (`...q_proj.lora_A.weight`; PEFT's file adds `base_model.model.`), B's rows are reordered as the
state-dict adapter reorders the base weight's rows (Llama's q/k permutation), so B @ A is the HF-layout update.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

BASE = ".base_layer"
ADAPTER = ".default"


def titan_targets(adapter, hf_targets: list[str]) -> list[str]:
    """HF linear-layer names (q_proj, ...) -> this family's TorchTitan module names (wq, ...); ValueError naming
    the key for one this model does not have."""
    known = {}
    for hf, titan in adapter.from_hf_map.items():
        hf_parts, titan_parts = hf.split("."), (titan or "").split(".")
        if hf.endswith("_proj.weight") and titan:
            known[hf_parts[-2]] = titan_parts[-2]
    missing = [t for t in hf_targets if t not in known]
    if missing:
        raise ValueError(f"trainer.lora.target_modules: {missing[0]!r} is not a linear layer of this model (known: {', '.join(known)})")
    return sorted({known[t] for t in hf_targets})


def apply_lora(model: torch.nn.Module, adapter, config) -> None:
    """Wrap the targeted linear layers of `model` (on any device, meta included) with PEFT's LoRA layers."""
    import peft

    from forge_rl.compat.peft import fuse_lora_layers

    targets = titan_targets(adapter, list(config.target_modules))
    lora = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=targets)
    peft.inject_adapter_in_model(lora, model)
    fuse_lora_layers(model)  # the same function, without passes over each layer's output (compat/peft.py)


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def scale(model: torch.nn.Module) -> float:
    """alpha / rank, the same for every layer."""
    return next(iter(lora_layers(model).values())).scaling["default"]


def initial_state(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """A as PEFT initialises it, B zero, so the model starts as the base model. Drawn from a seeded generator
    on full tensors: the same on every rank and for any number of ranks."""
    generator, state = torch.Generator().manual_seed(seed), {}
    for name, layer in lora_layers(model).items():
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        bound = 1 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
        state[f"{name}.lora_A{ADAPTER}.weight"] = (torch.rand(a.shape, generator=generator) * 2 - 1) * bound
        state[f"{name}.lora_B{ADAPTER}.weight"] = torch.zeros(b.shape)
    return state


def with_base_names(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A TorchTitan state dict (the adapter's names) renamed for a model with LoRA layers: a targeted layer's
    weight is its `base_layer`'s."""
    wrapped = set(lora_layers(model))
    out = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        out[f"{module}{BASE}.{leaf}" if module in wrapped else key] = value
    return out


@contextmanager
def adapters_off(model: torch.nn.Module):
    """The base model: every LoRA layer computes its base layer alone."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def hf_adapter_sources(model: torch.nn.Module, adapter, dtype: torch.dtype) -> tuple[dict, dict]:
    """(HF name -> meta tensor of the adapter tensor's shape and `dtype`; HF name -> (the LoRA parameter's
    TorchTitan name, the parameter, the order of its rows in the HF layout or None)), A and B of each layer."""
    params = dict(model.named_parameters())
    shapes, sources = {}, {}
    for name, layer in lora_layers(model).items():
        base = params[f"{name}{BASE}.weight"]
        (hf_weight,) = adapter.to_hf({f"{name}.weight": torch.empty(base.shape, device="meta")})
        for which in ("A", "B"):
            key = f"{name}.lora_{which}{ADAPTER}.weight"
            hf_name = hf_weight.removesuffix(".weight") + f".lora_{which}.weight"
            shapes[hf_name] = torch.empty(params[key].shape, dtype=dtype, device="meta")
            sources[hf_name] = (key, params[key], hf_row_order(adapter, f"{name}.weight", base.shape) if which == "B" else None)
    return shapes, sources


def hf_row_order(adapter, key: str, shape) -> torch.Tensor | None:
    """Where the adapter puts each row of the weight `key` in the HF layout (None: where it was): found by
    converting a weight whose every row holds its own index."""
    rows = torch.arange(shape[0], dtype=torch.float64)[:, None].expand(shape[0], shape[1]).contiguous()
    order = next(iter(adapter.to_hf({key: rows}).values()))[:, 0].long()
    return None if torch.equal(order, torch.arange(shape[0])) else order
