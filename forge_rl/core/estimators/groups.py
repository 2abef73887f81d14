"""How a batch of episodes is grouped for advantage estimation: by group (one prompt or seed), by rollout
(a chat-agent rollout sealed into several episodes counts once), and by state (the ids before an answer)."""

from __future__ import annotations

from collections import defaultdict

import torch

from forge_rl.core.types import Episode


def rows_by_group(batch: list[Episode]) -> list[list[int]]:
    """The indices of each group's episodes, groups in order of first appearance."""
    by_group = defaultdict(list)
    for i, e in enumerate(batch):
        by_group[e.group_id].append(i)
    return list(by_group.values())


def rollout_of(batch: list[Episode], i: int) -> str | int:
    """Episode i's rollout: its rollout_id, or (rollout_id "") a rollout of its own."""
    return batch[i].rollout_id or -i - 1


def group_rewards(batch: list[Episode], rewards: list[float], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One group's rewards (`rewards`: one per episode of the batch), one per rollout [R], and each episode's
    rollout index [len(rows)] into them."""
    rollouts: dict = {}
    index = torch.tensor([rollouts.setdefault(rollout_of(batch, i), len(rollouts)) for i in rows])
    per_rollout = torch.zeros(len(rollouts)).scatter(0, index, torch.tensor([float(rewards[i]) for i in rows]))
    return per_rollout, index


def answer_turns(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of trained positions in a [T] mask: one answer of the conversation per run."""
    flags = torch.as_tensor(mask).bool().tolist() + [False]
    turns, start = [], None
    for t, trained in enumerate(flags):
        if trained and start is None:
            start = t
        elif not trained and start is not None:
            turns.append((start, t))
            start = None
    return turns


def state_before(episode: Episode, start: int) -> bytes:
    """The state an answer starting at `start` was given in: every id before it, as a hashable key."""
    return torch.as_tensor(episode.tokens[:start]).numpy().tobytes()
