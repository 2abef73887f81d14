"""Provisioner: allocates Monarch proc meshes on their hosts and prepares each process for torch.distributed.

Every proc mesh gets MASTER_ADDR/MASTER_PORT (a free port on its host 0, so two meshes never join each other's
process group), WORLD_SIZE, and CUDA_VISIBLE_DEVICES (GPUs never shared between meshes); `ForgeActor` sets RANK
and LOCAL_RANK per process. Without `use_cluster` every mesh lands on `this_host()`; with it, a role's meshes go
to that role's hosts, and actors without a role (replay buffer) stay on the controller's host.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from dataclasses import dataclass, field

from monarch.actor import MeshFailure, ProcMesh, this_host

from forge_rl.compat.monarch import install_fault_hook
from forge_rl.core.errors import first_line
from forge_rl.core.net import free_port
from forge_rl.runtime import cluster

logger = logging.getLogger(__name__)

# Meshes whose processes died, by Monarch mesh name, recorded by the fault hook below.
failed_meshes: dict[str, str] = {}
STOP_TIMEOUT_S = 30.0  # a mesh on a dead host never answers stop()
AGENT_TIMEOUT_S = 120.0  # first answer of a new host agent (process start included)


def _record_fault(failure: MeshFailure) -> None:
    """Monarch's default exits the controller when any proc dies; a dead replica is the service's business."""
    failed_meshes[failure.mesh_name] = str(failure)
    logger.warning("forge_rl: a Monarch mesh failed: %s", first_line(failure))


def _set_environment(env: dict[str, str], gpus_by_host: dict[str, str]) -> None:
    """Runs first in every new process of a mesh (Monarch's `bootstrap`)."""
    os.environ.update(env)
    if len(gpus_by_host) == 1:
        (gpus,) = gpus_by_host.values()
    else:
        gpus = gpus_by_host[os.environ.get(cluster.WORKER_ENV) or cluster.host_address()]
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus  # "" on CPU meshes: they must not grab a GPU by accident


@dataclass
class Host:
    """One machine (or pod) meshes are placed on, and what runs there now."""

    address: str  # MASTER_ADDR when it is a mesh's host 0
    worker: str  # how the user named it: tcp://host:port of its worker, or "this host"
    free_gpus: list[int]
    agent: object = None  # its HostAgent (cluster.py); None for the controller's own host
    running: dict[int, str] = field(default_factory=dict)  # id(proc mesh) -> "Trainer ranks 2-3 of 4"

    async def free_port(self) -> int:
        if self.agent is None:
            return free_port()
        return await asyncio.wait_for(self.agent.free_port.call_one(), AGENT_TIMEOUT_S)

    async def shm_free_bytes(self) -> int:
        """Free bytes in this host's /dev/shm (0 without one): room for shared-memory weight buffers."""
        if self.agent is None:
            return cluster.shm_free_bytes()
        return await asyncio.wait_for(self.agent.shm_free_bytes.call_one(), AGENT_TIMEOUT_S)


class Provisioner:
    """Hands out proc meshes and GPUs; one per controller process (see `get_provisioner`)."""

    def __init__(self, host_mesh=None, num_gpus: int | None = None):
        self._local_mesh = host_mesh
        if num_gpus is None:
            import torch

            num_gpus = torch.cuda.device_count()
        self.local = Host("127.0.0.1", "this host", list(range(num_gpus)))
        self.roles: dict[str, tuple[object, list[Host]]] = {}  # role -> (HostMesh, its hosts in mesh order)
        self.placed: dict[int, list[tuple[Host, list[int]]]] = {}  # id(proc mesh) -> (host, GPUs it holds there)
        # Host agents' proc meshes, to stop at the end; the workers stand ready for the next controller.
        self.attached: list = []
        install_fault_hook(_record_fault)

    @property
    def local_mesh(self):
        if self._local_mesh is None:  # late: Monarch's transport must be configured first (use_cluster)
            self._local_mesh = this_host()
        return self._local_mesh

    async def use_cluster(self, config, hosts: dict[str, int]) -> None:
        """Attach the config's cluster section; `hosts` is role -> hosts it needs. A no-op when local."""
        if config.mode == "local":
            return
        cluster.configure_transport(config.transport)
        meshes = await cluster.connect(config, hosts)
        described: dict[int, list[Host]] = {}
        for role, mesh in meshes.items():
            if id(mesh) not in described:
                names = config.workers or [f"{role} pod {i}" for i in range(mesh.size("hosts"))]
                described[id(mesh)] = await self._describe(mesh, names)
            self.roles[role] = (mesh, described[id(mesh)])

    def host_of(self, role: str, index: int = 0, hosts: int = 1) -> Host:
        """Where a role's mesh starts (its rank 0), as `spawn_procs` places it."""
        role_hosts = self.roles[role][1] if role in self.roles else [self.local]
        return role_hosts[(index % hosts) % len(role_hosts)]

    def has_gpus(self) -> bool:
        """Whether the roles' hosts have GPUs: the workers' when a cluster is attached, else this host's."""
        hosts = [h for _, role_hosts in self.roles.values() for h in role_hosts] or [self.local]
        return any(h.free_gpus for h in hosts)

    async def _describe(self, host_mesh, names: list[str]) -> list[Host]:
        procs = host_mesh.spawn_procs(per_host={"procs": 1}, name="host_agents")
        self.attached.append(procs)
        agents = procs.spawn("host_agent", cluster.HostAgent)
        answers = await asyncio.wait_for(agents.describe.call(), AGENT_TIMEOUT_S)
        ranked = sorted(answers.items(), key=lambda kv: kv[0].rank)
        return [Host(address, worker or names[i], list(range(gpus)), agents.slice(hosts=i))
                for i, (_, (address, worker, gpus)) in enumerate(ranked)]

    async def spawn_procs(
        self, procs: int, with_gpus: bool = False, name: str = "forge", role: str | None = None, hosts: int = 1, first_host: int = 0,
        gpus_per_proc: int = 1,
    ) -> ProcMesh:
        """No role: this host. With GPUs, `gpus_per_proc` each, all of the mesh's visible to each process."""
        if role in self.roles:
            host_mesh, role_hosts = self.roles[role]
        else:
            host_mesh, role_hosts, first_host = self.local_mesh, [self.local], 0
        chosen = role_hosts[first_host : first_host + hosts]
        if len(chosen) < hosts:
            raise RuntimeError(f"{name}: needs {hosts} host(s), {role or 'this controller'} has {len(role_hosts)}")
        taken = []
        for host in chosen:
            n = procs * gpus_per_proc if with_gpus else 0
            if len(host.free_gpus) < n:
                raise RuntimeError(
                    f"{name}: needs {n} GPU(s) on {host.worker}, {len(host.free_gpus)} free; "
                    "lower procs/num_replicas in the config or add GPUs"
                )
            taken.append((host, host.free_gpus[:n]))
            host.free_gpus = host.free_gpus[n:]
        try:
            port = await chosen[0].free_port()
        except BaseException:
            self._give_back(taken)
            raise
        env = {"MASTER_ADDR": chosen[0].address, "MASTER_PORT": str(port), "WORLD_SIZE": str(procs * hosts)}
        gpus_by_host = {h.worker: ",".join(map(str, gpus)) for h, gpus in taken}
        if role in self.roles and len(role_hosts) > 1:
            host_mesh = host_mesh.slice(hosts=slice(first_host, first_host + hosts))
        mesh = host_mesh.spawn_procs(
            per_host={"procs": procs}, bootstrap=functools.partial(_set_environment, env, gpus_by_host), name=name
        )
        self.placed[id(mesh)] = taken
        for i, (host, _) in enumerate(taken):
            host.running[id(mesh)] = f"{name} ranks {i * procs}-{(i + 1) * procs - 1} of {procs * hosts}"
        return mesh

    def _give_back(self, taken: list[tuple[Host, list[int]]]) -> None:
        for host, gpus in taken:
            host.free_gpus += gpus

    async def stop_procs(self, mesh: ProcMesh) -> None:
        """Stop a mesh and return its GPUs. Safe on a mesh whose processes (or hosts) already died."""
        taken = self.placed.pop(id(mesh), [])
        self._give_back(taken)
        for host, _ in taken:
            host.running.pop(id(mesh), None)
        try:
            await asyncio.wait_for(mesh.stop(), STOP_TIMEOUT_S)
        except Exception as e:  # a dead mesh may refuse to stop; it holds nothing any more
            logger.info("forge_rl: stopping a failed mesh: %s", first_line(e))

    async def lost_hosts(self, timeout_s: float = 10.0) -> list[Host]:
        """The attached hosts whose agent no longer answers: their worker (or pod) died."""
        hosts = {id(h): h for _, role_hosts in self.roles.values() for h in role_hosts}.values()

        async def alive(host) -> bool:
            try:
                return await asyncio.wait_for(host.agent.ping.call_one(), timeout_s)
            except Exception:
                return False

        answers = await asyncio.gather(*(alive(h) for h in hosts))
        return [h for h, ok in zip(hosts, answers) if not ok]

    async def stop(self) -> None:
        """Stop the host agents (the workers stay up, ready for the next run)."""
        for procs in self.attached:
            try:
                await asyncio.wait_for(procs.stop(), STOP_TIMEOUT_S)
            except Exception as e:
                logger.info("forge_rl: stopping host agents: %s", first_line(e))
        self.attached, self.roles = [], {}


_provisioner: Provisioner | None = None


def get_provisioner() -> Provisioner:
    global _provisioner
    if _provisioner is None:
        _provisioner = Provisioner()
    return _provisioner
