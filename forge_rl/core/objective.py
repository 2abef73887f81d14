"""The GRPO objective over episodes: the loss function the trainer takes (engines/titan/trainer.py knows no
algorithm; another objective is another class with the same methods).

    trainer = Trainer(model_path, GRPOLoss(cfg.grpo), ...)
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from forge_rl.core.config import GRPOConfig
from forge_rl.core.loss import group_advantages, grpo_loss, rollout_advantages
from forge_rl.core.types import Episode


def episode_advantages(batch: list[Episode], config: GRPOConfig) -> torch.Tensor:
    """[len(batch)] advantages, compared within each group (group_id); a chat-agent rollout sealed into
    several episodes (same rollout_id) counts once in its group, and each of its episodes gets its advantage."""
    advantages = torch.zeros(len(batch))
    for rows in _rows_by_group(batch):
        rewards = torch.tensor([float(batch[i].reward) for i in rows])
        rollouts = {}
        index = torch.tensor([rollouts.setdefault(_rollout(batch, i), len(rollouts)) for i in rows])
        advantages[rows] = rollout_advantages(rewards, index, config.normalize_std, config.normalize_mean)
    return advantages


def answer_turns(episode: Episode) -> list[tuple[int, int]]:
    """(start, end) of each run of sampled tokens: one answer of the conversation per run."""
    mask = torch.as_tensor(episode.loss_mask).bool().tolist() + [False]
    turns, start = [], None
    for t, sampled in enumerate(mask):
        if sampled and start is None:
            start = t
        elif not sampled and start is not None:
            turns.append((start, t))
            start = None
    return turns


def turn_advantages(batch: list[Episode], config: GRPOConfig) -> list[torch.Tensor]:
    """Per token [T] for each episode: its episode advantage plus `turn_credit` times a per-turn one (GiGPO's
    step-level group, Feng et al. 2025). The games of a group that reached the same conversation (the same
    ids before an answer) faced the same state, and from there their rewards compare that answer with the
    others given there; with a shared seed (BlackJack's shoe) they reached it through the same cards too.
    Without it every answer of a game gets the game's credit, so a good hit followed by a bad one looks bad.
    The reward compared is the episode's, the return from every turn when, as in these apps, it comes at
    the end. A state one game alone reached has nothing to compare with: only its episode advantage."""
    base = episode_advantages(batch, config)
    per_token = [torch.full((len(e.tokens),), float(base[i])) for i, e in enumerate(batch)]
    for rows in _rows_by_group(batch):
        # each answer's span and the conversation before it (its state)
        turns = {i: [(start, end, _context(batch[i], start)) for start, end in answer_turns(batch[i])] for i in rows}
        visits = defaultdict(dict)  # state -> {rollout: reward}
        for i in rows:
            for _, _, state in turns[i]:
                visits[state][_rollout(batch, i)] = float(batch[i].reward)
        for i in rows:
            for start, end, state in turns[i]:
                seen = visits[state]
                step = group_advantages(torch.tensor(list(seen.values())), config.normalize_std)
                per_token[i][start:end] += config.turn_credit * step[list(seen).index(_rollout(batch, i))]
    return per_token


def centre_per_answer(batch: list[Episode], per_token: list[torch.Tensor]) -> list[torch.Tensor]:
    """Subtract from each trained token's advantage the batch's mean advantage of the same token id. In logit
    terms a state then moves by how much better an answer is THERE than it is on average over the batch, so
    the answer better on average (BlackJack's stand, while the rest of the hand is played at random) cannot
    drive every state at once to it before the state-dependent part is learnt. Biased on purpose (an action-
    dependent baseline without its correction): an answer best everywhere is never learnt to be."""
    trained = [[(p, int(e.tokens[p])) for p in torch.nonzero(torch.as_tensor(e.loss_mask)).flatten().tolist()] for e in batch]
    sums, counts = defaultdict(float), defaultdict(int)
    for positions, a in zip(trained, per_token):
        for p, token in positions:
            sums[token] += float(a[p])
            counts[token] += 1
    out = []
    for positions, a in zip(trained, per_token):
        a = a.clone()
        for p, token in positions:
            a[p] -= sums[token] / counts[token]
        out.append(a)
    return out


def _rows_by_group(batch: list[Episode]) -> list[list[int]]:
    by_group = defaultdict(list)
    for i, e in enumerate(batch):
        by_group[e.group_id].append(i)
    return list(by_group.values())


def _rollout(batch: list[Episode], i: int) -> str | int:
    """Episode i's rollout: its rollout_id, or (rollout_id "") a rollout of its own."""
    return batch[i].rollout_id or -i - 1


def _context(episode: Episode, start: int) -> bytes:
    return torch.as_tensor(episode.tokens[:start]).numpy().tobytes()


class GRPOLoss:
    """PPO's clipped surrogate against the behaviour log-probs, KL, entropy bonus and importance-sampling
    correction (core/loss.py `grpo_loss`), plus the trainer/behaviour ratio's extremes by the age of each
    token's version (`ratio_min/age_0`, ...). Picklable: it travels to the trainer's processes."""

    def __init__(self, config: GRPOConfig):
        self.config = config
        self.imitation_coef = config.self_imitation.coef  # self-imitation's NLL beside the GRPO loss
        self.batch_entropy: float | None = None  # this step's, set by prepare (entropy floor only)

    def advantages(self, batch: list[Episode]) -> torch.Tensor | list[torch.Tensor]:
        """[B], or per token [T] for each episode with `turn_credit` or `centre_per_answer`."""
        if self.config.turn_credit:
            advantages = turn_advantages(batch, self.config)
        else:
            advantages = episode_advantages(batch, self.config)
        if self.config.centre_per_answer:
            if not isinstance(advantages, list):
                advantages = [torch.full((len(e.tokens),), float(a)) for e, a in zip(batch, advantages)]
            return centre_per_answer(batch, advantages)
        return advantages

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
