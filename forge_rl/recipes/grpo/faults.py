"""What a run does when its trainer fails (a generator replica is its service's to restart: runtime/service.py).

The trainer is one mesh, not a service: when its processes die the run stops within seconds with TrainerLost.
`restarting` starts every actor anew from the last checkpoint: the buffer and generators hold later versions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from forge_rl.recipes.grpo.checkpoint import last_checkpoint
from forge_rl.runtime.actor import call
from forge_rl.runtime.service import is_dead

WATCH_INTERVAL_S = 2.0  # how often the trainer is pinged: a dead one stops the run within about this
MAX_RESTARTS_FROM_ONE_CHECKPOINT = 3  # a trainer that dies again and again before its next checkpoint is not retried forever

logger = logging.getLogger(__name__)


class TrainerLost(RuntimeError):
    """The trainer's processes died; the run cannot train on."""


def trainer_lost(run_dir: str, step: int, error: BaseException, pids: list[str]) -> TrainerLost:
    checkpoint = last_checkpoint(run_dir)
    where = f"step {checkpoint['step']} in {checkpoint['path']}; resume=true continues from it" if checkpoint else (
        "none yet (trainer.checkpoint_every)")
    lines = str(error).strip().splitlines()
    return TrainerLost(
        f"the trainer ({', '.join(pids) or 'its processes'}) died at step {step} "
        f"({lines[-1].strip() if lines else repr(error)}). Last checkpoint: {where}"
    )


async def watch_trainer(trainer, cfg, state, training) -> None:
    """Await `training` while pinging `trainer`: TrainerLost within seconds even while the loop waits on rollouts."""
    try:  # the ranks' places, recorded when the mesh started (an instant answer)
        where = await asyncio.wait_for(trainer._bind_rank.call(), 60)
        pids = [f"pid {w['pid']} on {w['host']}" for _, w in where.items()]
    except Exception:
        pids = []
    loop = asyncio.ensure_future(training)

    async def watchdog() -> BaseException:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:  # a train step holds the trainer's event loop: the ping then answers when it ends
                await call(trainer, "ping", timeout_s=cfg.trainer.timeout_s)
            except Exception as e:
                if is_dead(e):
                    return e

    dog = asyncio.ensure_future(watchdog())
    try:
        await asyncio.wait({loop, dog}, return_when=asyncio.FIRST_COMPLETED)
        if dog.done():
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            raise trainer_lost(cfg.run_dir, state.step, dog.result(), pids)
        error = loop.exception()
        if error is not None and is_dead(error) and not dog.done():
            try:  # the loop met a dead actor: was it the trainer?
                await call(trainer, "ping", timeout_s=60)
            except Exception as e:
                if is_dead(e):
                    raise trainer_lost(cfg.run_dir, state.step, e, pids) from error
        loop.result()
    finally:
        dog.cancel()
        loop.cancel()


async def restarting(main, cfg) -> None:
    """With trainer.restart_on_failure, `main` again with resume=true after a TrainerLost."""
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
