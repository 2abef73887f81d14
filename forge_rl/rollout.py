"""Turning a multi-turn conversation into the one Episode record the trainer consumes.

The policy's tokens are never re-tokenized: each turn's prompt is the exact id sequence the policy
already produced, followed by the ids of the new environment turn (rendered and tokenized alone).
So the ids trained on are the ids sampled, and every sampled id keeps the log-prob and policy
version it was sampled with (with partial rollouts, one answer may hold several versions).

    conv = Conversation(first_prompt_ids)
    completion = await policy.route("generate", conv.prompt_ids, sampling)[0]
    conv.add_completion(completion)
    conv.add_turn(ids_of_the_next_observation)
    ...
    episode = conv.to_episode(reward, group_id)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forge_rl.types import Completion, Episode


@dataclass
class Conversation:
    """Token ids of one episode so far, with who produced each one.

    Invariant: `tokens[i]` was sampled by the policy iff `sampled[i]`, in which case `logprobs[i]` is
    its behaviour log-prob and `token_versions[i]` the version that sampled it (-1 otherwise);
    `versions` holds the oldest policy version of every completion added.
    """

    tokens: list[int]  # [T] every id so far, in order
    sampled: list[bool] = field(default_factory=list)  # [T]
    logprobs: list[float] = field(default_factory=list)  # [T] 0.0 where not sampled
    versions: list[int] = field(default_factory=list)  # one per completion
    token_versions: list[int] = field(default_factory=list)  # [T] -1 where not sampled

    def __post_init__(self):
        self.tokens = list(self.tokens)
        self.sampled = [False] * len(self.tokens)
        self.logprobs = [0.0] * len(self.tokens)
        self.token_versions = [-1] * len(self.tokens)

    @property
    def prompt_ids(self) -> list[int]:
        """What to send to the generator for the next turn."""
        return list(self.tokens)

    def add_completion(self, completion: Completion) -> None:
        if completion.prompt_ids != self.tokens:
            raise ValueError("completion was sampled for a different prompt than this conversation's")
        self.tokens += completion.token_ids
        self.sampled += [True] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.token_versions += completion.token_versions
        self.versions.append(completion.policy_version)

    def add_turn(self, token_ids: list[int]) -> None:
        """Append ids the policy did not sample (an environment reply and the next turn's header)."""
        self.tokens += token_ids
        self.sampled += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.token_versions += [-1] * len(token_ids)

    def to_episode(self, reward: float, group_id: str) -> Episode:
        if not self.versions:
            raise ValueError("an episode needs at least one completion")
        return Episode(
            tokens=torch.tensor(self.tokens, dtype=torch.long),
            loss_mask=torch.tensor(self.sampled, dtype=torch.bool),
            behaviour_logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            reward=float(reward),
            policy_version=min(self.versions),  # the oldest sampled token's
            group_id=group_id,
            token_versions=torch.tensor(self.token_versions, dtype=torch.long),
        )
