"""GRPO (Shao et al. 2024, DeepSeekMath): each reward minus its group's mean, divided by the group's std.

Expected update: within a group, (1 - 1/G) times the policy gradient (the group mean includes the sample's
own reward), scaled by 1/std. The scale differs between groups, so over a batch it is the gradient of a
re-weighted objective in which groups whose rewards barely differ weigh most (Liu et al. 2025): an ascent
direction for every prompt, not for E[r] as a whole. A group whose rewards are all equal gets zeros.
"""

import torch

EPS = 1e-6


def group_advantages(rewards: torch.Tensor, config) -> torch.Tensor:
    """rewards [G] of one group's rollouts -> advantages [G]."""
    rewards = rewards.float()
    return (rewards - rewards.mean()) / (rewards.std(correction=0) + EPS)
