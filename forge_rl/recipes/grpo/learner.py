"""Learner: the training side of one step, on the controller.

    batch --> reference log-probs (kl_coef > 0) --> advantages, fixed for the batch (core/objective.py)
          --> Trainer.train_step (per minibatch, per epoch) --> push_weights(v) --> every generator
          --> version v-1 dropped from TorchStore

The version it publishes is the recipe's (state.py).
"""

from __future__ import annotations

import functools
import time

import torch

from forge_rl.core.config import RunConfig
from forge_rl.core.loss import reduction
from forge_rl.core.objective import GRPOLoss
from forge_rl.core.types import Episode
from forge_rl.recipes.grpo.self_imitation import ImitationPool
from forge_rl.runtime.actor import call
from forge_rl.weights import control


def token_age_figures(batch: list[Episode], trained_version: int) -> dict[str, float]:
    """How many versions behind the trained weights each trained token was sampled, beside `train/policy_age`."""
    ages = torch.cat([trained_version - e.token_versions[e.loss_mask.bool()] for e in batch]).float()
    if not len(ages):
        return {}
    return {
        "train/token_age_mean": ages.mean().item(),
        "train/token_age_p90": ages.quantile(0.9).item(),
        "train/token_age_ge2": (ages >= 2).float().mean().item(),
    }


