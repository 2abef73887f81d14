"""What a name in `grpo.estimator` means: how its advantages are made, and the loss its paper trains them with
(aggregation, ratio level, policy loss, clip band), each a default the config may override."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from forge_rl.core.estimators.groups import group_rewards, rows_by_group
from forge_rl.core.estimators.turn_credit import turn_advantages
from forge_rl.core.types import Episode


@dataclass(frozen=True)
class Estimator:
    # (batch, rewards (one per episode), config, values (each episode's [T], or None)) -> per token [T] each
    advantages: Callable
    loss_agg: str  # core/loss.py AGGREGATIONS
    ratio_level: str = "token"  # token | sequence (GSPO)
    policy_loss: str = "clip"  # core/loss.py POLICY_LOSSES
    clip_low: float = 0.2  # the ratio's band [1 - clip_low, 1 + clip_high] (DAPO's clip-higher above)
    clip_high: float = 0.28
    batch_whitened: bool = False  # every trained token's advantage standardised over the whole batch (REINFORCE++)
    values: bool = False  # its baseline is a value head's (the trainer builds one)


def group_relative(group_advantages: Callable) -> Callable:
    """The `advantages` of an estimator that compares a group's rollouts: `group_advantages(rewards [R],
    config) -> [R]` on each group's rollouts (a chat-agent rollout sealed into several episodes counts once),
    every token of an episode given its rollout's, plus grpo.turn_credit x each answer's comparison with the
    group's answers in the same state, by the same function (turn_credit.py)."""

    def advantages(batch: list[Episode], rewards: list[float], config, values=None) -> list[torch.Tensor]:
        per_episode = torch.zeros(len(batch))
        for rows in rows_by_group(batch):
            group, index = group_rewards(batch, rewards, rows)
            per_episode[rows] = group_advantages(group, config)[index]
        per_token = [torch.full((len(e.tokens),), float(a)) for e, a in zip(batch, per_episode)]
        if config.turn_credit:
            steps = turn_advantages(batch, rewards, lambda r: group_advantages(r, config))
            per_token = [a + config.turn_credit * s for a, s in zip(per_token, steps)]
        return per_token

    return advantages
