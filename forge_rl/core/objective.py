"""The GRPO objective over episodes: the loss function the trainer takes (engines/titan/trainer.py knows no
algorithm; another objective is another class with the same methods).

    trainer = Trainer(model_path, GRPOLoss(cfg.grpo), ...)
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from forge_rl.core.config import GRPOConfig
from forge_rl.core.loss import grpo_loss, rollout_advantages
from forge_rl.core.types import Episode


def episode_advantages(batch: list[Episode], config: GRPOConfig) -> torch.Tensor:
    """[len(batch)] advantages, compared within each group (group_id); a chat-agent rollout sealed into
    several episodes (same rollout_id) counts once in its group, and each of its episodes gets its advantage."""
    advantages = torch.zeros(len(batch))
    by_group = defaultdict(list)
    for i, e in enumerate(batch):
        by_group[e.group_id].append(i)
    for rows in by_group.values():
        rewards = torch.tensor([float(batch[i].reward) for i in rows])
        rollouts = {}  # "" is an episode of its own
        index = torch.tensor([rollouts.setdefault(batch[i].rollout_id or -i - 1, len(rollouts)) for i in rows])
        advantages[rows] = rollout_advantages(rewards, index, config.normalize_std, config.normalize_mean)
    return advantages


class GRPOLoss:
    """PPO's clipped surrogate against the behaviour log-probs, KL, entropy bonus and importance-sampling
    correction (core/loss.py `grpo_loss`), plus the trainer/behaviour ratio's extremes by the age of each
    token's version (`ratio_min/age_0`, ...). Picklable: it travels to the trainer's processes."""

    def __init__(self, config: GRPOConfig):
        self.config = config
        self.imitation_coef = config.self_imitation.coef  # self-imitation's NLL beside the GRPO loss
        self.batch_entropy: float | None = None  # this step's, set by prepare (entropy floor only)

    def advantages(self, batch: list[Episode]) -> torch.Tensor:
        return episode_advantages(batch, self.config)

    def prepare(self, t: dict[str, torch.Tensor], mean_entropy=None) -> float:
        """Before the micro-batches, on the whole batch: drop tokens sampled too many versions ago from the
        mask; with an entropy floor, decide the bonus once for the step from `mean_entropy()` (the batch's
        mean entropy per trained token, the same on every rank: the trainer's extra forward without grad,
        so the floor costs that; a piece's own entropy would turn the bonus on for some pieces of a step and
        off for others); return the loss's denominator (so that micro-batches and ranks add up to the
        batch's gradient)."""
        if self.config.kl_coef > 0 and "ref" not in t:
            raise ValueError("train_step: grpo.kl_coef > 0 needs ref_logprobs (ReferenceModel.logprobs of the batch)")
        if self.config.max_token_age is not None:
            t["mask"] *= (t["ages"] <= self.config.max_token_age).float()
        floor = self.config.entropy_coef > 0 and self.config.entropy_floor is not None
        self.batch_entropy = mean_entropy() if floor and mean_entropy is not None else None
        if self.config.loss_agg == "token_mean":
            return t["mask"].sum().clamp(min=1).item()
        return (t["mask"].sum(-1) > 0).sum().clamp(min=1).item()

    def __call__(self, logprobs: torch.Tensor, batch: dict, entropy: torch.Tensor | None, denominator: float):
        loss, metrics = grpo_loss(
            logprobs, batch["behaviour"], batch["advantages"], batch["mask"], self.config,
            ref_logprobs=batch.get("ref"), entropy=entropy, denominator=denominator, batch_entropy=self.batch_entropy,
        )
        with torch.no_grad():
            ratio, mask = torch.exp(logprobs - batch["behaviour"]), batch["mask"].bool()
            for age in range(self.config.max_policy_age + 1):  # the same keys on every rank
                r = ratio[(batch["ages"] == age) & mask]
                metrics[f"ratio_min/age_{age}"] = r.min() if r.numel() else torch.tensor(math.inf)
                metrics[f"ratio_max/age_{age}"] = r.max() if r.numel() else torch.tensor(-math.inf)
        return loss, metrics
