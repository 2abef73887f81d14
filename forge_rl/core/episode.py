"""The record of one episode's token ids as the policy saw them, and the Episode it becomes.

The policy's tokens are never re-tokenized: what came after them is tokenized alone and appended, so the ids
trained on are the ids sampled, each with the log-prob and policy version it was sampled with. One record per
game (rollout/play.py) or per conversation segment (rollout/segments.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forge_rl.core.types import Completion, Episode


@dataclass
class EpisodeRecord:
    """Token ids of one episode so far, with who produced each one.

    Invariant: `token_ids[i]` was sampled by the policy iff `sampled[i]`, in which case `logprobs[i]` is its
    behaviour log-prob and `versions[i]` the policy version that sampled it (-1 and 0.0 otherwise);
    `completion_versions` holds the oldest version of every completion added.
    """

    token_ids: list[int] = field(default_factory=list)  # [T] every id so far, in order
    sampled: list[bool] = field(default_factory=list)  # [T]
    logprobs: list[float] = field(default_factory=list)  # [T] 0.0 where not sampled
    versions: list[int] = field(default_factory=list)  # [T] -1 where not sampled
    completion_versions: list[int] = field(default_factory=list)  # one per completion
    truncated: bool = False  # a completion was cut at max_tokens

    def __post_init__(self):
        if len(self.sampled) != len(self.token_ids):  # ids given at construction are a prompt
            ids, self.token_ids = list(self.token_ids), []
            self.add_prompt(ids)

    def add_prompt(self, token_ids: list[int]) -> None:
        """Append ids the policy did not sample (a prompt, an environment reply, the next turn's header)."""
        self.token_ids += token_ids
        self.sampled += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    def add_completion(self, completion: Completion) -> None:
        """Append what the policy sampled for exactly this record's ids, each token with its own version."""
        if completion.prompt_ids != self.token_ids:
            raise ValueError("completion was sampled for a different prompt than this record's ids")
        self.token_ids += completion.token_ids
        self.sampled += [True] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.versions += completion.token_versions
        self.completion_versions.append(completion.policy_version)
        self.truncated |= completion.finish_reason == "length"

    def to_episode(self, reward: float, group_id: str, rollout_id: str = "") -> Episode:
        if not self.completion_versions:
            raise ValueError("an episode needs at least one completion")
        return Episode(
            tokens=torch.tensor(self.token_ids, dtype=torch.long),
            loss_mask=torch.tensor(self.sampled, dtype=torch.bool),
            behaviour_logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            reward=float(reward),
            policy_version=min(self.completion_versions),  # the oldest sampled token's
            group_id=group_id,
            token_versions=torch.tensor(self.versions, dtype=torch.long),
            rollout_id=rollout_id,
            truncated=self.truncated,
        )
