"""Broadcast across hosts: the trainer's rank 0 and every vLLM worker form a process group of their own (gloo
on CPU, NCCL on GPUs); each version goes out tensor by tensor into a staging buffer each worker keeps, and
is loaded from views of it. The version's WeightsHandle (the layout) goes to TorchStore.
"""

from __future__ import annotations

import asyncio
import datetime
import socket

import torch

from forge_rl import weights as base
from forge_rl.compat.torch import standalone_process_group
from forge_rl.weights import control
from forge_rl.weights.layout import WeightsHandle, make_layout, tensor_views


def join_group(rendezvous: str, port: int, rank: int, world: int, bind: str, timeout_s: float = 300.0):
    """A process group of its own (not torch.distributed's default one): rank 0 is the trainer and hosts the
    rendezvous at `rendezvous:port`; every member binds its connections to its own address `bind`.
    Gloo on CPU; NCCL when CUDA is present (then broadcast tensors must be on the current CUDA device).
    Blocks until all `world` members have joined, or raises after `timeout_s`.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(rendezvous, port, world, rank == 0, timeout=timeout)
    return standalone_process_group(dist.PrefixStore("forge_rl_weights", store), rank, world, timeout, bind)


def group_device() -> torch.device:
    """Where broadcast tensors live: the current GPU with NCCL, else CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def broadcast_send(group, tensors: list[torch.Tensor]) -> None:
    """Rank 0 (trainer): send every tensor, in the handle's layout order."""
    device = group_device()
    for t in tensors:
        group.broadcast(t.to(device).contiguous(), 0).wait()


def broadcast_receive(group, handle: WeightsHandle, staging: torch.Tensor | None) -> torch.Tensor:
    """Other ranks (vLLM workers): receive one version into `staging` (reallocated only when too small),
    returned for `tensor_views`."""
    if staging is None or staging.numel() < handle.nbytes:
        staging = torch.empty(handle.nbytes, dtype=torch.uint8, device=group_device())
    for _, view in tensor_views(staging, handle.layout):
        group.broadcast(view, 0).wait()
    return staging


async def connect(trainer, generators: list, procs_per_generator: int, rendezvous: str,
                  generator_binds: list[str], port: int) -> None:
    """Controller: form the broadcast group, trainer rank 0 (binding `rendezvous`) and every vLLM worker of
    each generator actor (generator i binding generator_binds[i]). All join at once: it is a rendezvous.
    A replica the service restarts later is not in the group: its updates fail until the run restarts."""
    world = 1 + len(generators) * procs_per_generator
    await asyncio.gather(
        trainer.join_weights_group.call(rendezvous, port, world, rendezvous),
        *(g.join_weights_group.call(rendezvous, port, 1 + i * procs_per_generator, world, bind)
          for i, (g, bind) in enumerate(zip(generators, generator_binds))),
    )


class Publisher(base.Publisher):
    """Rank 0 sends the gathered tensors (an unsharded trainer: its parameters themselves) to every vLLM
    worker and returns once the handle is in TorchStore; the send completes as the workers take it. `sent`
    waits for it: the next push and the next optimizer step (the parameters must not change meanwhile)."""

    def __init__(self, rank: int, world: int, device):
        self.rank, self.group, self.sending = rank, None, None

    def join(self, rendezvous: str, port: int, world: int, bind: str) -> None:
        if self.rank == 0:
            self.group = join_group(rendezvous, port, 0, world, bind)

    async def publish(self, shapes: dict, tensors, version: int, rows: bool = False, adapter: dict | None = None) -> None:
        if self.rank != 0:
            return
        if self.group is None:
            raise RuntimeError("Trainer: weight_sync is broadcast but join_weights_group was never called")
        await self.sent()  # one at a time, in version order
        tensors = list(tensors)  # sharded: gathered now; else the parameters themselves
        layout, nbytes = make_layout(shapes)
        self.sending = asyncio.ensure_future(asyncio.to_thread(broadcast_send, self.group, tensors))
        handle = WeightsHandle("broadcast", version, socket.gethostname(), layout=layout, nbytes=nbytes, adapter=adapter or {})
        await control.put_handle(handle.as_dict(), version)

    async def sent(self) -> None:
        if self.sending is not None:
            sending, self.sending = self.sending, None
            await sending


async def stage(version: int, handle: dict, engine, prefix: str) -> tuple[str, tuple, None]:
    """Generator: every vLLM worker takes the broadcast into its staging buffer (between engine steps)."""
    await engine.collective_rpc("receive_weights", args=(handle,))
    return "load_staged_weights", (handle,), None
