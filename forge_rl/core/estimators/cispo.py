"""CISPO (MiniMax-M1, 2025): GRPO's advantages, REINFORCE on each token's log-prob weighted by its importance
ratio, the weight clipped above at 1 + clip_high (no lower bound, as the paper) and stopped from the gradient
(core/loss.py `cispo`); its loss a mean over the batch's tokens (token_mean).

Expected update: at ratio 1 the policy gradient's REINFORCE form with GRPO's advantages, every token weighed
alike; on later minibatches every token keeps a gradient, weighted by its (bounded) ratio, where PPO's clip
drops the clipped tokens' gradients altogether.
"""

from forge_rl.core.estimators import grpo
from forge_rl.core.estimators.estimator import Estimator, group_relative

ESTIMATOR = Estimator(group_relative(grpo.group_advantages), loss_agg="token_mean", policy_loss="cispo")
