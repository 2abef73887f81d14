"""torch 2.13 internals: an LR scheduler's `_last_lr`, DTensor's shard offsets, a process group's options.

- `set_scheduler_lr`: setting a LambdaLR's lr at a restored step means writing the optimizer's groups
  and the scheduler's private `_last_lr` (what `get_last_lr()` returns), which has no setter.
- `shard_row_offset`: the first global row of this rank's shard comes from
  `torch.distributed.tensor._utils.compute_local_shape_and_global_offset` (right for uneven shards).
- `standalone_process_group`: a gloo or NCCL group outside torch.distributed's default one (weight sync's
  broadcast) with its own timeout and, for gloo, the address it binds to: only the private option fields
  `_timeout` and `_devices` set them.
"""

from __future__ import annotations

from forge_rl.compat import require

require("torch", "2.13.0", __name__)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402


def set_scheduler_lr(scheduler, lrs: list[float]) -> None:
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def shard_row_offset(param) -> int:
    """The global index of the first row of this rank's shard of a DTensor sharded by rows."""
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0]


def standalone_process_group(store, rank: int, world: int, timeout, bind: str):
    """NCCL when CUDA is present, else gloo binding its connections to the address `bind`."""
    if torch.cuda.is_available():
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    return dist.ProcessGroupGloo(store, rank, world, options)
