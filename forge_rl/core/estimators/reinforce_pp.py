"""REINFORCE++ with a group baseline (Hu et al. 2025, "REINFORCE++"): each reward minus its group's mean, then
every advantage of the batch divided by their standard deviation over the batch (one scale for all groups,
where GRPO gives each group its own).

Expected update: the group-mean baseline gives (1 - 1/G) times the policy gradient of E[r]; the batch's
std is one positive number per step, so the direction is the policy gradient's (the scale, computed from
the batch itself, makes it a consistent rather than an unbiased estimate of the gradient's size).
"""

import torch

EPS = 1e-6


def group_advantages(rewards: torch.Tensor, config) -> torch.Tensor:
    """rewards [G] of one group's rollouts -> advantages [G], before the batch's scale."""
    rewards = rewards.float()
    return rewards - rewards.mean()


def batch_scale(advantages: torch.Tensor) -> float:
    """The one number every advantage of the batch is divided by: the std of the rollouts' advantages [R]."""
    return float(advantages.std(correction=0)) + EPS if advantages.numel() > 1 else 1.0
