"""Which transport a run's weights take, decided once at set-up from where its roles run.

    auto       shm when the trainer and every generator share a host and its /dev/shm holds two buffers;
               broadcast when they do not; else store
    shm | broadcast | store   as asked (shm refused when the generators are elsewhere)
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_rl.weights import shm

MODES = ("auto", "shm", "broadcast", "store")


def choose(mode: str, same_host: bool, fits: bool) -> str:

    if mode not in MODES:
        raise ValueError(f"generator.weight_sync: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    if not same_host:
        return "broadcast"
    return "shm" if fits else "store"


@dataclass
class SyncPlan:
    """Hosts are the provisioner's: `address`, and async `shm_free_bytes()` and `free_port()` run on that host."""

    kind: str
    trainer_host: object  # where the trainer's rank 0 runs: it writes the buffers, or sends the broadcast
    generator_hosts: list  # where each generator replica runs, in replica order

    @property
    def rendezvous(self) -> str:
        """Broadcast: the trainer rank 0's address; it binds there and hosts the group's TCPStore."""
        return self.trainer_host.address

    @property
    def binds(self) -> list[str]:
        """Broadcast: the address each replica's vLLM workers bind their connections to."""
        return [h.address for h in self.generator_hosts]


async def plan(mode: str, trainer_host, generator_hosts: list, nbytes: int) -> SyncPlan:
    """Hosts are the same host when their addresses are (workers on one address share its /dev/shm)."""
    same_host = all(h.address == trainer_host.address for h in generator_hosts)
    if mode == "shm" and not same_host:
        elsewhere = sorted({h.address for h in generator_hosts} - {trainer_host.address})
        raise ValueError(f"generator.weight_sync: shm needs the generators on the trainer's host {trainer_host.address}, "
                         f"but some run on {', '.join(elsewhere)}; use auto, broadcast or store")
    fits = mode == "auto" and same_host and shm.fits(nbytes, await trainer_host.shm_free_bytes())
    return SyncPlan(choose(mode, same_host, fits), trainer_host, list(generator_hosts))
