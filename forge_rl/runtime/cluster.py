"""Cluster: which machines each role runs on, as Monarch host meshes (the config's `cluster` section).

    local       every mesh on this host (`this_host()`), nothing to connect to
    workers     `python -m forge_rl.worker` processes at cluster.workers, attached with Monarch's
                attach_to_workers; the roles share them, a role with hosts=h takes the first h
    kubernetes  worker pods found by Monarch's KubernetesJob: one StatefulSet per role (k8s/),
                `trainer.hosts` pods for the trainer, and so on; this controller runs in the cluster

On every attached host a `HostAgent` answers what only that host knows: the address its peers reach it at,
a free port, its GPU count, its /dev/shm room, and whether it is still alive (to name a host that died).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import shutil
import socket

from monarch.actor import Actor, endpoint

from forge_rl.compat.monarch import channel_transport
from forge_rl.core.net import free_port

ROLES = ("trainer", "generator", "reference")
HOST_ENV = "FORGE_RL_HOST"  # set by forge_rl.worker: the address it was started on (--host)
WORKER_ENV = "FORGE_RL_WORKER"  # and its own tcp://host:port, which tells apart two workers of one address


def host_address() -> str:
    """The address other hosts reach this one at: the worker's --host, else this host's name resolved."""
    return os.environ.get(HOST_ENV) or socket.gethostbyname(socket.gethostname())


def shm_free_bytes() -> int:
    """Free bytes in this host's /dev/shm (0 without one): where shared-memory weight buffers go."""
    return shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0


def hostname_is_loopback() -> bool:
    try:
        addresses = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except socket.gaierror:
        return True
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def configure_transport(name: str) -> None:
    """The controller and its workers must agree. "auto": TcpWithHostname, unless this host's name resolves to
    loopback only, which Monarch refuses: then every host is this machine, and TcpWithLocalhost reaches them."""
    from monarch.config import configure

    if name == "auto":
        name = "localhost" if hostname_is_loopback() else "hostname"
    configure(default_transport=channel_transport(name))


class HostAgent(Actor):
    """One per attached host, alive for the whole run. Its endpoints answer at once (no heavy work)."""

    @endpoint
    async def describe(self) -> tuple[str, str | None, int]:
        """(address, worker address or None, GPU count) of this host."""
        gpus = 0
        if os.path.exists("/dev/nvidiactl"):
            import torch

            gpus = torch.cuda.device_count()
        return host_address(), os.environ.get(WORKER_ENV), gpus

    @endpoint
    async def free_port(self) -> int:
        return free_port()

    @endpoint
    async def shm_free_bytes(self) -> int:
        return shm_free_bytes()

    @endpoint
    async def ping(self) -> bool:
        return True


def connect_kubernetes(namespace: str, timeout_s: int, hosts: dict[str, int], transport: str = "auto") -> dict:
    """Role -> HostMesh of its Ready worker pods (label monarch.pytorch.org/mesh-name=<role>), in-cluster."""
    from monarch.job.kubernetes import KubernetesJob

    job = KubernetesJob(namespace=namespace, timeout=timeout_s)
    configure_transport(transport)  # KubernetesJob sets TcpWithHostname; the config has the last word
    for role, n in hosts.items():
        job.add_mesh(role, num_replicas=n)
    try:
        state = job.state(cached_path=None)
    except RuntimeError as e:
        raise RuntimeError(f"cluster.kubernetes: worker pods of {sorted(hosts)} in namespace {namespace!r}: {e}") from e
    return {role: getattr(state, role) for role in hosts}


async def connect(cluster, hosts: dict[str, int]) -> dict:
    """Role -> HostMesh for the roles in `hosts` (role -> host count), per the config's cluster section."""
    if cluster.mode == "workers":
        from monarch.actor import attach_to_workers

        mesh = attach_to_workers(ca="trust_all_connections", workers=cluster.workers, name="workers")
        try:
            await asyncio.wait_for(mesh.initialized, 60)
        except asyncio.TimeoutError:
            raise RuntimeError(f"cluster.workers: no answer within 60 s from {cluster.workers}") from None
        return {role: mesh for role in hosts}
    return connect_kubernetes(cluster.kubernetes.namespace, cluster.kubernetes.timeout_s, hosts, cluster.transport)
