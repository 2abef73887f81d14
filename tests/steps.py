"""A train step as the learner takes one (recipes/grpo/learner.py): the batch's data (advantages, ...) fixed
first, with the trainer's `score_batch` where the objective needs it, then `Trainer.train_step` on it."""

from __future__ import annotations

import asyncio

from forge_rl.engines.titan.trainer import Trainer
from forge_rl.recipes.grpo.learner import batch_data


def data_of(trainer: Trainer, batch, loss_fn=None) -> tuple[dict, dict]:
    """The data of `batch` for a trainer built in this process (its own loss_fn unless given), and the
    figures of the batch's start (ppo: the value head's fit)."""

    async def score(*args):
        return await Trainer.score_batch._method(trainer, *args)

    return asyncio.run(batch_data(loss_fn or trainer.loss_fn, batch, trainer.policy_version, score))


def train_step(trainer: Trainer, batch, ref=None, imitate=None) -> dict:
    """One batch of one optimizer step on a trainer built in this process: its metrics and the batch's start figures."""
    data, figures = data_of(trainer, batch)
    return {**asyncio.run(Trainer.train_step._method(trainer, batch, data, ref, imitate)), **figures}


async def actor_data(trainer, loss_fn, batch, trained_version: int = 0) -> tuple[dict, dict]:
    """The data of `batch` for a Trainer actor (any number of ranks) built with `loss_fn`, and the figures."""

    async def score(*args):
        return (await trainer.score_batch.call(*args)).item(procs=0)

    return await batch_data(loss_fn, batch, trained_version, score)


def plain_data(loss_fn, batch, trained_version: int = 0) -> dict:
    """The data of `batch` for an objective that needs nothing of the trainer's weights (no value head, no
    entropy floor)."""
    assert not (loss_fn.value_head or loss_fn.entropy_floor), "this objective needs the trainer: actor_data"
    return loss_fn.batch_data(batch, loss_fn.masks(batch, trained_version))[0]
