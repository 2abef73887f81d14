"""The policy loss as small functions over plain tensors: B sequences, T positions (position t holds the log-prob
of token t given those before it). Nothing here knows episodes or actors.

The ratio is taken against the BEHAVIOUR log-probs (what the generator sampled with): against a detached copy of
the current ones it is identically 1 and clipping silently off (TorchForge's GRPO loss does that). With an
importance-sampling correction (`is_weights`) it is taken against the trainer's own, detached (1, carrying only
the gradient), and each token weighted by a gate on trainer/behaviour: the behaviour policy may mix versions
(partial rollouts) and numerics. Advantages come per token [B, T] from core/estimators/.
"""

import math

import torch
import torch.nn.functional as F

from forge_rl.core.config import GRPOConfig
from forge_rl.core.estimators import loss_setting

# ---------------------------------------------------------------------------- per token


# KL(policy || reference) from tokens the policy sampled (Schulman 2020), log_r = ref - policy: k1 = -log_r
# (unbiased, can go negative), k2 = log_r^2 / 2 (biased, low variance), k3 = e^log_r - 1 - log_r (unbiased, >= 0;
# GRPO's). k3's exp overflows for a token the policy has all but ruled out: its log-ratio and estimate are clamped
# as verl's low_var_kl does (20 and 10; a clamped token's gradient is 0).
K3_LOG_RATIO_BOUND, K3_BOUND = 20.0, 10.0
KL_ESTIMATORS = {
    "k1": lambda log_r: -log_r,
    "k2": lambda log_r: 0.5 * log_r**2,
    "k3": lambda log_r: _k3(log_r.clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)).clamp(max=K3_BOUND),
}


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    return torch.expm1(log_r) - log_r


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate to the reference: [B, T], [B, T] -> [B, T]."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](ref_logprobs - logprobs)


# ---------------------------------------------------------------------------- aggregation
# How per-token losses [B, T] become one number. `denominator`: the WHOLE batch's (all micro-batches and ranks),
# so the pieces' gradients sum to the batch's; default: this piece's. Each estimator's paper fixes one.


def token_mean(per_token: torch.Tensor, mask: torch.Tensor, denominator: float | None = None) -> torch.Tensor:
    """Every trained token of the batch weighs the same (DAPO): long answers count more."""
    mask = mask.to(per_token.dtype)
    denominator = mask.sum().clamp(min=1) if denominator is None else denominator
    return (per_token * mask).sum() / denominator


def seq_mean(per_token: torch.Tensor, mask: torch.Tensor, denominator: float | None = None) -> torch.Tensor:
    """Mean over each sequence's tokens, then over sequences (GRPO, GSPO): an answer weighs the same whatever
    its length, so a long answer's tokens each weigh less (the 1/|o| Dr.GRPO removes)."""
    mask = mask.to(per_token.dtype)
    per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    denominator = (mask.sum(-1) > 0).sum().clamp(min=1) if denominator is None else denominator
    return per_seq.sum() / denominator


def token_sum(per_token: torch.Tensor, mask: torch.Tensor, denominator: float | None = None) -> torch.Tensor:
    """Every trained token's term summed, over a constant (the caller's: rows, or rows x max_tokens): a
    sequence's terms add up to its log-prob's, REINFORCE's own form (RLOO; Dr.GRPO with max_tokens)."""
    denominator = mask.shape[0] if denominator is None else denominator
    return (per_token * mask.to(per_token.dtype)).sum() / denominator


AGGREGATIONS = {"token_mean": token_mean, "seq_mean": seq_mean, "seq_sum": token_sum, "token_sum": token_sum}


def denominator(agg: str, mask: torch.Tensor, max_tokens: int | None) -> float:
    """The denominator of aggregation `agg` over a whole optimizer step's [B, T] mask: its trained tokens
    (token_mean), its sequences with any (seq_mean), its rows (seq_sum: RLOO's 1/G), or its rows times
    sampling.max_tokens (token_sum: Dr.GRPO's constant, the same whatever was sampled)."""
    if agg == "token_mean":
        return mask.sum().clamp(min=1).item()
    if agg == "seq_mean":
        return (mask.sum(-1) > 0).sum().clamp(min=1).item()
    if agg == "token_sum" and max_tokens is None:
        raise ValueError("loss_agg token_sum divides by sampling.max_tokens: GRPOLoss(config, max_tokens)")
    return float(mask.shape[0] * (max_tokens if agg == "token_sum" else 1))


