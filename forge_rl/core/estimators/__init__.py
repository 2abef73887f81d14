"""Advantage estimation, one module per estimator, chosen by name (`grpo.estimator`).

| name           | baseline of a rollout's reward          | expected update                                  |
|----------------|------------------------------------------|--------------------------------------------------|
| `grpo`         | group mean, divided by the group's std   | per prompt an ascent direction, groups re-weighted |
| `dr_grpo`      | group mean                               | (1 - 1/G) x the policy gradient                  |
| `rloo`         | mean of the group's OTHER rewards        | the policy gradient (unbiased)                   |
| `reinforce_pp` | group mean, divided by the batch's std   | the policy gradient's direction                  |
| `ppo`          | a learned value of each turn's state, GAE | the policy gradient with lambda = gamma = 1     |

On top of any of them: `grpo.turn_credit` (turn_credit.py, GiGPO's per-turn comparison, sound),
`grpo.overlong_buffer` (DAPO's soft penalty on answers near max_tokens, a shaping of the reward) and
`grpo.centre_per_answer` (centring.py, a change of objective). Each module is a function over a group's
rewards (ppo's, over an episode's turns and the values the trainer's value head gave them); a new estimator is
a new module and a line in ESTIMATORS. Advantages are always per token.
"""

from __future__ import annotations

import torch

from forge_rl.core.estimators import dr_grpo, grpo, ppo, reinforce_pp, rloo
from forge_rl.core.estimators.centring import centre_per_answer
from forge_rl.core.estimators.groups import answer_turns, group_rewards, rows_by_group
from forge_rl.core.estimators.turn_credit import turn_advantages
from forge_rl.core.types import Episode

ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp, "ppo": ppo}


def estimate(
    batch: list[Episode], config, masks: list[torch.Tensor] | None = None, max_tokens: int | None = None,
    values: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Per token [T] advantages of each episode of `batch` (whole groups) under `config` (GRPOConfig).

    masks: each episode's trained positions [T] as the loss will see them (after `max_token_age`); by
    default its loss_mask. Only centring reads them: the rest compares rewards, whoever is trained.
    max_tokens: sampling.max_tokens, for `overlong_buffer`. values: ppo's, each episode's [T] (ppo.py)."""
    estimator = ESTIMATORS[config.estimator]
    rewards = [e.reward for e in batch]
    if config.overlong_buffer:
        rewards = [r + overlong_penalty(e, config.overlong_buffer, max_tokens) for r, e in zip(rewards, batch)]
    if config.estimator == "ppo":  # a baseline per turn from the value head, no group
        if values is None:
            raise ValueError("grpo.estimator ppo: advantages need each episode's values (a trainer with a value head)")
        return ppo.episode_advantages(batch, rewards, values, config)

    def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
        return estimator.group_advantages(rewards, config)

    per_episode, per_rollout = torch.zeros(len(batch)), []
    for rows in rows_by_group(batch):
        group, index = group_rewards(batch, rewards, rows)  # a rollout sealed into several episodes counts once
        advantages = group_advantages(group)
        per_episode[rows] = advantages[index]
        per_rollout.append(advantages)
    per_token = [torch.full((len(e.tokens),), float(a)) for e, a in zip(batch, per_episode)]
    if config.turn_credit:
        steps = turn_advantages(batch, rewards, group_advantages)
        per_token = [a + config.turn_credit * s for a, s in zip(per_token, steps)]
    if hasattr(estimator, "batch_scale"):
        scale = estimator.batch_scale(torch.cat(per_rollout))
        per_token = [a / scale for a in per_token]
    if config.centre_per_answer:
        masks = [e.loss_mask for e in batch] if masks is None else masks
        per_token = centre_per_answer(per_token, [e.tokens for e in batch], masks)
    return per_token


def overlong_penalty(episode: Episode, buffer: int, max_tokens: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025) on the episode's longest answer of L tokens: 0 up to
    max_tokens - buffer, then falling linearly to -1 at max_tokens (where the answer was cut)."""
    longest = max((end - start for start, end in answer_turns(episode.loss_mask)), default=0)
    return min(0.0, (max_tokens - buffer - longest) / buffer)
