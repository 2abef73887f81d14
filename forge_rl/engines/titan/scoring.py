"""Scoring a batch with no more forward work than its loss needs, for exactly the same loss.

A token's log-prob depends only on the ids before it, so:
- The episodes' ids form a tree (a group's answers share their prompt, games that answered alike their
  history until they differ). One forward row holds a piece of that tree, each id once, at its position
  in its episodes and attending to its ancestors only (compat/torchtitan.py `tree_attention`).
- Only positions that predict a trained token need the output head (model.py `scoring_head`).
Gradients stay exact: a shared id's activations feed every episode through it, and autograd sums their terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forge_rl.engines.titan.model import pad_right

ROW_TOKENS = 2048  # a row's ids before the next starts: attention costs a row's length squared


@dataclass
class ForwardPlan:
    needed: dict[int, int]  # episode -> how many of its ids the loss needs (its last trained position)
    per_pass: int  # rows per forward: as many ids as `micro_batch_size` unshared episodes held
    ids: list[list[int]] = field(default_factory=list)  # each row's ids, parents before children
    parents: list[list[int]] = field(default_factory=list)  # each id's parent's column in its row (-1: none)
    row_of: dict[int, int] = field(default_factory=dict)  # episode -> its row
    columns: dict[int, list[int]] = field(default_factory=dict)  # episode -> the columns of its needed ids

    def inputs(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The `rows` as one forward's ids [R, W], positions [R, W] and attention mask [R, 1, W, W]."""
        width = max(len(self.ids[r]) for r in rows)
        ids, positions = pad_right([torch.tensor(self.ids[r]) for r in rows], width), torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.eye(width, dtype=torch.bool).repeat(len(rows), 1, 1)  # padding attends to itself alone
        for i, r in enumerate(rows):
            for column, parent in enumerate(self.parents[r]):
                if parent >= 0:
                    mask[i, column] |= mask[i, parent]
                    positions[i, column] = positions[i, parent] + 1
        return ids, positions, mask[:, None]


def plan_forward(tokens: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor, episodes: list[int],
                 micro_batch_size: int = 1) -> ForwardPlan:
    """Rows for `episodes` (indexes into the padded [B, T] `tokens` and `mask`): taken in the order of their ids
    (a group's episodes meet), each adds the ids its row lacks; a row holding `cap` ids or more starts the next."""
    needed = {}
    for b in episodes:
        trained = mask[b, : int(lengths[b])].nonzero()
        needed[b] = int(trained[-1]) if len(trained) else 0  # ids before the last trained token
    longest = max([*needed.values(), 1])
    cap = max(longest, min(micro_batch_size * longest, ROW_TOKENS))
    plan = ForwardPlan(needed, max(1, micro_batch_size * longest // cap))
    paths = {b: tokens[b, : max(needed[b], 1)].tolist() for b in episodes}
    for b in sorted(episodes, key=lambda b: (paths[b], b)):
        path = paths[b]
        if not plan.ids or len(plan.ids[-1]) >= cap:
            plan.ids.append([])
            plan.parents.append([])
            trie = {}  # id -> (column, children) of the row's tree
        node, parent, columns = trie, -1, []
        for token in path:
            if token not in node:
                node[token] = (len(plan.ids[-1]), {})
                plan.ids[-1].append(token)
                plan.parents[-1].append(parent)
            parent, node = node[token]
            columns.append(parent)
        plan.row_of[b], plan.columns[b] = len(plan.ids) - 1, columns[: needed[b]]
    if not plan.ids:  # no episodes on this rank: one id to run all the same (FSDP's collectives pair up)
        plan.ids, plan.parents = [[int(tokens[0, 0])]], [[-1]]
    return plan


def scored_positions(plan: ForwardPlan, mask: torch.Tensor, episodes: list[int], row_indices: list[int], width: int):
    """The trained tokens of `episodes`, served by the rows `row_indices` run as one [len(row_indices), width]
    input (`plan.inputs`): (episode slot, position) of each token, positions counted from 1 as the batch's
    [B, T] tensors count them; the flat indexes into the [len(row_indices) * width] outputs that predict them,
    each once; and for each token, which of those flat indexes predicts it."""
    local = {r: i for i, r in enumerate(row_indices)}
    slots, positions, flat = [], [], []
    for slot, b in enumerate(episodes):
        row, columns = local[plan.row_of[b]], plan.columns[b]
        for p in mask[b].nonzero().flatten().tolist():
            slots.append(slot)
            positions.append(p)
            flat.append(row * width + columns[p - 1])
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
