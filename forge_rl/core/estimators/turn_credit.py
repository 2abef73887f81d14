"""Per-turn credit (GiGPO's step-level advantage, Feng et al. 2025): each answer of a multi-turn game is also
compared with the answers other games of its group gave in the same state (the same ids before it).

Without it every answer of a game gets the game's credit, so a good hit followed by a bad one looks bad.
The games of a group that reached one conversation faced the same state, and from there their rewards
compare that answer with the others given there (with a shared seed, as BlackJack's shoe, they reached it
through the same cards too). The reward compared is the episode's: the return from every turn when, as in
these apps, the reward comes at the end. The comparison uses the run's estimator on the rewards of the
rollouts that visited the state, so it is scaled as the episode term is (Dr.GRPO's centring, GRPO's std,
`normalize_mean`'s mean).

Expected update: the rollouts that reached a state continue from it independently, so their mean reward is
a baseline of that state; the term adds (a positive multiple of) the policy gradient of each answer's
return: an ascent direction, with less variance for answers late in a game. A state one game alone reached
has nothing to compare with and adds nothing.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from forge_rl.core.estimators.groups import answer_turns, rollout_of, rows_by_group, state_before
from forge_rl.core.types import Episode


def turn_advantages(
    batch: list[Episode], rewards: list[float], group_advantages: Callable[[torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """Per token [T] for each episode: each answer's step-level advantage (0 elsewhere), from
    `group_advantages` (rewards [k] of the k rollouts that visited a state -> [k]); `rewards`: one per episode."""
    out = [torch.zeros(len(e.tokens)) for e in batch]
    for rows in rows_by_group(batch):
        # each answer's span and the conversation before it (its state)
        turns = {i: [(start, end, state_before(batch[i], start)) for start, end in answer_turns(batch[i].loss_mask)] for i in rows}
        visits = defaultdict(dict)  # state -> {rollout: reward}
        for i in rows:
            for _, _, state in turns[i]:
                visits[state][rollout_of(batch, i)] = float(rewards[i])
        for i in rows:
            for start, end, state in turns[i]:
                seen = visits[state]
                if len(seen) < 2:
                    continue
                step = group_advantages(torch.tensor(list(seen.values())))
                out[i][start:end] = step[list(seen).index(rollout_of(batch, i))]
    return out
