"""Advantage estimation, one module per estimator, chosen by name (`grpo.estimator`): each module's ESTIMATOR
says how it makes advantages and which loss its paper trains them with (estimator.py); the table, with each
one's expected update and the test that proves it, is docs/estimators.md. On top of any group estimator:
`grpo.turn_credit` (turn_credit.py, GiGPO's per-turn comparison), `grpo.overlong_buffer` (DAPO's soft penalty
near max_tokens, a shaping of the reward), `grpo.kl_in_reward` (the KL as a per-token penalty in the return).
Advantages are per token, made once a batch.
"""

from __future__ import annotations

import torch

from forge_rl.core.estimators import cispo, dr_grpo, grpo, gspo, ppo, reinforce_pp, rloo, sapo
from forge_rl.core.estimators.estimator import Estimator
from forge_rl.core.estimators.groups import answer_turns, rollout_of
from forge_rl.core.types import Episode

ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo.ESTIMATOR, "dr_grpo": dr_grpo.ESTIMATOR, "rloo": rloo.ESTIMATOR, "reinforce_pp": reinforce_pp.ESTIMATOR,
    "ppo": ppo.ESTIMATOR, "gspo": gspo.ESTIMATOR, "cispo": cispo.ESTIMATOR, "sapo": sapo.ESTIMATOR,
}  # fmt: skip
WHITENING_EPS = 1e-6
LOSS_SETTINGS = ("loss_agg", "ratio_level", "policy_loss", "clip_low", "clip_high")


def loss_setting(config, key: str):
    """The config's `key` (one of LOSS_SETTINGS), or where it leaves it None its estimator's paper's."""
    value = getattr(config, key)
    return getattr(ESTIMATORS[config.estimator], key) if value is None else value


def estimate(
    batch: list[Episode], config, masks: list[torch.Tensor] | None = None, max_tokens: int | None = None,
    values: list[torch.Tensor] | None = None, kl: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Per token [T] advantages of each episode of `batch` (whole groups, the whole batch) under `config`
    (GRPOConfig). masks: each episode's trained positions [T] as the loss will see them (default: its
    loss_mask): what REINFORCE++'s standardisation averages over. max_tokens:
    sampling.max_tokens, for `overlong_buffer`. values: each episode's [T] (an estimator with `values`).
    kl: with `kl_in_reward`, each episode's per-token KL estimate [T] of the behaviour policy to the reference."""
    estimator = ESTIMATORS[config.estimator]
    masks = [e.loss_mask for e in batch] if masks is None else masks
    rewards = [e.reward for e in batch]
    if config.overlong_buffer:
        rewards = [r + p for r, p in zip(rewards, overlong_penalties(batch, config.overlong_buffer, max_tokens))]
    if estimator.values and values is None:
        raise ValueError(f"grpo.estimator {config.estimator}: advantages need each episode's values (a trainer with a value head)")
    per_token = estimator.advantages(batch, rewards, config, values)
    if config.kl_in_reward:
        per_token = [a - config.kl_coef * returns_to_go(k, m) for a, k, m in zip(per_token, kl, masks)]
    if estimator.batch_whitened:
        per_token = whitened(per_token, masks)
    return per_token


def returns_to_go(penalty: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[T] each trained position's sum of the per-token penalty [T] over it and every trained position after
    it (gamma = 1): the KL's share of the return from there (REINFORCE++, PPO-RLHF's reward)."""
    trained = torch.as_tensor(penalty).float() * (torch.as_tensor(mask) > 0)
    return trained.flip(0).cumsum(0).flip(0)


def whitened(per_token: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every advantage minus the mean, over the std, of the batch's trained tokens' (REINFORCE++)."""
    trained = torch.cat([a[torch.as_tensor(m) > 0] for a, m in zip(per_token, masks)])
    if trained.numel() < 2:
        return per_token
    mean, std = trained.mean(), trained.std(correction=0)
    return [(a - mean) / (std + WHITENING_EPS) for a in per_token]


def overlong_penalties(batch: list[Episode], buffer: int, max_tokens: int) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025) of each episode: 0 while its rollout's longest answer of
    L tokens is at most max_tokens - buffer, then falling linearly to -1 at max_tokens (where it was cut). Per
    rollout, so that the segments of a chat-agent rollout share it, as they share its reward."""
    longest: dict = {}
    for i, e in enumerate(batch):
        answer = max((end - start for start, end in answer_turns(e.loss_mask)), default=0)
        longest[rollout_of(batch, i)] = max(longest.get(rollout_of(batch, i), 0), answer)
    return [min(0.0, (max_tokens - buffer - longest[rollout_of(batch, i)]) / buffer) for i in range(len(batch))]
