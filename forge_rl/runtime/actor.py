"""ForgeActor: the base of every forge_rl component that runs in its own processes.

The TorchForge convention: the constructor only stores its (picklable) arguments, and the async `setup()`
endpoint does the heavy work (load a model, start an engine), so a failure there reaches the caller as an
exception instead of killing a process silently.

    trainer = await Trainer.options(procs=2).as_actor(cfg)          # one mesh, setup() done on all ranks
    metrics = await call(trainer, "train_step", batch, timeout_s=600)  # rank 0's value; times out loudly
    policy = await Generator.options(num_replicas=2).as_service(cfg)  # N meshes behind one handle
    await policy.route("generate", prompt_ids, sampling)
    await stop(trainer); await policy.stop()
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass

from monarch.actor import Actor, concurrent_endpoint, current_rank, endpoint

from forge_rl.runtime.cluster import host_address
from forge_rl.runtime.provisioner import get_provisioner
from forge_rl.runtime.service import Service


class ForgeActor(Actor):
    @endpoint
    async def setup(self) -> None:
        """All ranks. Heavy initialisation; override. Called once by `as_actor`/`as_service` after spawning."""

    @endpoint
    async def _bind_rank(self) -> dict[str, str]:
        """Export RANK and LOCAL_RANK for torch.distributed, which the mesh-wide bootstrap cannot know."""
        if hasattr(self, "_where"):
            return self._where
        point = current_rank()
        os.environ["RANK"] = str(point.rank)
        os.environ["LOCAL_RANK"] = str(point["procs"] if "procs" in point.keys() else point.rank)
        where = {"host": host_address(), "pid": str(os.getpid())}
        where.update({k: os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")})
        print(f"forge_rl {type(self).__name__}: " + " ".join(f"{k}={v}" for k, v in where.items()), file=sys.stderr, flush=True)
        self._where = where
        return where

    @concurrent_endpoint
    async def ping(self) -> bool:
        """Concurrent, to answer while other calls run; an actor whose engine can die raises ReplicaDead here."""
        return True

    @classmethod
    def options(
        cls, procs: int = 1, with_gpus: bool = False, num_replicas: int = 1, hosts: int = 1, role: str | None = None,
        gpus_per_proc: int = 1, **service_options,
    ) -> "Launcher":
        return Launcher(cls, procs, with_gpus, num_replicas, service_options, hosts, role, gpus_per_proc)


@dataclass
class Launcher:
    """How to place an actor class. `gpus_per_proc`: for a process that starts its own on them (vLLM's
    tensor-parallel workers). `role` names the hosts (None: the controller's); replica i runs on host i % hosts.
    """

    actor_cls: type
    procs: int = 1
    with_gpus: bool = False
    num_replicas: int = 1
    service_options: dict | None = None
    hosts: int = 1
    role: str | None = None
    gpus_per_proc: int = 1

    async def spawn_mesh(self, *args, replica: int | None = None, **kwargs):
        """(procs, actor) with setup() done; `replica` places a service's replica."""
        provisioner = get_provisioner()
        name = self.actor_cls.__name__
        placement = {"hosts": self.hosts} if replica is None else {"hosts": 1, "first_host": replica % self.hosts}
        procs = await provisioner.spawn_procs(
            self.procs, self.with_gpus, name=name, role=self.role, gpus_per_proc=self.gpus_per_proc, **placement
        )
        try:
            actor = procs.spawn(name, self.actor_cls, *args, **kwargs)
            where = await actor._bind_rank.call()
            if self.role in provisioner.roles:  # ranks on other hosts log there; say here where they landed
                for _, w in where.items():
                    print(f"forge_rl {name}: " + " ".join(f"{k}={v}" for k, v in w.items()), file=sys.stderr, flush=True)
            if "hosts" in actor.sizes:  # one rank dimension, as on one host: results are indexed by procs=RANK
                actor = actor.flatten("procs")
            await actor.setup.call()
        except BaseException:
            await provisioner.stop_procs(procs)
            raise
        return procs, actor

    async def as_actor(self, *args, **kwargs):
        """One mesh; returns the Monarch actor mesh (call it with `.call()` / `.call_one()`)."""
        if self.num_replicas != 1:
            raise ValueError(f"{self.actor_cls.__name__}: as_actor() takes num_replicas=1; use as_service()")
        procs, actor = await self.spawn_mesh(*args, **kwargs)
        _procs_of[id(actor)] = procs
        _name_of[id(actor)] = self.actor_cls.__name__
        return actor

    async def as_service(self, *args, **kwargs):
        service = Service(self, args, kwargs, **(self.service_options or {}))
        await service.start()
        return service


_procs_of: dict[int, object] = {}  # id(actor mesh from as_actor) -> its proc mesh, for stop()
_name_of: dict[int, str] = {}  # id(actor mesh from as_actor) -> its class name, for call()'s errors


async def call(actor, endpoint: str, *args, timeout_s: float, **kwargs):
    """Every rank; rank 0's value. A hung actor stops the caller with a TimeoutError instead of hanging it."""
    name = _name_of.get(id(actor), type(actor).__name__)
    try:
        values = await asyncio.wait_for(getattr(actor, endpoint).call(*args, **kwargs), timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{name}.{endpoint} did not return within {timeout_s:g} s") from None
    return values.item(procs=0)


async def start_all(*launches):
    """Await launches (and any other awaitable) together; if any fails, stop every actor that did start: a
    failed start leaves no process behind."""
    started = await asyncio.gather(*launches, return_exceptions=True)
    failed = [x for x in started if isinstance(x, BaseException)]
    if failed:
        for x in started:
            if isinstance(x, Service):
                await x.stop()
            elif x is not None and not isinstance(x, BaseException):
                await stop(x)
        raise failed[0]
    return started


async def stop(actor) -> None:
    """Stop an actor made by `as_actor` and its processes."""
    _name_of.pop(id(actor), None)
    procs = _procs_of.pop(id(actor), None)
    if procs is not None:
        await get_provisioner().stop_procs(procs)
