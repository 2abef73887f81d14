"""SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): GRPO's advantages, and in place of the hard
clip a smooth gate of each token's ratio, (4 / tau) sigmoid(tau (r - 1)), tau = sapo_tau_pos (1.0) for
positive advantages and sapo_tau_neg (1.05) for negative ones (core/loss.py `sapo`); its loss a mean over
each answer's tokens, then over answers (seq_mean), as the paper writes its objective.

Expected update: at ratio 1 GRPO's (the gate's slope there is 1); on later minibatches a token's gradient fades
smoothly as its ratio leaves 1, where the clip cuts it off at the band's edge.
"""

from forge_rl.core.estimators import grpo
from forge_rl.core.estimators.estimator import Estimator, group_relative

ESTIMATOR = Estimator(group_relative(grpo.group_advantages), loss_agg="seq_mean", policy_loss="sapo")
