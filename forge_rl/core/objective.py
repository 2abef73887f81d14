"""The GRPO objective over episodes: the loss function the trainer takes (engines/titan/trainer.py knows no
algorithm; another objective is another class with the same methods).

    trainer = Trainer(model_path, GRPOLoss(cfg.grpo), ...)
    totals = loss_fn.prepare(batch, t, mean_entropy)     # once a step, on the whole batch
    loss, metrics = loss_fn(logprobs, piece, entropy, totals)   # each micro-batch
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from forge_rl.core.config import GRPOConfig
from forge_rl.core.estimators import estimate
from forge_rl.core.estimators.ppo import turn_starts
from forge_rl.core.loss import grpo_loss, value_loss
from forge_rl.core.types import Episode


@dataclass(frozen=True)
class StepTotals:
    """What every micro-batch of one step shares, decided once on the whole batch by `GRPOLoss.prepare`."""

    denominator: float  # the loss's denominator, so that micro-batches and ranks add up to the batch's gradient
    batch_entropy: float | None  # with an entropy floor: the batch's mean entropy per trained token
    turns: float = 1.0  # ppo: the value loss's denominator, the batch's number of turns
    batch_metrics: dict = field(default_factory=dict)  # ppo: the value head's fit before the update, every piece says it


class GRPOLoss:
    """PPO's clipped surrogate against the behaviour log-probs, KL, entropy bonus and importance-sampling
    correction (core/loss.py `grpo_loss`) on the advantages of `grpo.estimator` (core/estimators/), plus the
    trainer/behaviour ratio's extremes by the age of each token's version (`ratio_min/age_0`, ...). With
    estimator ppo, `value_head` asks the trainer for one and value_coef x the value loss joins the loss.
    Picklable: it travels to the trainer's processes."""

    def __init__(self, config: GRPOConfig, max_tokens: int | None = None):
        self.config, self.max_tokens = config, max_tokens  # sampling.max_tokens, for grpo.overlong_buffer
        self.imitation_coef = config.self_imitation.coef  # self-imitation's NLL beside the GRPO loss
        self.value_head = config.estimator == "ppo"  # the trainer gives t["values"] and piece["predicted_values"]

    def prepare(self, batch: list[Episode], t: dict[str, torch.Tensor], mean_entropy=None) -> StepTotals:
        """Before the micro-batches, on the whole batch (t: the trainer's right-padded [B, T] tensors): drop
        tokens sampled too many versions ago (and, with overlong_filter, cut-off episodes) from t["mask"], then
        put each token's advantage in t["advantages"] (after the narrowing, so centring sees only the tokens
        trained). With an entropy
        floor, the bonus is decided once for the step from `mean_entropy()` (the batch's mean entropy per
        trained token, the same on every rank; a piece's own would turn the bonus on for some pieces of a
        step and off for others)."""
        if self.config.kl_coef > 0 and "ref" not in t:
            raise ValueError("train_step: grpo.kl_coef > 0 needs ref_logprobs (ReferenceModel.logprobs of the batch)")
        if self.config.max_token_age is not None:
            t["mask"] *= (t["ages"] <= self.config.max_token_age).float()
        if self.config.overlong_filter:  # DAPO: an answer cut off is no evidence about its ending
            t["mask"] *= torch.tensor([0.0 if e.truncated else 1.0 for e in batch])[:, None]
        masks = [t["mask"][i, : len(e.tokens)] for i, e in enumerate(batch)]
        if self.value_head and "values" not in t:
            raise ValueError("grpo.estimator ppo: the trainer gave no values (it builds a value head for a loss_fn whose value_head is true)")
        values = [t["values"][i, : len(e.tokens)] for i, e in enumerate(batch)] if self.value_head else None
        t["advantages"] = torch.zeros_like(t["mask"])
        for i, a in enumerate(estimate(batch, self.config, masks, self.max_tokens, values)):
            t["advantages"][i, : len(a)] = a
        turns, batch_metrics = self._value_targets(batch, t) if self.value_head else (1.0, {})
        floor = self.config.entropy_coef > 0 and self.config.entropy_floor is not None
        batch_entropy = mean_entropy() if floor and mean_entropy is not None else None
        if self.config.loss_agg == "token_mean":
            denominator = t["mask"].sum().clamp(min=1).item()
        else:
            denominator = (t["mask"].sum(-1) > 0).sum().clamp(min=1).item()
        return StepTotals(denominator, batch_entropy, turns, batch_metrics)

    def _value_targets(self, batch: list[Episode], t: dict[str, torch.Tensor]) -> tuple[float, dict]:
        """ppo: t["value_mask"] (1 at each trained turn's first token, where its value is read) and t["returns"]
        (the lambda-return A + V there); returns the number of turns and the head's fit before the update."""
        t["value_mask"] = torch.zeros_like(t["mask"])
        for i, e in enumerate(batch):
            t["value_mask"][i, : len(e.tokens)] = turn_starts(e.loss_mask) * (t["mask"][i, : len(e.tokens)] > 0)
        t["returns"] = (t["advantages"] + t["values"]) * t["value_mask"]
        at = t["value_mask"].bool()
        returns, values = t["returns"][at], t["values"][at]
        spread = returns.var(correction=0) if at.sum() > 1 else torch.tensor(0.0)
        fit = {
            "value_loss": value_loss(t["values"], t["values"], t["returns"], t["value_mask"]),
            "value_mean": values.mean() if at.any() else torch.tensor(0.0),
            # 1 - Var(return - V) / Var(return): 0 for a constant head, 1 for a perfect one
            "value_explained_variance": 1 - (returns - values).var(correction=0) / spread if spread > 0 else torch.tensor(0.0),
        }
        return max(float(at.sum()), 1.0), {k: v.detach().float() for k, v in fit.items()}

    def __call__(self, logprobs: torch.Tensor, batch: dict, entropy: torch.Tensor | None, totals: StepTotals):
        loss, metrics = grpo_loss(
            logprobs, batch["behaviour"], batch["advantages"], batch["mask"], self.config,
            ref_logprobs=batch.get("ref"), entropy=entropy, denominator=totals.denominator,
            batch_entropy=totals.batch_entropy,
        )
        if self.value_head:
            clip = self.config.clip_low if self.config.value_clip else None
            fit = value_loss(batch["predicted_values"], batch["values"], batch["returns"], batch["value_mask"], clip, totals.turns)
            loss = loss + self.config.value_coef * fit
            metrics.update(totals.batch_metrics)
        with torch.no_grad():
            ratio, mask = torch.exp(logprobs - batch["behaviour"]), batch["mask"].bool()
            for age in range(self.config.max_policy_age + 1):  # the same keys on every rank
                r = ratio[(batch["ages"] == age) & mask]
                metrics[f"ratio_min/age_{age}"] = r.min() if r.numel() else torch.tensor(math.inf)
                metrics[f"ratio_max/age_{age}"] = r.max() if r.numel() else torch.tensor(-math.inf)
        return loss, metrics
