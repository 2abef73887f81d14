"""The fallback transport: the state dict itself in TorchStore under `policy/v{n}`, and a safetensors file
per update on the generator's side, since `collective_rpc` arguments cross msgpack, which turns tensors into
nested lists; every vLLM worker memory-maps the file.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from forge_rl import weights as base
from forge_rl.weights import control
from forge_rl.weights.layout import WeightsHandle


class Publisher(base.Publisher):
    """Rank 0 puts the whole state dict (gathered tensor by tensor), then the handle."""

    def __init__(self, rank: int, world: int, device):
        self.rank = rank

    async def publish(self, shapes: dict, tensors, version: int, rows: bool = False, adapter: dict | None = None,
                      receivers: list[int] | None = None) -> None:
        if self.rank == 0:
            await control.put_state_dict(dict(zip(shapes, tensors, strict=True)), version)
            nbytes = sum(t.numel() * t.element_size() for t in shapes.values())
            await control.put_handle(WeightsHandle("store", version, nbytes=nbytes, adapter=adapter or {}).as_dict(), version)


async def stage(version: int, handle: dict | None, engine, prefix: str) -> tuple[str, tuple, Path]:
    """Generator: fetch the state dict and write it to a file the vLLM workers read (deleted after)."""
    state_dict = await control.get_state_dict(version, prefix=prefix)
    path = await asyncio.to_thread(write_weights_file, state_dict)
    return "load_weights_file", (str(path), (handle or {}).get("adapter", {})), path


def write_weights_file(state_dict: dict[str, torch.Tensor]) -> Path:
    """The caller deletes it. In /dev/shm with room twice over, else the temp dir (a container's is often 64 MiB)."""
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    shm = "/dev/shm"
    folder = shm if os.path.isdir(shm) and shutil.disk_usage(shm).free > 2 * nbytes else tempfile.gettempdir()
    fd, name = tempfile.mkstemp(prefix="forge_rl_weights_", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, name)
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)
