"""GRPO (Shao et al. 2024, DeepSeekMath): each reward minus its group's mean, divided by the group's std;
its loss a mean over each answer's tokens, then over answers (seq_mean).

Expected update: within a group, the std and the mean include the sample's own reward, and seq_mean weighs a
token by 1/|o|: the gradient of a length-normalised objective, re-weighted per prompt by how its rewards
spread (Liu et al. 2025). With 0/1 rewards and k of G passing, prompt x's share is
E_k[k (G - k) / (G (std_k + eps))] x (g_pass / p - g_fail / (1 - p)) / G, where p is its pass rate and g_pass,
g_fail sum grad pi(y) / |y| over the passing and failing answers (tests/test_exact_gradient.py): an ascent
direction for every prompt, not for E[r] as a whole. A group whose rewards are all equal gets zeros.
"""

import torch

from forge_rl.core.estimators.estimator import Estimator, group_relative

EPS = 1e-6


def group_advantages(rewards: torch.Tensor, config) -> torch.Tensor:
    """rewards [G] of one group's rollouts -> advantages [G]."""
    rewards = rewards.float()
    return (rewards - rewards.mean()) / (rewards.std(correction=0) + EPS)


ESTIMATOR = Estimator(group_relative(group_advantages), loss_agg="seq_mean")