def minibatches(batch: list[Episode], n: int) -> list[list[int]]:
    """n parts of whole groups (a group's advantages compare its own games), sizes differing by at most one."""
    groups = list(dict.fromkeys(e.group_id for e in batch))
    parts = [set(groups[len(groups) * i // n : len(groups) * (i + 1) // n]) for i in range(n)]
    return [[i for i, e in enumerate(batch) if e.group_id in part] for part in parts if part]


def optimizer_steps(batch: list[Episode], data: dict, minibatches_per_epoch: int, epochs: int):
    """`epochs` passes over the same minibatches, each step's data rows of the batch's one `data`."""
    parts = minibatches(batch, minibatches_per_epoch)
    for _ in range(epochs):
        for part in parts:
            yield part, {k: v[part] if isinstance(v, torch.Tensor) else v for k, v in data.items()}


def merged(steps: list[dict[str, float]]) -> dict[str, float]:
    """Combined as the trainer combines its micro-batches (core/loss.py `reduction`), weighted by num_tokens."""
    out = {}
    for k in dict.fromkeys(k for s in steps for k in s):  # every figure any step gave, in order
        having, kind = [s for s in steps if k in s], reduction(k)
        if kind == "mean":
            weights = [s.get("num_tokens", 1.0) for s in having]
            out[k] = sum(s[k] * w for s, w in zip(having, weights)) / sum(weights)
        else:
            out[k] = {"sum": sum, "min": min, "max": max}[kind](s[k] for s in having)
    return out


async def batch_data(objective: GRPOLoss, batch: list[Episode], trained_version: int, score, ref_logprobs=None) -> tuple[dict, dict[str, float]]:
    """The objective's data, fixed before any optimizer step from the weights as they are then; and its figures."""
    masks, seen = objective.masks(batch, trained_version), {}
    if objective.value_head or objective.entropy_floor:
        seen = await score(batch, masks, objective.value_head, objective.entropy_floor)
    return objective.batch_data(batch, masks, seen.get("values"), seen.get("mean_entropy"), ref_logprobs)


async def train_batch(objective: GRPOLoss, batch: list[Episode], trained_version: int, minibatches_per_epoch: int,
                      epochs: int, score, train_step, ref_logprobs=None) -> tuple[list[dict], dict[str, float]]:
    """A batch's optimizer steps as PPO's Algorithm 1 takes them; tests/test_exact_gradient.py runs this very
    loop on a tabular policy."""
    data, at_start = await batch_data(objective, batch, trained_version, score, ref_logprobs)
    return [await train_step(*step) for step in optimizer_steps(batch, data, minibatches_per_epoch, epochs)], at_start


class Learner:
    def __init__(self, cfg: RunConfig, trainer, policy, reference=None):
        self.cfg, self.trainer, self.policy, self.reference = cfg, trainer, policy, reference
        self.objective = GRPOLoss(cfg.grpo, cfg.sampling.max_tokens)  # its batch half; the trainer holds a copy
        imitation = cfg.grpo.self_imitation
        self.imitation = ImitationPool(imitation.capacity, cfg.seed) if imitation.episodes else None

    async def step(self, batch: list[Episode], version: int) -> dict[str, float]:
        """Train on `batch`, then make every generator serve the new weights as `version`."""
        clock = time.perf_counter()
        ref_logprobs, imitate = None, None
        if self.reference is not None:
            ref_logprobs = await self.reference.route("logprobs", [e.tokens for e in batch])
        elif self.cfg.grpo.kl_coef > 0:  # LoRA: the reference is the trainer's base model, adapters off
            ref_logprobs = "base"
        if self.imitation is not None:
            self.imitation.add_batch(batch)
            imitate = self.imitation.sample(self.cfg.grpo.self_imitation.episodes)
        grpo, timeout_s = self.cfg.grpo, self.cfg.trainer.timeout_s
        score = functools.partial(call, self.trainer, "score_batch", timeout_s=timeout_s)
        reference = None  # kl_in_reward: the reference's log-probs go into the batch's advantages
        if grpo.kl_in_reward:
            reference = ref_logprobs if ref_logprobs != "base" else await call(
                self.trainer, "logprobs", [e.tokens for e in batch], True, timeout_s=timeout_s)
        imitating = [imitate]  # self-imitation joins the batch's first optimizer step only

        async def train_step(part: list[int], part_data: dict) -> dict:
            ref = [ref_logprobs[i] for i in part] if isinstance(ref_logprobs, list) else ref_logprobs
            episodes, also = [batch[i] for i in part], imitating.pop() if imitating else None
            return await call(self.trainer, "train_step", episodes, part_data, ref, also, timeout_s=timeout_s)

        steps, at_start = await train_batch(self.objective, batch, version - 1, grpo.minibatches, grpo.epochs, score, train_step, reference)
        trained = merged(steps)
        after_train = time.perf_counter()
        push_times = await self.publish(version)
        if version - 1 >= 1:  # version 0 is the model directory itself; older versions are no longer served
            await control.delete_version(version - 1)
        figures = {f"train/{k}": v for k, v in {**trained, **at_start}.items() if k not in ("step", "num_tokens")}
        figures.update({
            "train/batch_reward": sum(e.reward for e in batch) / len(batch),
            "train/batch_episodes": len(batch),
            "train/truncated": sum(e.truncated for e in batch) / len(batch),  # an answer cut at max_tokens
            "train/episode_tokens": sum(len(e.tokens) for e in batch),
            "train/sampled_tokens": sum(int(e.loss_mask.sum()) for e in batch),  # what the generator sampled
            "train/policy_age": version - 1 - min(e.policy_version for e in batch),
            "train/mixed_version_episodes": sum(len(set(e.token_versions[e.loss_mask.bool()].tolist())) > 1 for e in batch) / len(batch),
            **token_age_figures(batch, version - 1),
            "train/policy_version": version,
            "train/optimizer_steps": len(steps),  # grpo.epochs x grpo.minibatches
            "time/train_step_s": after_train - clock,
        })
        figures.update(push_times)
        if self.imitation is not None:
            figures["train/imitation_pool"] = len(self.imitation)
        return figures

    async def publish(self, version: int) -> dict[str, float]:
        """Loaded by every healthy generator; a restarting one catches up itself (generator.py `catch_up`)."""
        clock = time.perf_counter()
        receivers = self.policy.healthy()  # a broadcast goes to these alone: the ones then told to load it
        nbytes = await call(self.trainer, "push_weights", version, receivers, timeout_s=self.cfg.trainer.timeout_s)
        pushed = time.perf_counter()
        loaded = await self.policy.fanout("update_weights", version, to=receivers)
        return {"time/push_weights_s": pushed - clock, "time/update_weights_s": time.perf_counter() - pushed,
                "weight_sync/bytes": nbytes, "weight_sync/replicas": len(loaded)}
