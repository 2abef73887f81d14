"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): GRPO's advantages, with the importance
ratio and its clip taken per SEQUENCE, its length-normalised ratio (pi / pi_old)^(1/|o|), and the loss a mean
over sequences (seq_mean); the paper's clip band is small, 3e-4 below and 4e-4 above, since a sequence's
geometric-mean ratio stays close to 1.

Expected update: at ratio 1 (the first optimizer step of a batch) GRPO's, a token weighed by 1/|o|; on later
minibatches each sequence's tokens move together by its ratio, and a sequence outside the band drops out whole.
"""

from forge_rl.core.estimators import grpo
from forge_rl.core.estimators.estimator import Estimator, group_relative

ESTIMATOR = Estimator(
    group_relative(grpo.group_advantages), loss_agg="seq_mean", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4
)
