"""Self-imitation (Oh et al. 2018, "Self-Imitation Learning"): learn again from the best past episodes.

Why: with a sparse reward GRPO learns from a group only in the step that found a pass, and rare passes of
other kinds are forgotten (docs/coder.md); imitating them again makes every pass found a label.

Per group, its best episode joins the pool when it beat the group's mean (SIL's "return above the value
estimate"). The pool is not checkpointed: a resumed run starts it empty.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque

from forge_rl.core.types import Episode


def best_of_groups(batch: list[Episode]) -> list[Episode]:
    """Each group's first best episode, if its reward beats the group's mean (none from a group of equals)."""
    groups: dict[str, list[Episode]] = defaultdict(list)
    for episode in batch:
        groups[episode.group_id].append(episode)
    best = []
    for episodes in groups.values():
        top = max(episodes, key=lambda e: e.reward)
        if top.reward > sum(e.reward for e in episodes) / len(episodes):
            best.append(top)
    return best


class ImitationPool:
    """The most recent `capacity` best episodes; `sample` draws uniformly with a seeded generator."""

    def __init__(self, capacity: int, seed: int):
        self.episodes: deque[Episode] = deque(maxlen=capacity)
        self.rng = random.Random(seed)

    def add_batch(self, batch: list[Episode]) -> None:
        self.episodes.extend(best_of_groups(batch))

    def sample(self, n: int) -> list[Episode]:
        return self.rng.sample(list(self.episodes), min(n, len(self.episodes)))

    def __len__(self) -> int:
        return len(self.episodes)
