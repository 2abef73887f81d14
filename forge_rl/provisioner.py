"""Provisioner: allocates Monarch proc meshes and prepares each process for torch.distributed.

Every proc mesh gets, before any actor runs in it: MASTER_ADDR/MASTER_PORT (a free port per mesh, so two
meshes never join each other's process group), WORLD_SIZE, and CUDA_VISIBLE_DEVICES naming the GPUs this
mesh was given (one per proc, never shared between meshes). RANK and LOCAL_RANK are set per process by
`ForgeActor` from its Monarch rank, since a mesh-wide bootstrap does not know the rank.

Hosts: today every mesh lands on `this_host()`. The Kubernetes seam is the `host_mesh` argument: a job
started through `monarch.job.kubernetes` yields a HostMesh of pods, and passing it here places meshes on
those pods unchanged (MASTER_ADDR then has to be the first pod's address, which that job provides).
"""

from __future__ import annotations

import functools
import logging
import os

import monarch.actor
from monarch.actor import MeshFailure, ProcMesh, this_host

logger = logging.getLogger(__name__)

# Meshes whose processes died, by Monarch mesh name, recorded by the fault hook below.
failed_meshes: dict[str, str] = {}


def _record_fault(failure: MeshFailure) -> None:
    """Replace Monarch's default, which exits the controller when any proc dies (a stray KeyboardInterrupt).

    A dead replica is the service's business: it notices, stops routing there and restarts it.
    """
    failed_meshes[failure.mesh_name] = str(failure)
    logger.warning("forge_rl: a Monarch mesh failed: %s", str(failure).splitlines()[0])


def install_fault_hook() -> None:
    monarch.actor.unhandled_fault_hook = _record_fault


def _set_environment(env: dict[str, str]) -> None:
    """Runs first in every new process of a mesh (Monarch's `bootstrap`)."""
    os.environ.update(env)


class Provisioner:
    """Hands out proc meshes and GPUs; one per controller process (see `get_provisioner`)."""

    def __init__(self, host_mesh=None, num_gpus: int | None = None):
        self.host_mesh = host_mesh or this_host()
        if num_gpus is None:
            import torch

            num_gpus = torch.cuda.device_count()
        self.free_gpus = list(range(num_gpus))
        self.gpus_of: dict[int, list[int]] = {}  # id(proc mesh) -> GPUs it holds
        install_fault_hook()

    def spawn_procs(self, procs: int, with_gpus: bool = False, name: str = "forge") -> ProcMesh:
        from forge_rl.envs.client import free_port

        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(procs)}
        gpus = []
        if with_gpus:
            if len(self.free_gpus) < procs:
                raise RuntimeError(
                    f"{name}: needs {procs} GPU(s), {len(self.free_gpus)} free; "
                    "lower procs/num_replicas in the config or add GPUs"
                )
            gpus, self.free_gpus = self.free_gpus[:procs], self.free_gpus[procs:]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU meshes must not grab a GPU by accident
        mesh = self.host_mesh.spawn_procs(
            per_host={"procs": procs}, bootstrap=functools.partial(_set_environment, env), name=name
        )
        self.gpus_of[id(mesh)] = gpus
        return mesh

    async def stop_procs(self, mesh: ProcMesh) -> None:
        """Stop a mesh and return its GPUs. Safe on a mesh whose processes already died."""
        self.free_gpus += self.gpus_of.pop(id(mesh), [])
        try:
            await mesh.stop()
        except Exception as e:  # a dead mesh may refuse to stop; it holds nothing any more
            logger.info("forge_rl: stopping a failed mesh: %s", str(e).splitlines()[0])


_provisioner: Provisioner | None = None


def get_provisioner() -> Provisioner:
    global _provisioner
    if _provisioner is None:
        _provisioner = Provisioner()
    return _provisioner
