"""REINFORCE++ with a group baseline (Hu et al. 2025, "REINFORCE++"; OpenRLHF's reinforce_baseline): each
reward minus its group's mean, then every trained token's advantage standardised over the WHOLE batch (its
mean subtracted, divided by its std: one scale for all groups, where GRPO gives each group its own), before
the batch is split into minibatches. With `grpo.kl_in_reward` the KL to the reference is a per-token penalty
in the return (the paper's form) rather than a loss term. Loss: token_mean, as OpenRLHF.

Expected update: the group-mean baseline gives (1 - 1/G) times the policy gradient of E[r]; the batch's mean
and std are one shift and one positive scale per step, computed from the batch itself: the direction of the
policy gradient up to that shift's (small, sample-dependent) bias, a consistent rather than an unbiased
estimate of its size.
"""

import torch

from forge_rl.core.estimators.estimator import Estimator, group_relative


def group_advantages(rewards: torch.Tensor, config) -> torch.Tensor:
    """rewards [G] of one group's rollouts -> advantages [G], before the batch's standardisation."""
    rewards = rewards.float()
    return rewards - rewards.mean()


ESTIMATOR = Estimator(group_relative(group_advantages), loss_agg="token_mean", batch_whitened=True)
