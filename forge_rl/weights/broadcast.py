"""Broadcast across hosts: one process group per generator replica (gloo on CPU, NCCL on GPUs), the trainer's
rank 0 and that replica's vLLM workers. Each version goes out after a one-number version header, into a
staging buffer each worker keeps; its WeightsHandle (the layout) goes to TorchStore.

A group per replica, not one for all: a collective waits for every member, so one lost replica would fail
(gloo) or stall (NCCL) every update. A failed send drops that replica's group alone; the restarted replica
rejoins with a group of its own and gets the current version before it takes calls (`rejoin`).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket

import torch

from forge_rl import weights as base
from forge_rl.compat.torch import standalone_process_group
from forge_rl.runtime.actor import call
from forge_rl.weights import control
from forge_rl.weights.layout import StaleWeightsError, WeightsHandle, make_layout, tensor_views

logger = logging.getLogger(__name__)


def join_group(rendezvous: str, port: int, rank: int, world: int, bind: str, timeout_s: float = 300.0):
    """Not torch.distributed's default group: rank 0, the trainer, hosts the rendezvous; each member binds `bind`.
    With NCCL, broadcast tensors must be on the current CUDA device."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(rendezvous, port, world, rank == 0, timeout=timeout)
    return standalone_process_group(dist.PrefixStore("forge_rl_weights", store), rank, world, timeout, bind)


def group_device() -> torch.device:
    """Where broadcast tensors live: the current GPU with NCCL, else CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def broadcast_send(group, version: int, tensors: list[torch.Tensor]) -> None:

    device = group_device()
    group.broadcast(torch.tensor([version], dtype=torch.int64, device=device), 0).wait()
    for t in tensors:
        group.broadcast(t.to(device).contiguous(), 0).wait()


def broadcast_receive(group, handle: WeightsHandle, staging: torch.Tensor | None) -> torch.Tensor:
    """Into `staging`, reallocated only when too small; a header naming another version is refused."""
    header = torch.zeros(1, dtype=torch.int64, device=group_device())
    group.broadcast(header, 0).wait()
    if int(header.item()) != handle.version:
        raise StaleWeightsError(f"broadcast carries version {int(header.item())}, expected {handle.version}")
    if staging is None or staging.numel() < handle.nbytes:
        staging = torch.empty(handle.nbytes, dtype=torch.uint8, device=group_device())
    for _, view in tensor_views(staging, handle.layout):
        group.broadcast(view, 0).wait()
    return staging


async def _join(trainer, generator, replica: int, procs: int, rendezvous: str, bind: str, port: int) -> None:

    await asyncio.gather(
        trainer.join_weights_group.call(rendezvous, port, 1 + procs, rendezvous, replica),
        generator.join_weights_group.call(rendezvous, port, 1, 1 + procs, bind),
    )


async def connect(trainer, generators: list, procs_per_generator: int, rendezvous: str,
                  generator_binds: list[str], ports: list[int]) -> None:
    """A group per replica, each on a port of its own on the trainer's host."""
    await asyncio.gather(*(
        _join(trainer, g, i, procs_per_generator, rendezvous, bind, port)
        for i, (g, bind, port) in enumerate(zip(generators, generator_binds, ports, strict=True))
    ))


async def free_ports(host, n: int) -> list[int]:

    ports: list[int] = []
    while len(ports) < n:
        if (port := await host.free_port()) not in ports:
            ports.append(port)
    return ports


async def rejoin(replica, trainer, procs: int, rendezvous: str, binds: list[str], trainer_host, timeout_s: float = 300.0) -> None:
    """Service.after_restart under broadcast. `resend_weights` is False between an optimizer step and the next
    push: ask again. Looped: a version pushed meanwhile went to the healthy replicas only."""
    await _join(trainer, replica.actor, replica.index, procs, rendezvous, binds[replica.index], await trainer_host.free_port())
    loaded, deadline = 0, asyncio.get_running_loop().time() + timeout_s
    while (latest := await control.latest_pushed_version()) > loaded:
        if not await call(trainer, "resend_weights", replica.index, latest, timeout_s=timeout_s):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"generator replica {replica.index}: the trainer never held version {latest} to resend")
            await asyncio.sleep(0.2)
            continue
        await replica.actor.update_weights.call(latest)
        logger.warning("generator replica %d rejoined the weights broadcast at version %d", replica.index, latest)
        loaded = latest


class Publisher(base.Publisher):
    """Rank 0 sends to each replica in a thread of its own and returns once the handle is in TorchStore.
    `sent` waits for the sends, since the parameters must not change meanwhile; a failed send drops its group."""

    def __init__(self, rank: int, world: int, device):
        self.rank, self.groups, self.sending = rank, {}, []

    def join(self, rendezvous: str, port: int, world: int, bind: str, replica: int = 0) -> None:
        if self.rank == 0:
            self.groups[replica] = join_group(rendezvous, port, 0, world, bind)

    async def publish(self, shapes: dict, tensors, version: int, rows: bool = False, adapter: dict | None = None,
                      receivers: list[int] | None = None) -> list[int] | None:
        if self.rank != 0:
            return None
        if not self.groups:
            raise RuntimeError("Trainer: weight_sync is broadcast but join_weights_group was never called")
        await self.sent()  # one at a time, in version order
        tensors = list(tensors)  # sharded: gathered now; else the parameters themselves
        layout, nbytes = make_layout(shapes)
        chosen = sorted(self.groups if receivers is None else set(receivers) & set(self.groups))
        for replica in chosen:
            self._send(replica, version, tensors)
        handle = WeightsHandle("broadcast", version, socket.gethostname(), layout=layout, nbytes=nbytes, adapter=adapter or {})
        await control.put_handle(handle.as_dict(), version)
        return chosen

    def resend(self, replica: int, tensors, version: int) -> None:
    
        if self.rank == 0:
            self._send(replica, version, list(tensors))

    def _send(self, replica: int, version: int, tensors: list[torch.Tensor]) -> None:
        group = self.groups[replica]
        self.sending.append((replica, group, asyncio.ensure_future(asyncio.to_thread(broadcast_send, group, version, tensors))))

    async def sent(self) -> None:
        sending, self.sending = self.sending, []
        for replica, group, task in sending:
            try:
                await task
            except Exception as e:  # that replica's workers are gone or broken: it restarts and rejoins
                why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                logger.warning("weights broadcast to generator replica %d failed (%s); it is left out until it rejoins", replica, why)
                if self.groups.get(replica) is group:  # not the group a rejoin has made since
                    del self.groups[replica]


async def stage(version: int, handle: dict, engine, prefix: str) -> tuple[str, tuple, None]:
    """Every vLLM worker takes the broadcast into its staging buffer, between engine steps."""
    await engine.collective_rpc("receive_weights", args=(handle,))
    return "load_staged_weights", (handle,), None