# ---------------------------------------------------------------------------- IS correction
# Levels: r = pi_trainer / pi_behaviour of each token, of the sequence (product), or its geometric mean (comparable
# across lengths). Modes: mask keeps a token (weight 1) while r is within [low, high], else 0 (MIS/IcePop); clip
# weighs it by r clamped to [low, high]; trunc by min(r, high) (TIS). A sequence's ratio only masks.
IS_LEVELS = ("off", "token", "seq", "geo")
IS_MODES = ("mask", "clip", "trunc")


def is_weights(
    log_ratio: torch.Tensor,  # [B, T] trainer minus behaviour log-prob of each sampled token (detached)
    mask: torch.Tensor,  # [B, T] 1 where the policy sampled the token
    level: str,
    mode: str,
    low: float,
    high: float,
) -> torch.Tensor:
    """Per-token weights [B, T] of the importance-sampling correction; 0 off the mask."""
    if level not in IS_LEVELS[1:] or mode not in IS_MODES:
        raise ValueError(f"is_correction: level {level!r} mode {mode!r}; levels {IS_LEVELS[1:]}, modes {IS_MODES}")
    if level != "token" and mode != "mask":
        raise ValueError(f"is_correction: level {level!r} only masks (mode 'mask'), got mode {mode!r}")
    mask = mask.bool()
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    if level == "token":
        log_r = log_ratio  # [B, T]
    else:
        log_r = log_ratio.sum(-1, keepdim=True)  # [B, 1]
        if level == "geo":
            log_r = log_r / mask.sum(-1, keepdim=True).clamp(min=1)
        log_r = log_r.expand_as(log_ratio)
    # Compared in log space: a sequence's ratio overflows exp long before its log does.
    if mode == "mask":
        weights = ((log_r >= math.log(low) if low > 0 else True) & (log_r <= math.log(high))).to(log_ratio.dtype)
        weights = weights.expand_as(log_ratio)
    elif mode == "clip":
        weights = log_r.exp().clamp(low, high)
    else:
        weights = log_r.exp().clamp(max=high)
    return weights * mask


# ---------------------------------------------------------------------------- policy losses
# Each maps the ratio to the behaviour policy [B, T] and advantages [B, T] to per-token losses whose gradient
# at ratio 1 is -A * grad log pi (the on-policy policy gradient); they differ once the ratio leaves 1 (a later
# minibatch, or stale data).


def clipped_surrogate(ratio, advantages, low: float, high: float, dual_clip: float | None = None) -> torch.Tensor:
    """PPO's clipped surrogate -min(r A, clip(r, 1 - low, 1 + high) A) (Schulman et al. 2017; DAPO's
    asymmetric band). dual_clip c (Ye et al. 2020): a negative advantage's loss is at most -c A, so a token
    whose ratio ran far up on stale data cannot push with an unbounded weight (c = 3, as verl)."""
    per_token = -torch.minimum(ratio * advantages, ratio.clamp(1 - low, 1 + high) * advantages)
    if dual_clip is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -dual_clip * advantages), per_token)
    return per_token


def cispo(ratio, log_ratio, advantages, high: float) -> torch.Tensor:
    """CISPO (MiniMax-M1, 2025): REINFORCE on log pi weighted by the ratio, the weight clipped above at 1 + high
    and stopped from the gradient: every token keeps a gradient (PPO's clip drops the clipped ones), bounded."""
    weight = ratio.detach().clamp(max=1 + high)
    return -weight * advantages * log_ratio  # log_ratio's gradient is log pi's


