"""Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): each reward minus its group's mean,
without GRPO's division by the std (which over-weights groups whose rewards barely differ), and its loss
every token's term summed over a constant, sequences x sampling.max_tokens (token_sum), without GRPO's 1/|o|
(which favours long wrong answers and short right ones).

Expected update: (1 - 1/G) times the policy gradient of E[r], divided by max_tokens (the mean includes the
sample's own reward): an unbiased direction, a constant factor off in size.

`grpo.normalize_mean` divides instead by the group's mean absolute reward. For rewards >= 0 (pass/fail)
that is the gradient of log E[r] per prompt rather than of E[r] (maximum-likelihood RL): with 0/1 rewards
and k of G passing, each pass gets (G - k) / k and each failure -1, so every group that found a pass weighs
as one labelled example however likely the policy already made it (plain Dr.GRPO weighs a group by
G q (1 - q), q = k / G). A positive weight per prompt: still an ascent direction for each. Signed rewards
have no such reading; divided by the mean ABSOLUTE reward no advantage exceeds G + 1 in size ([1, 0, 0,
-0.9] would otherwise give the pass 39). A group of zero rewards gets zeros.
"""

import torch

from forge_rl.core.estimators.estimator import Estimator, group_relative

EPS = 1e-6


def group_advantages(rewards: torch.Tensor, config) -> torch.Tensor:
    """rewards [G] of one group's rollouts -> advantages [G]."""
    rewards = rewards.float()
    centred = rewards - rewards.mean()
    if config.normalize_mean:
        scale = rewards.abs().mean()
        return centred / scale if scale > EPS else torch.zeros_like(centred)
    return centred


ESTIMATOR = Estimator(group_relative(group_advantages), loss_agg="token_sum")
