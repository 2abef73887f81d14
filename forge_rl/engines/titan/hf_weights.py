"""The trainer's weights under Hugging Face names, one tensor at a time: what weight sync sends and an HF
export writes (the generators and transformers load HF names).

    hf_weights          every weight, each gathered only when its turn comes (FSDP2) and cast to the sync dtype
    hf_weight_rows      each rank's own rows, with no gather where HF only renames (shared memory on one host)
    hf_adapter_weights  LoRA's adapters alone (lora.py): a few MB where the model is hundreds
"""

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from forge_rl.compat.torch import shard_row_offset
from forge_rl.engines.titan.lora import hf_adapter_sources
from forge_rl.engines.titan.model import DTYPES
from forge_rl.engines.titan.value_head import policy_state
from forge_rl.weights.layout import fused_order


def hf_weights(model: torch.nn.Module, adapter, dtype: str = "float32") -> tuple[dict[str, torch.Tensor], Iterator[torch.Tensor]]:
    """(HF name -> meta tensor, in `fused_order`; an iterator over the tensors, in that order).

    Collective when sharded: every rank must exhaust the iterator. One parameter is gathered at a time, so no
    rank ever holds a second whole copy of the model. An unsharded model gives its parameters themselves."""
    target = DTYPES[dtype]
    shapes, sources, _ = hf_sources(model, adapter, target)

    def tensors() -> Iterator[torch.Tensor]:
        for hf_name in shapes:
            yield gathered(adapter, *sources[hf_name], hf_name, target)

    return shapes, tensors()


def hf_weight_rows(model: torch.nn.Module, adapter, dtype: str = "float32") -> tuple[dict[str, torch.Tensor], Iterator]:
    """`hf_weights` for ranks all writing into one shared-memory buffer: (first row, tensor) per step. A
    row-sharded parameter that HF only renames gives this rank's rows with no communication; any other is
    gathered: (0, the whole tensor) on rank 0, (0, None) elsewhere. Collective."""
    target = DTYPES[dtype]
    shapes, sources, renamed = hf_sources(model, adapter, target)
    rank = dist.get_rank()

    def rows() -> Iterator[tuple[int, torch.Tensor | None]]:
        for hf_name in shapes:
            name, param = sources[hf_name]
            if hf_name in renamed and isinstance(param, DTensor) and param.device_mesh.ndim == 1 and param.placements == (Shard(0),):
                yield shard_row_offset(param), param.to_local().to(target)
            else:
                tensor = gathered(adapter, name, param, hf_name, target)
                yield 0, tensor if rank == 0 else None

    return shapes, rows()


def hf_sources(model: torch.nn.Module, adapter, target: torch.dtype) -> tuple[dict, dict, set]:
    """(HF name -> meta tensor, in `fused_order`; HF name -> (TorchTitan name, parameter); the HF names that
    are their parameter only renamed). From `model.state_dict()`: detached, DTensor shards when sharded,
    no communication; `adapter.to_hf` is per key, so it maps meta tensors as well. PPO's value head stays."""
    shapes, sources, renamed = {}, {}, set()
    for name, param in policy_state(model.state_dict()).items():
        meta = torch.empty(param.shape, dtype=target, device="meta")
        for hf_name, hf_meta in adapter.to_hf({name: meta}).items():
            sources[hf_name], shapes[hf_name] = (name, param), hf_meta
            if hf_meta is meta:
                renamed.add(hf_name)
    return fused_order(shapes), sources, renamed


def gathered(adapter, name: str, param: torch.Tensor, hf_name: str, target: torch.dtype) -> torch.Tensor:
    """One HF tensor whole: cast (before the gather, so it moves fewer bytes), gathered when sharded, then
    converted (renames, and Llama's q/k permutation)."""
    param = param.to(target)
    if isinstance(param, DTensor):
        param = param.full_tensor()
    return adapter.to_hf({name: param})[hf_name]


def hf_adapter_weights(model: torch.nn.Module, adapter, dtype: str = "float32") -> tuple[dict[str, torch.Tensor], Iterator[torch.Tensor]]:
    """`hf_weights` for a model with LoRA layers: its adapters alone, A and B of each layer, B's rows in the HF
    layout's order. Collective when sharded, as hf_weights is."""
    target = DTYPES[dtype]
    shapes, sources = hf_adapter_sources(model, adapter, target)

    def tensors() -> Iterator[torch.Tensor]:
        for hf_name in shapes:
            _, param, rows = sources[hf_name]
            tensor = param.detach().to(target)
            tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield tensor if rows is None else tensor[rows.to(tensor.device)]

    return shapes, tensors()
