"""The GRPO objective over episodes, in two halves: what is fixed once per batch, on the controller, and the
loss the trainer takes (engines/titan/trainer.py knows no algorithm; another objective is another class with
the same methods).

    data, figures = objective.batch_data(batch, masks, values, mean_entropy)   # controller, once a batch
    totals = loss_fn.prepare(t)                                   # trainer, each optimizer step
    loss, metrics = loss_fn(logprobs, piece, entropy, totals)     # trainer, each micro-batch

Advantages, PPO's old values and value targets, and the entropy floor's decision are data, computed before
the batch is split into minibatches and epochs (PPO, Schulman et al. 2017, Alg. 1; verl's
`compute_advantage`): an optimizer step never re-estimates them from weights it has already moved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from forge_rl.core.config import GRPOConfig
from forge_rl.core.estimators import ESTIMATORS, estimate, loss_setting
from forge_rl.core.estimators.ppo import turn_starts
from forge_rl.core.loss import denominator as loss_denominator
from forge_rl.core.loss import grpo_loss, kl_penalty, value_loss
from forge_rl.core.types import Episode


@dataclass(frozen=True)
class StepTotals:
    """What every micro-batch of one optimizer step shares, decided by `GRPOLoss.prepare` on its whole minibatch."""

    denominator: float  # the loss's denominator, so that micro-batches and ranks add up to the step's gradient
    batch_entropy: float | None  # with an entropy floor: the batch's mean entropy per trained token
    turns: float = 1.0  # ppo: the value loss's denominator, the step's number of turns


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """[T_i] rows -> one right-padded [B, T] fp32 tensor: one tensor a key crosses to the trainer, not B."""
    return torch.nn.utils.rnn.pad_sequence([torch.as_tensor(r, dtype=torch.float32) for r in rows], batch_first=True)


class GRPOLoss:
    """PPO's clipped surrogate against the behaviour log-probs, KL, entropy bonus and importance-sampling
    correction (core/loss.py `grpo_loss`) on the advantages of `grpo.estimator` (core/estimators/), plus the
    trainer/behaviour ratio's extremes by the age of each token's version (`ratio_min/age_0`, ...). With
    estimator ppo, `value_head` asks the trainer for one and value_coef x the value loss joins the loss.
    Picklable: it travels to the trainer's processes."""

    def __init__(self, config: GRPOConfig, max_tokens: int | None = None):
        self.config, self.max_tokens = config, max_tokens  # sampling.max_tokens, for grpo.overlong_buffer
        self.imitation_coef = config.self_imitation.coef  # self-imitation's NLL beside the GRPO loss
        self.value_head = ESTIMATORS[config.estimator].values  # the trainer builds one; its values are read once a batch
        self.entropy_floor = config.entropy_coef > 0 and config.entropy_floor is not None  # needs the batch's entropy

    # ------------------------------------------------------------------------ once a batch (the controller)

    def masks(self, batch: list[Episode], trained_version: int) -> list[torch.Tensor]:
        """Each episode's trained positions [T]: its loss_mask (never position 0, which nothing predicts)
        without tokens sampled more than max_token_age versions before `trained_version`, the weights the
        batch trains, nor, with overlong_filter, a cut-off episode's (DAPO: no evidence about its ending)."""
        out = []
        for e in batch:
            mask = torch.as_tensor(e.loss_mask, dtype=torch.float32).clone()
            mask[0] = 0.0
            if self.config.max_token_age is not None:
                mask *= (trained_version - e.token_versions <= self.config.max_token_age).float()
            if self.config.overlong_filter and e.truncated:
                mask *= 0.0
            out.append(mask)
        return out

    def batch_data(
        self, batch: list[Episode], masks: list[torch.Tensor], values: list[torch.Tensor] | None = None,
        mean_entropy: float | None = None, ref_logprobs: list[torch.Tensor] | None = None,
    ) -> tuple[dict, dict[str, float]]:
        """What every optimizer step of `batch` trains with, fixed before the first: [B, T] "mask" and
        "advantages"; with a value head (`values`: each episode's [T]
        under the weights before the batch's updates, trainer `score_batch`) the old "values", the value
        targets "returns" and "value_mask"; with an entropy floor the batch's `mean_entropy` under those
        weights; with kl_in_reward `ref_logprobs`, each episode's [T] under the reference, for the behaviour
        policy's KL to it in the return. Returns (data, the figures of the batch's start: the value head's fit)."""
        kl = None
        if self.config.kl_in_reward:
            if ref_logprobs is None:
                raise ValueError("grpo.kl_in_reward: the batch's data needs the reference log-probs")
            kl = [kl_penalty(torch.as_tensor(e.behaviour_logprobs).float(), torch.as_tensor(r).float(), self.config.kl_estimator)
                  for e, r in zip(batch, ref_logprobs)]  # fmt: skip
        per_token = estimate(batch, self.config, masks, self.max_tokens, values, kl)
        data = {"mask": padded(masks), "advantages": padded(per_token), "batch_entropy": mean_entropy}
        figures = {}
        if self.value_head:
            value_mask = [turn_starts(e.loss_mask) * (m > 0) for e, m in zip(batch, masks)]
            data["values"] = padded([torch.as_tensor(v, dtype=torch.float32) for v in values])
            data["value_mask"] = padded(value_mask)
            data["returns"] = (data["advantages"] + data["values"]) * data["value_mask"]  # the lambda-return A + V
            figures = value_fit(data["values"], data["returns"], data["value_mask"])
        return data, figures

    # ------------------------------------------------------------------------ each optimizer step (the trainer)

    def prepare(self, t: dict[str, torch.Tensor], batch_entropy: float | None = None) -> StepTotals:
        """Before an optimizer step's micro-batches, on its whole minibatch (t: the trainer's right-padded
        [B, T] tensors, with the batch's data among them): the denominators its pieces share."""
        if self.config.kl_coef > 0 and not self.config.kl_in_reward and "ref" not in t:
            raise ValueError("train_step: grpo.kl_coef > 0 needs ref_logprobs (ReferenceModel.logprobs of the batch)")
        for key in ("mask", "advantages") + (("values", "returns", "value_mask") if self.value_head else ()):
            if key not in t:
                raise ValueError(f"train_step: no {key!r} in the batch's data (GRPOLoss.batch_data makes it)")
        denominator = loss_denominator(loss_setting(self.config, "loss_agg"), t["mask"], self.max_tokens)
        turns = max(float(t["value_mask"].sum()), 1.0) if self.value_head else 1.0
        return StepTotals(denominator, batch_entropy if self.entropy_floor else None, turns)

    def __call__(self, logprobs: torch.Tensor, batch: dict, entropy: torch.Tensor | None, totals: StepTotals):
        loss, metrics = grpo_loss(
            logprobs, batch["behaviour"], batch["advantages"], batch["mask"], self.config,
            ref_logprobs=batch.get("ref"), entropy=entropy, denominator=totals.denominator,
            batch_entropy=totals.batch_entropy,
        )
        if self.value_head:
            clip = loss_setting(self.config, "clip_low") if self.config.value_clip else None
            fit = value_loss(batch["predicted_values"], batch["values"], batch["returns"], batch["value_mask"], clip, totals.turns)
            loss = loss + self.config.value_coef * fit
        with torch.no_grad():
            ratio, mask = torch.exp(logprobs - batch["behaviour"]), batch["mask"].bool()
            for age in range(self.config.max_policy_age + 1):  # the same keys on every rank
                r = ratio[(batch["ages"] == age) & mask]
                metrics[f"ratio_min/age_{age}"] = r.min() if r.numel() else torch.tensor(math.inf)
                metrics[f"ratio_max/age_{age}"] = r.max() if r.numel() else torch.tensor(-math.inf)
        return loss, metrics


def value_fit(values: torch.Tensor, returns: torch.Tensor, value_mask: torch.Tensor) -> dict[str, float]:
    """The value head's fit to the batch's targets before its updates ([B, T] each, read where value_mask is 1)."""
    at = value_mask.bool()
    r, v = returns[at], values[at]
    spread = r.var(correction=0) if at.sum() > 1 else torch.tensor(0.0)
    return {
        "value_loss": float(value_loss(values, values, returns, value_mask)),
        "value_mean": float(v.mean()) if at.any() else 0.0,
        # 1 - Var(return - V) / Var(return): 0 for a constant head, 1 for a perfect one
        "value_explained_variance": float(1 - (r - v).var(correction=0) / spread) if spread > 0 else 0.0,
    }
