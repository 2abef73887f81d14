"""RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to basics"): each reward minus the mean of the OTHER
rewards of its group, a baseline independent of the sample it is subtracted from; its loss REINFORCE's on each
answer's whole log-prob, the tokens' terms summed and the answers averaged (seq_sum).

Expected update: exactly the policy gradient of E[r] (unbiased), with the variance of a group baseline. Its
advantage is Dr.GRPO's times G / (G - 1). A group of one has nothing to compare with: zero.
"""

import torch

from forge_rl.core.estimators.estimator import Estimator, group_relative


def group_advantages(rewards: torch.Tensor, config) -> torch.Tensor:
    """rewards [G] of one group's rollouts -> advantages [G]."""
    rewards = rewards.float()
    g = rewards.numel()
    if g < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) * g / (g - 1)


ESTIMATOR = Estimator(group_relative(group_advantages), loss_agg="seq_sum")
