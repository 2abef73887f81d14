"""What a run does when one of its parts fails: the handling that is neither a service's (forge_rl/service.py
restarts replicas) nor the training loop's.

- `catch_up`: a restarted generator replica starts from the model directory (version 0); it loads the
  newest version the trainer has pushed, again until no newer one appeared meanwhile, before it takes calls.
- `fit_sessions_to_server`: the run's pool of environment sessions never asks a server for more sessions
  than it accepts (a full server refuses the next one with EnvCapacityError, mid-run).
- `watch_trainer`: the trainer is one mesh, not a service; when its processes die the run stops within
  seconds with TrainerLost, which names the trainer and the last checkpoint. `restarting` runs the job
  again from that checkpoint when trainer.restart_on_failure is set (every actor is started anew: the
  replay buffer and the generators hold data and weights of versions after the checkpoint).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import urllib.request

from forge_rl import store
from forge_rl.actor import call
from forge_rl.checkpoint import last_checkpoint
from forge_rl.config import ConfigError
from forge_rl.service import is_dead

WATCH_INTERVAL_S = 2.0  # how often the trainer is pinged: a dead one stops the run within about this
MAX_RESTARTS_FROM_ONE_CHECKPOINT = 3  # a trainer that dies again and again before its next checkpoint is not retried forever

logger = logging.getLogger(__name__)


async def latest_pushed_version(prefix: str = "policy") -> int:
    """The newest version whose handle is in TorchStore (a push puts it last, once the bytes can be
    fetched); 0 (the model directory) when none is."""
    for version in reversed(await store.list_versions(prefix)):
        if await store.get_handle(version, prefix) is not None:
            return version
    return 0


async def catch_up(replica, prefix: str = "policy") -> None:
    """Service.after_restart for generators: load the newest pushed weights into a restarted replica.
    Looped because a push may land while it loads (the fanout of that version skipped this replica,
    which was not yet healthy)."""
    loaded = 0
    while (latest := await latest_pushed_version(prefix)) > loaded:
        await replica.actor.update_weights.call(latest)
        logger.warning("generator replica %d restarted and caught up to weights version %d", replica.index, latest)
        loaded = latest


def server_capacity(url: str, timeout_s: float) -> int | None:
    """The sessions the server at `url` accepts, from its /health (`max_concurrent_envs`, which forge_rl's
    servers report); None when it does not say. ConfigError if /health does not answer."""
    health_url = url.replace("ws://", "http://").replace("wss://", "https://").rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health_url, timeout=timeout_s) as response:
            health = json.loads(response.read() or b"{}")
    except (OSError, ValueError) as e:
        raise ConfigError(f"env.url: {health_url} does not answer ({e}); is the environment server running?") from None
    capacity = health.get("max_concurrent_envs") if isinstance(health, dict) else None
    return int(capacity) if isinstance(capacity, int) and capacity > 0 else None


def fit_sessions_to_server(url: str, wanted: int, group_size: int, timeout_s: float) -> int:
    """How many sessions the run's pool may hold against the server at `url`: `wanted` (env.max_concurrent),
    or the server's capacity when that is smaller, said once. A server that cannot hold one group's games
    at once stops the run here, before anything is launched, naming both numbers and both fixes."""
    capacity = server_capacity(url, timeout_s)
    if capacity is None or capacity >= wanted:
        return wanted
    if capacity < group_size:
        raise ConfigError(
            f"env.url: the server at {url} accepts {capacity} sessions (its /health max_concurrent_envs), fewer than "
            f"one group's grpo.group_size={group_size} games and env.max_concurrent={wanted}: start it with "
            f"MAX_CONCURRENT_ENVS={wanted} (or --max-concurrent-envs {wanted}), or set env.max_concurrent and "
            f"grpo.group_size to at most {capacity}"
        )
    logger.warning(
        "env.max_concurrent is %d but the server at %s accepts %d sessions (its /health): the run holds at most %d; "
        "start the server with MAX_CONCURRENT_ENVS=%d to play more games at once", wanted, url, capacity, capacity, wanted,
    )
    return capacity


class TrainerLost(RuntimeError):
    """The trainer's processes died; the run cannot train on."""


def trainer_lost(run, error: BaseException, pids: list[str]) -> TrainerLost:
    checkpoint = last_checkpoint(run.cfg.run_dir)
    where = f"step {checkpoint['step']} in {checkpoint['path']}; resume=true continues from it" if checkpoint else (
        "none yet (trainer.checkpoint_every)")
    lines = str(error).strip().splitlines()
    return TrainerLost(
        f"the trainer ({', '.join(pids) or 'its processes'}) died at step {run.step} "
        f"({lines[-1].strip() if lines else repr(error)}). Last checkpoint: {where}"
    )


async def watch_trainer(run, training) -> None:
    """Await the coroutine `training` (the training loop) while pinging the trainer every WATCH_INTERVAL_S.
    If the trainer's processes die, whether the loop is waiting on it or on rollouts, raise TrainerLost
    within seconds (the loop is cancelled). Other failures of the loop pass through unchanged."""
    try:  # the ranks' places, recorded when the mesh started (an instant answer)
        where = await asyncio.wait_for(run.trainer._bind_rank.call(), 60)
        pids = [f"pid {w['pid']} on {w['host']}" for _, w in where.items()]
    except Exception:
        pids = []
    loop = asyncio.ensure_future(training)

    async def watchdog() -> BaseException:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:  # a train step holds the trainer's event loop: the ping then answers when it ends
                await call(run.trainer, "ping", timeout_s=run.cfg.trainer.timeout_s)
            except Exception as e:
                if is_dead(e):
                    return e

    dog = asyncio.ensure_future(watchdog())
    try:
        await asyncio.wait({loop, dog}, return_when=asyncio.FIRST_COMPLETED)
        if dog.done():
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            raise trainer_lost(run, dog.result(), pids)
        error = loop.exception()
        if error is not None and is_dead(error) and not dog.done():
            try:  # the loop met a dead actor: was it the trainer?
                await call(run.trainer, "ping", timeout_s=60)
            except Exception as e:
                if is_dead(e):
                    raise trainer_lost(run, e, pids) from error
        loop.result()
    finally:
        dog.cancel()
        loop.cancel()


async def restarting(main, cfg) -> None:
    """`main(cfg)` (forge_rl.grpo.main); with trainer.restart_on_failure, when it stops with TrainerLost,
    `main` again with resume=true from the last checkpoint (shut down in between, so every actor restarts)."""
    restarts_here = {}
    while True:
        try:
            return await main(cfg)
        except TrainerLost as e:
            checkpoint = last_checkpoint(cfg.run_dir)
            step = checkpoint["step"] if checkpoint else 0
            restarts_here[step] = restarts_here.get(step, 0) + 1
            if not cfg.trainer.restart_on_failure or checkpoint is None or restarts_here[step] > MAX_RESTARTS_FROM_ONE_CHECKPOINT:
                raise
            print(f"forge_rl: {e}. trainer.restart_on_failure: starting again from step {step}", flush=True)
            cfg = dataclasses.replace(cfg, resume=True)