def sapo(ratio, advantages, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO (Gao et al. 2025): a smooth gate (4 / tau) sigmoid(tau (r - 1)) in place of the hard clip, its
    gradient r sigmoid'(.) 4 fading as r leaves 1, more slowly for positive advantages (tau_pos < tau_neg).
    Shifted by its value at r = 1 so that the loss reads 0 on-policy (the gradient is the same)."""
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    return -(4 / tau) * (torch.sigmoid(tau * (ratio - 1)) - 0.5) * advantages


POLICY_LOSSES = ("clip", "cispo", "sapo")


# ---------------------------------------------------------------------------- the loss


def grpo_loss(
    logprobs: torch.Tensor,  # [B, T] current policy log-probs of the sampled tokens (with grad)
    behaviour_logprobs: torch.Tensor,  # [B, T] log-probs the generator sampled them with
    advantages: torch.Tensor,  # [B, T] per token (core/estimators/)
    mask: torch.Tensor,  # [B, T] 1 where the policy sampled the token, 0 elsewhere
    config: GRPOConfig,  # clip_low/high, kl_coef/estimator, loss_agg, entropy_coef
    ref_logprobs: torch.Tensor | None = None,  # [B, T] reference log-probs; needed if kl_coef
    entropy: torch.Tensor | None = None,  # [B, T] each position's entropy (with grad): the bonus / metric
    denominator: float | None = None,  # see AGGREGATIONS; None: normalise by this batch
    batch_entropy: float | None = None,  # with entropy_floor: the whole batch's mean entropy, when this is a piece
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss + KL + entropy bonus, aggregated over masked tokens -> (loss, metrics: means over masked tokens,
    ratio min/max, `num_tokens` to weigh pieces together). Tokens off `mask` get exactly zero gradient: masked
    positions never reach the ratio's exp."""
    mask = mask.bool()
    # Zero off-mask, so padding (behaviour 0, current arbitrary) cannot make inf * 0 = nan in the gradient.
    log_ratio = torch.where(mask, logprobs - behaviour_logprobs, torch.zeros_like(logprobs))
    weights = None  # [B, T] importance-sampling correction
    correction = config.is_correction
    if correction.level != "off":
        with torch.no_grad():
            weights = is_weights(log_ratio, mask, correction.level, correction.mode, *correction.threshold)
        is_ratio = torch.exp(log_ratio.detach())  # trainer / behaviour, for the metrics
        log_ratio = torch.where(mask, logprobs - logprobs.detach(), torch.zeros_like(logprobs))
    if loss_setting(config, "ratio_level") == "sequence":
        # GSPO (Zheng et al. 2025) in its token form: each token carries its sequence's ratio, the geometric
        # mean of its tokens' (length-normalised, so comparable across lengths), and the clip keeps or drops
        # whole sequences; a token's gradient is its own log-prob's times that ratio.
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        log_ratio = torch.where(mask, logprobs - logprobs.detach() + seq.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)  # [B, T]
    kind = loss_setting(config, "policy_loss")
    low, high = loss_setting(config, "clip_low"), loss_setting(config, "clip_high")
    if kind == "clip":
        per_token = clipped_surrogate(ratio, advantages, low, high, config.dual_clip)
    elif kind == "cispo":
        per_token = cispo(ratio, log_ratio, advantages, high)
    else:
        per_token = sapo(ratio, advantages, config.sapo_tau_pos, config.sapo_tau_neg)
    if weights is not None:
        per_token = weights * per_token

    kl = None
    if config.kl_coef > 0 and not config.kl_in_reward:
        if ref_logprobs is None:
            raise ValueError("loss.kl_coef > 0 needs reference log-probs (start a ReferenceModel)")
        ref = torch.where(mask, ref_logprobs, logprobs.detach())
        kl = kl_penalty(logprobs, ref, config.kl_estimator)  # [B, T]
        per_token = per_token + config.kl_coef * kl

    if config.entropy_coef > 0:
        if entropy is None:
            raise ValueError("loss.entropy_coef > 0 needs the entropy of each position")
        bonus = config.entropy_coef * entropy  # [B, T]
        if config.entropy_floor is not None:
            # An entropy floor: the bonus acts only while the batch's mean entropy per trained token is
            # below it, so exploration is kept without the steady pull toward uniform that a bonus always on
            # exerts (with Adam even a small one moves the weights at full step size on steps where every
            # group's rewards are equal, so rare successes are undone). As Skywork-OR1's adaptive entropy
            # control, whose coefficient acts only below its target entropy; this one is on or off, no state.
            # Decided for the whole batch: a micro-batch or a rank's share is given the batch's entropy.
            if batch_entropy is None:
                batch_entropy = float((entropy * mask).sum() / mask.sum().clamp(min=1))
            bonus = bonus * float(batch_entropy < config.entropy_floor)
        per_token = per_token - bonus

    loss = AGGREGATIONS[loss_setting(config, "loss_agg")](per_token, mask, denominator)

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        behaviour_log_ratio = torch.where(mask, logprobs - behaviour_logprobs, torch.zeros_like(logprobs))
        # With a correction the PPO ratio is 1: the ratio metrics then say how far the trainer is
        # from the behaviour policy instead.
        shown = is_ratio if weights is not None else ratio
        r = shown[mask]

        def masked_mean(x):
            return (x * mask).sum() / n

        metrics = {
            "num_tokens": mask.sum().float(),
            "ratio_mean": masked_mean(shown),
            "ratio_min": r.min() if r.numel() else torch.tensor(1.0),
            "ratio_max": r.max() if r.numel() else torch.tensor(1.0),
            "advantage_mean": masked_mean(advantages),
        }
        if weights is None and kind == "clip":
            # Clipping is active (gradient zero) when the ratio left the band in the direction the advantage
            # pushes it. With a correction the ratio is 1 and the clip never acts: no metric rather than 0.
            metrics["clip_fraction_low"] = masked_mean(((ratio < 1 - low) & (advantages < 0)).float())
            metrics["clip_fraction_high"] = masked_mean(((ratio > 1 + high) & (advantages > 0)).float())
            metrics["clip_fraction"] = metrics["clip_fraction_low"] + metrics["clip_fraction_high"]
        # KL(behaviour || trainer) from the tokens behaviour sampled (k3, see KL_ESTIMATORS).
        metrics["behaviour_kl"] = masked_mean(KL_ESTIMATORS["k3"](behaviour_log_ratio))
        if weights is not None:
            metrics["is_masked_fraction"] = masked_mean((weights == 0).float())
        if kl is not None:
            metrics["kl"] = masked_mean(kl)
        elif ref_logprobs is not None:
            metrics["kl"] = masked_mean(kl_penalty(logprobs, torch.where(mask, ref_logprobs, logprobs), config.kl_estimator))
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy)
    return loss, {k: v.detach().float() for k, v in metrics.items()}


