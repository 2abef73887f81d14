"""LoRA served unmerged inside vLLM's worker: each targeted layer computes base(x) + scale * B(A(x)), the
function the trainer's PEFT layers compute, in the serving dtype.

Why not merge: base + scale * B @ A rounded to bf16 loses an update smaller than half a unit in the last place,
so the generator sampled from a policy lagging the trained one. Unmerged, nothing of the base is copied.

Each HF-named adapter (`...q_proj.lora_A.weight`, `...q_proj.lora_B.weight`) goes to the vLLM layer that
serves it: a fused layer (qkv_proj, gate_up_proj, from the model's `packed_modules_mapping`) gets one A,
the shards' A stacked, and one block-diagonal B, so its adapters cost two small matmuls. Under tensor
parallelism a column-parallel layer takes this rank's rows of B, a row-parallel one this rank's columns of
A (its partial output is summed with the base's by the layer's own all-reduce).

The product is added by wrapping the layer's quant method's `apply`, a Python call a CUDA-graph engine would
not replay: LoRA runs are served eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _owner(model, hf_module: str) -> tuple[torch.nn.Module, int, int]:
    """The vLLM layer serving an HF linear layer, the shard's index in it and how many shards it fuses."""
    parent, _, leaf = hf_module.rpartition(".")
    for fused, parts in getattr(model, "packed_modules_mapping", {}).items():
        if leaf in parts:
            return model.get_submodule(f"{parent}.{fused}"), parts.index(leaf), len(parts)
    return model.get_submodule(hf_module), 0, 1


def _this_rank(layer, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's part of one shard's A [r, in] and B [out, r]."""
    rank, size = getattr(layer, "tp_rank", 0), getattr(layer, "tp_size", 1)
    if size == 1:
        return a, b
    if hasattr(layer, "input_size_per_partition") and layer.input_size_per_partition != a.shape[1]:  # row-parallel
        width = layer.input_size_per_partition
        return a[:, rank * width : (rank + 1) * width], b
    rows = layer.output_partition_sizes[shard]
    replicas = getattr(layer, "num_kv_head_replicas", 1) if shard > 0 else 1  # k and v heads shared by ranks
    start = (rank // replicas) * rows
    return a, b[start : start + rows]


class ServedAdapters:
    """The adapters of one worker's model: laid out at the first version, updated in place after."""

    def __init__(self, model, adapters: dict[str, torch.Tensor], dtype: torch.dtype):
        owners: dict[int, tuple[torch.nn.Module, list]] = {}  # vLLM layer -> the HF module of each shard
        for name in sorted(n for n in adapters if n.endswith(".lora_A.weight")):
            module = name.removesuffix(".lora_A.weight")
            layer, shard, shards = _owner(model, module)
            owners.setdefault(id(layer), (layer, [None] * shards))[1][shard] = module
        device = next(model.parameters()).device
        self.layers = []  # (layer, A [sum r, in], B [out, sum r] block-diagonal, [(module, shard, rank cols, out rows)])
        for layer, modules in owners.values():
            outs = list(layer.output_partition_sizes) if len(modules) > 1 else [sum(layer.output_partition_sizes)]
            parts, r0 = [], 0
            for shard, module in enumerate(modules):
                if module is not None:
                    a, _ = _this_rank(layer, shard, adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"])
                    o0 = sum(outs[:shard])
                    parts.append((module, shard, (r0, r0 + a.shape[0]), (o0, o0 + outs[shard])))
                    r0, width = r0 + a.shape[0], a.shape[1]
            a_all = torch.zeros(r0, width, dtype=dtype, device=device)
            b_all = torch.zeros(sum(outs), r0, dtype=dtype, device=device)
            self.layers.append((layer, a_all, b_all, parts))
            _wrap(layer, a_all, b_all)

    def update(self, adapters: dict[str, torch.Tensor], scale: float) -> int:
        """Copy one version's adapters in (the engine paused); returns how many tensors were read."""
        read = 0
        for layer, a_all, b_all, parts in self.layers:
            for module, shard, (r0, r1), (o0, o1) in parts:
                a, b = _this_rank(layer, shard, adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"])
                a_all[r0:r1].copy_(a)
                b_all[o0:o1, r0:r1].copy_(b)
                read += 2
            layer.lora_scale = float(scale)
        return read


def _wrap(layer, a: torch.Tensor, b: torch.Tensor) -> None:
    """The layer's output gains B(A(x)) * scale, in the order PEFT's LoRA layer computes it."""
    method = layer.quant_method
    if getattr(method, "serves_lora", False):
        raise RuntimeError(f"{type(layer).__name__}: its quant method is shared with another layer; LoRA cannot be added to one")
    base_apply, method.serves_lora = method.apply, True
    layer.lora_scale = 0.0

    def apply(module, x, bias=None):
        return base_apply(module, x, bias) + F.linear(F.linear(x, a), b) * module.lora_scale

    method.apply = apply
