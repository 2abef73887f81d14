"""Service: N replicas of one actor mesh behind a single handle.

Two verbs (TorchForge's): `route()` sends a call to one healthy replica, `fanout()` to every healthy replica.

Invariants:
- Every call has a timeout; a hung actor raises TimeoutError in the caller, never hangs it.
- An exception raised inside an actor re-raises in the caller; it says nothing about the replica's health,
  so it is not retried.
- A replica whose processes died, or whose actor raises ReplicaDead, stops receiving calls at once and is
  restarted in the background; the call that found it dead is retried once on a healthy replica. A fanout
  leaves a dead replica out instead of failing: `after_restart` brings the restarted replica up to date.
- Calls with the same `session` go to the same replica while it is healthy, which holds their KV cache.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from monarch.actor import ActorError

from forge_rl.compat.monarch import SupervisionError
from forge_rl.core.errors import first_line
from forge_rl.runtime.provisioner import get_provisioner

logger = logging.getLogger(__name__)


class NoHealthyReplica(RuntimeError):
    pass


class ReplicaDead(RuntimeError):
    """Raised by a live actor that can no longer serve (a Generator whose vLLM engine process died):
    a service treats its replica as it treats one whose processes died."""


@dataclass
class Replica:
    index: int
    procs: object = None  # Monarch ProcMesh
    actor: object = None  # Monarch actor mesh
    healthy: bool = False
    in_flight: int = 0
    restarts: int = 0
    restarting: asyncio.Task | None = field(default=None, repr=False)
    probe: asyncio.Task | None = field(default=None, repr=False)  # the health probe in flight


class Service:
    def __init__(
        self,
        launcher,
        args: tuple = (),
        kwargs: dict | None = None,
        policy: str = "round_robin",
        call_timeout_s: float = 300.0,
        health_interval_s: float = 2.0,
    ):
        if policy not in ("round_robin", "least_loaded"):
            raise ValueError(f"service policy {policy!r}: expected 'round_robin' or 'least_loaded'")
        self.launcher, self.args, self.kwargs = launcher, args, kwargs or {}
        self.name = launcher.actor_cls.__name__
        self.policy, self.call_timeout_s, self.health_interval_s = policy, call_timeout_s, health_interval_s
        self.replicas = [Replica(i) for i in range(launcher.num_replicas)]
        self.sessions: dict[object, int] = {}
        self._turn = itertools.count()
        self._health_task: asyncio.Task | None = None
        # Called with a restarted replica before it takes calls again (e.g. load the current weights).
        self.after_restart: Callable[[Replica], Awaitable[None]] | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn every replica; if any fails, stop those that started and raise its error."""
        spawned = await asyncio.gather(*(self._spawn(r) for r in self.replicas), return_exceptions=True)
        failed = [e for e in spawned if isinstance(e, BaseException)]
        if failed:
            await self.stop()
            raise failed[0]
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task:
            self._health_task.cancel()
        for r in self.replicas:
            for task in (r.restarting, r.probe):
                if task:
                    task.cancel()
            r.healthy = False
            if r.procs is not None:
                await get_provisioner().stop_procs(r.procs)
                r.procs = r.actor = None

    async def _spawn(self, replica: Replica, restarting: bool = False) -> None:
        replica.procs, replica.actor = await self.launcher.spawn_mesh(*self.args, replica=replica.index, **self.kwargs)
        if restarting and self.after_restart is not None:
            try:
                await self.after_restart(replica)
            except BaseException:  # stop the mesh it made: the next attempt makes another (a vLLM engine each)
                procs, replica.procs, replica.actor = replica.procs, None, None
                await get_provisioner().stop_procs(procs)
                raise
        replica.healthy = True

    def _mark_dead(self, replica: Replica, why: str, actor=None) -> None:
        """`actor`: the mesh the failed call went to; if the replica has been restarted since, its new mesh is left alone."""
        if not replica.healthy or (actor is not None and actor is not replica.actor):
            return
        replica.healthy = False
        logger.warning("%s replica %d is down (%s); restarting it", self.name, replica.index, why)
        replica.restarting = asyncio.create_task(self._restart(replica))

    async def _restart(self, replica: Replica) -> None:
        if replica.procs is not None:
            await get_provisioner().stop_procs(replica.procs)
        replica.procs = replica.actor = None
        while True:
            try:
                await self._spawn(replica, restarting=True)
                replica.restarts += 1
                return
            except Exception as e:
                logger.warning("%s replica %d failed to restart: %s", self.name, replica.index, e)
                await asyncio.sleep(self.health_interval_s)

    async def _health_loop(self) -> None:
        """Each probe in a task of its own: one that hangs delays no other, and gets no second until it ends."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            for r in self.replicas:
                if r.healthy and (r.probe is None or r.probe.done()):
                    r.probe = asyncio.create_task(self._probe(r))

    async def _probe(self, replica: Replica) -> None:
        """Any error but death or a timeout is logged, so probing outlives whatever one probe runs into."""
        try:
            await asyncio.wait_for(replica.actor.ping.call(), self.call_timeout_s)
        except Exception as e:
            if is_dead(e) or isinstance(e, asyncio.TimeoutError):
                self._mark_dead(replica, f"health probe: {_first_line(e)}")
                return
            logger.warning("%s replica %d: health probe failed: %s", self.name, replica.index, _first_line(e))

    # ---- calls -------------------------------------------------------------------------------------

    def _pick(self, session) -> Replica:
        healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            raise NoHealthyReplica(f"{self.name}: no healthy replica (of {len(self.replicas)}) to take the call")
        if session is not None and session in self.sessions:
            sticky = self.replicas[self.sessions[session]]
            if sticky in healthy:
                return sticky
        least_loaded = self.policy == "least_loaded"
        chosen = min(healthy, key=lambda r: (r.in_flight, r.index)) if least_loaded else healthy[next(self._turn) % len(healthy)]
        if session is not None:
            self.sessions[session] = chosen.index
        return chosen

    async def _call(self, replica: Replica, endpoint: str, args, kwargs, timeout):
        """One replica; returns the value of a 1-proc mesh, or the list of per-rank values."""
        method = getattr(replica.actor, endpoint)
        replica.in_flight += 1
        try:
            call = (method.call_one if self.launcher.procs == 1 else method.call)(*args, **kwargs)
            try:
                result = await asyncio.wait_for(call, timeout)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"{self.name}.{endpoint} on replica {replica.index} took longer than {timeout} s"
                ) from None
        finally:
            replica.in_flight -= 1
        return result if self.launcher.procs == 1 else [v for _, v in result.items()]

    async def _pick_or_wait(self, session, timeout: float) -> Replica:
        """A healthy replica; while none is but some are restarting, wait for one (up to `timeout`)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                return self._pick(session)
            except NoHealthyReplica:
                restarting = any(r.restarting is not None and not r.restarting.done() for r in self.replicas)
                if not restarting or asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(0.1)

    async def route(self, endpoint: str, *args, session=None, timeout: float | None = None, **kwargs):

        timeout = timeout or self.call_timeout_s
        replica = await self._pick_or_wait(session, timeout)
        actor = replica.actor
        try:
            return await self._call(replica, endpoint, args, kwargs, timeout)
        except Exception as e:
            if not is_dead(e):
                raise
            self._mark_dead(replica, _first_line(e), actor)
            retry = await self._pick_or_wait(session, timeout)
            if session is not None:
                self.sessions[session] = retry.index
            return await self._call(retry, endpoint, args, kwargs, timeout)

    def healthy(self) -> list[int]:
        """The indices of the replicas taking calls now."""
        return [r.index for r in self.replicas if r.healthy]

    async def fanout(self, endpoint: str, *args, timeout: float | None = None, to: list[int] | None = None, **kwargs) -> list:
        """The results of the replicas (of those in `to`) that answered, in replica order; fails only on a live
        replica's error, or when no replica is up and none is restarting."""
        timeout = timeout or self.call_timeout_s
        targets = [r for r in self.replicas if r.healthy and (to is None or r.index in to)]
        if not targets and not any(r.restarting is not None and not r.restarting.done() for r in self.replicas):
            raise NoHealthyReplica(f"{self.name}: no healthy replica to fan out {endpoint!r} to")
        actors = [r.actor for r in targets]
        results = await asyncio.gather(
            *(self._call(r, endpoint, args, kwargs, timeout) for r in targets), return_exceptions=True
        )
        dead = [isinstance(res, Exception) and is_dead(res) for res in results]
        for r, actor, res, died in zip(targets, actors, results, dead):
            if died:
                self._mark_dead(r, _first_line(res), actor)
        errors = [res for res, died in zip(results, dead) if isinstance(res, BaseException) and not died]
        if errors:
            raise errors[0]
        return [res for res, died in zip(results, dead) if not died]

    async def wait_healthy(self, timeout: float = 120.0) -> None:
        """Wait until every replica is healthy again (after restarts)."""
        async with asyncio.timeout(timeout):
            while not all(r.healthy for r in self.replicas):
                await asyncio.sleep(0.1)


def is_dead(e: BaseException) -> bool:
    """Does this error of a call say its replica is dead (processes gone, or the actor says ReplicaDead)?"""
    return isinstance(e, (SupervisionError, ReplicaDead)) or (
        isinstance(e, ActorError) and isinstance(e.exception, ReplicaDead)
    )


def _first_line(e: BaseException) -> str:
    """The first line of an error's message; of a remote actor's error, that of the error it raised."""
    return first_line(e.exception if isinstance(e, ActorError) else e)
