"""The layout of one policy version's bytes, shared by every transport: HF-named tensors packed in order,
each 64-byte aligned, and the WeightsHandle that tells a receiver where they are.

    handle = WeightsHandle(kind, version, ..., layout=make_layout(shapes)[0], nbytes=...)
    for name, view in tensor_views(payload, handle.layout): ...   # no copy
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

ALIGN = 64  # every tensor starts on a 64-byte boundary, so views of any dtype are aligned


class StaleWeightsError(RuntimeError):
    """A buffer no longer (or not yet) holds the version a handle names: a torn or stale read, refused."""


@dataclass
class WeightsHandle:
    """What TorchStore holds under `policy/v{n}/handle`: how to reach the bytes of version n.

    Plain fields only: it travels pickled through TorchStore and as a dict through vLLM's msgpack RPC.
    """

    kind: str  # "shm" | "broadcast" | "store"
    version: int
    host: str = ""  # hostname of the trainer that wrote it (shm: readers must be on this host)
    path: str = ""  # shm: the buffer file
    token: int = 0  # shm: random per write; the buffer's header holds it while the bytes are this version's
    layout: list = field(default_factory=list)  # [(name, dtype, shape, byte offset into the payload)]
    nbytes: int = 0  # payload bytes
    adapter: dict = field(default_factory=dict)  # LoRA: {"scale": alpha / rank}; the bytes are adapters, not weights

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def make_layout(state_dict: dict[str, torch.Tensor]) -> tuple[list, int]:
    """(layout, payload bytes) of `state_dict` packed in order, each tensor 64-byte aligned."""
    layout, offset = [], 0
    for name, t in state_dict.items():
        layout.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return layout, offset


# Projections vLLM fuses into one matrix (qkv_proj, gate_up_proj), in its row order: written consecutively, each
# group IS that matrix in the buffer, which a vLLM worker on CPU packs without copying the parts together.
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_order(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each FUSED_PROJECTIONS group made consecutive where its first member was; same tensors, no copy."""
    ordered = {}
    for name in state_dict:
        module, _, leaf = name.rpartition(".")  # "model.layers.0.mlp.up_proj", "weight"
        parent, _, projection = module.rpartition(".")
        group = next((g for g in FUSED_PROJECTIONS if projection in g), None)
        for member in [f"{parent}.{p}.{leaf}" for p in group] if group else [name]:
            if member in state_dict:
                ordered.setdefault(member, state_dict[member])
    return ordered


def tensor_views(payload: torch.Tensor, layout: list) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into the uint8 `payload` (no copy), in layout order."""
    for name, dtype, shape, offset in layout:
        dtype = getattr(torch, dtype)
        yield name, payload[offset : offset + dtype.itemsize * math.prod(shape)].view(dtype).view(shape)


def copy_rows(payload: torch.Tensor, layout: list, rows: Iterable[tuple[int, torch.Tensor | None]]) -> None:
    """Several writers fill one payload, each with its own (first row, tensor or None) per layout entry."""
    for (_, view), (first, t) in zip(tensor_views(payload, layout), rows, strict=True):
        if t is not None:
            view[first : first + t.shape[0]].copy_(t)
