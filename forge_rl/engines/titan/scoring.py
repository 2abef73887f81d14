"""Scoring a batch with no more forward work than its loss needs, for exactly the same loss.

A token's log-prob depends only on the ids before it, so:
- One forward row serves every episode whose trained tokens all follow ids that row shares: a group's games
  agree until their first different answer.
- Only positions that predict a trained token need the output head (model.py `scoring_head`).
Gradients stay exact: a shared row's log-probs feed every episode it serves, and autograd sums their terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forge_rl.engines.titan.model import pad_right


@dataclass
class ForwardPlan:
    rows: list[int]  # the episodes whose ids are run through the model, longest first
    row_of: dict[int, int]  # episode -> the episode in `rows` that serves it
    needed: dict[int, int]  # episode -> how many of its ids the loss needs (its last trained position)

    def served_by(self, rows: list[int], episodes: list[int]) -> list[int]:
        """The `episodes` that the `rows` serve."""
        rows = set(rows)
        return [b for b in episodes if self.row_of[b] in rows]


def plan_forward(tokens: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor, episodes: list[int]) -> ForwardPlan:
    """Rows to run for `episodes` (indexes into the padded [B, T] `tokens` and `mask`): an episode is served by
    a row whose first `needed` ids are its own. A trie of the rows' ids finds one; episodes are taken longest
    first, so a shorter one is served by a longer one that shares its prefix."""
    needed = {}
    for b in episodes:
        trained = mask[b, : int(lengths[b])].nonzero()
        needed[b] = int(trained[-1]) if len(trained) else 0  # ids before the last trained token
    root: dict = {}  # id -> child node; a node's None key holds the first row through it
    rows, row_of = [], {}
    for b in sorted(episodes, key=lambda b: (-int(lengths[b]), b)):
        ids = tokens[b, : needed[b]].tolist()
        node = root
        for token in ids:
            node = node.get(token)
            if node is None:
                break
        if node is not None and None in node:
            row_of[b] = node[None]
            continue
        row_of[b], node = b, root
        rows.append(b)
        node.setdefault(None, b)
        for token in tokens[b, : int(lengths[b])].tolist():
            node = node.setdefault(token, {})
            node.setdefault(None, b)
    return ForwardPlan(rows, row_of, needed)


def scored_positions(plan: ForwardPlan, mask: torch.Tensor, episodes: list[int], row_indices: list[int], width: int):
    """The trained tokens of `episodes`, served by the rows `row_indices` (indexes into plan.rows) run as one
    [len(row_indices), width] input: (episode slot, position) of each token, positions counted from 1 as the
    batch's [B, T] tensors count them; the flat indexes into the [len(row_indices) * width] outputs that predict
    them, each once; and for each token, which of those flat indexes predicts it."""
    local = {r: i for i, r in enumerate(row_indices)}
    slots, positions, flat = [], [], []
    for slot, b in enumerate(episodes):
        row = local[plan.row_of[b]]
        for p in mask[b].nonzero().flatten().tolist():
            slots.append(slot)
            positions.append(p)
            flat.append(row * width + p - 1)
    unique, which = torch.unique(torch.tensor(flat, dtype=torch.long), return_inverse=True)
    return torch.tensor(slots, dtype=torch.long), torch.tensor(positions, dtype=torch.long), unique, which


def batch_tensors(batch, ref_logprobs, policy_version: int) -> dict[str, torch.Tensor]:
    """Episodes -> right-padded [B, T] CPU tensors, lengths [B], and each token's age: how many versions
    before `policy_version` (the last pushed) it was sampled."""
    if not batch:
        raise ValueError("train_step: empty batch")
    length = max(len(e.tokens) for e in batch)

    def pad(rows, dtype):
        return pad_right([torch.as_tensor(r, dtype=dtype) for r in rows], length)

    t = {
        "tokens": pad([e.tokens for e in batch], torch.long),
        "lengths": torch.tensor([len(e.tokens) for e in batch]),
        "mask": pad([e.loss_mask for e in batch], torch.float32),
        "behaviour": pad([e.behaviour_logprobs for e in batch], torch.float32),
        "ages": policy_version - pad([e.token_versions for e in batch], torch.long),
    }
    t["mask"][:, 0] = 0  # the first token has no prediction to train
    if ref_logprobs is not None:
        t["ref"] = pad(ref_logprobs, torch.float32)
    return t


def add_data(t: dict[str, torch.Tensor], data: dict) -> dict:
    """Put an optimizer step's data (the objective's, fixed for its batch: [B, T'] tensors with T' at least
    this step's T, and numbers) into its [B, T] tensors `t`; returns the numbers."""
    width = t["tokens"].shape[1]
    t.update({k: v[:, :width] for k, v in data.items() if isinstance(v, torch.Tensor)})
    return {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