COUNTS = ("num_tokens", "forward_tokens", "imitation_episodes", "skipped_steps")  # what was done in all


def reduction(name: str) -> str:
    """How a loss metric combines across micro-batches, ranks and a batch's optimizer steps: "sum" for the
    COUNTS, "min" for names like `ratio_min` or `ratio_min/age_0`, "max" likewise, else a mean."""
    head = name.split("/")[0]
    return "sum" if name in COUNTS else "min" if head.endswith("_min") else "max" if head.endswith("_max") else "mean"


# ---------------------------------------------------------------------------- the value loss


def value_loss(
    values: torch.Tensor,  # [B, T] the value head's predictions (with grad), read where `mask` is 1
    old_values: torch.Tensor,  # [B, T] its predictions before the step's update (the advantages' baseline)
    returns: torch.Tensor,  # [B, T] each turn's value target, the lambda-return A + V (estimators/ppo.py)
    mask: torch.Tensor,  # [B, T] 1 at the first sampled token of each turn: one value per turn
    clip: float | None = None,  # PPO's value clip: a prediction counts as if within +-clip of old_values
    denominator: float | None = None,  # the batch's number of turns, when this is a piece of it
) -> torch.Tensor:
    """0.5 (V - return)^2 summed over turns / denominator. Clipped as in PPO's implementation (and TRL's): the
    larger of the plain and the clipped prediction's squared error, so the head cannot move far in one step."""
    mask = mask.to(values.dtype)
    error = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        error = torch.maximum(error, (clipped - returns) ** 2)
    denominator = mask.sum().clamp(min=1) if denominator is None else denominator
    return 0.5 * (error * mask).sum() / denominator
