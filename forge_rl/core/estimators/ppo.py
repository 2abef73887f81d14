"""PPO's advantages (Schulman et al. 2017) from a learned value baseline: generalised advantage estimation
(GAE, Schulman et al. 2016) over the turns of each episode. No group is needed: it works with group size 1.

A turn is a run of sampled tokens (one answer); its state is every id before it, and its value V_k is the
value head's at the last of those ids (engines/titan/value_head.py), computed before the step's update. The
reward comes at the episode's end (an Episode carries one reward). With r_k = 0 before the last turn, r_K-1 =
the reward and V_K = 0:

    delta_k = r_k + gamma V_k+1 - V_k          A_k = sum_l (gamma lambda)^l delta_k+l

and every token of turn k gets A_k. A_k + V_k (the lambda-return) is turn k's value target.

Expected update: with lambda = gamma = 1 (the defaults) A_k = reward - V_k, the return minus a baseline of the
turn's state: exactly the policy gradient of E[reward] whatever the head has learnt (a state-dependent
baseline adds nothing in expectation); the head only lowers the variance. lambda < 1 bootstraps from the head:
less variance, but the policy gradient only as far as the head is right (exact values give it for any lambda).
gamma < 1 discounts later turns: a different objective. A chat-agent rollout sealed into several episodes has
each segment end with the rollout's reward, exact for gamma = lambda = 1. Loss: token_mean, as PPO's
per-timestep average and verl's default.
"""

from __future__ import annotations

import torch

from forge_rl.core.estimators.estimator import Estimator
from forge_rl.core.estimators.groups import answer_turns
from forge_rl.core.types import Episode


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """rewards [K] and values [K] of an episode's K turns (the episode ends after the last) -> advantages [K]."""
    next_values = torch.cat([values[1:], values.new_zeros(1)])
    deltas = rewards + gamma * next_values - values
    advantages, running = torch.zeros_like(deltas), 0.0
    for k in reversed(range(len(deltas))):
        running = deltas[k] + gamma * lam * running
        advantages[k] = running
    return advantages


def episode_advantages(batch: list[Episode], rewards: list[float], config, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per token [T] advantages of each episode: each turn's A_k on its sampled tokens, 0 elsewhere.
    values: each episode's [T], V of the state tokens[:p] at position p, read where each answer starts, under
    the weights before the batch's updates (fixed for all its minibatches and epochs, as PPO's Alg. 1)."""
    out = []
    for e, reward, v in zip(batch, rewards, values):
        turns = answer_turns(e.loss_mask)
        per_token = torch.zeros(len(e.tokens))
        if turns:
            turn_rewards = torch.zeros(len(turns))
            turn_rewards[-1] = float(reward)
            turn_values = torch.stack([torch.as_tensor(v[start]).float() for start, _ in turns])
            for (start, end), a in zip(turns, gae(turn_rewards, turn_values, config.gamma, config.gae_lambda)):
                per_token[start:end] = a
        out.append(per_token)
    return out


def turn_starts(mask: torch.Tensor) -> torch.Tensor:
    """[T] 1 at the first sampled token of each answer of a [T] loss mask: where a value is read and trained."""
    starts = torch.zeros(len(mask))
    for start, _ in answer_turns(mask):
        starts[start] = 1.0
    return starts


ESTIMATOR = Estimator(episode_advantages, loss_agg="token_mean", values=True)
