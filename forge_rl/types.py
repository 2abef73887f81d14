"""Records passed between forge_rl components (a stable contract: change with care)."""

from dataclasses import dataclass

import torch


@dataclass
class Episode:
    """One rollout (possibly many turns) of one prompt/seed, as the trainer consumes it.

    The token axis T covers the whole conversation in order: prompt, each sampled answer and each
    environment reply. Only tokens the policy sampled are trained (loss_mask), and their
    behaviour log-probs are the ones the generator sampled them with, so the loss's ratio is a
    real importance ratio. Episodes of one group share group_id; advantages compare them.
    """

    tokens: torch.Tensor  # [T] int64 all ids: prompt + sampled + environment-turn ids
    loss_mask: torch.Tensor  # [T] 1 where the policy sampled the token, 0 for prompt/env/padding
    behaviour_logprobs: torch.Tensor  # [T] fp32 log-prob each sampled token had when sampled; 0 where mask is 0
    reward: float  # the episode's total reward
    policy_version: int  # the OLDEST policy version that sampled any token of it (staleness is judged by it)
    group_id: str  # shared by all episodes of one prompt/seed

    def __post_init__(self):
        if not (len(self.tokens) == len(self.loss_mask) == len(self.behaviour_logprobs)):
            raise ValueError(
                f"Episode {self.group_id!r}: tokens, loss_mask and behaviour_logprobs must have one entry per token, "
                f"got {len(self.tokens)}, {len(self.loss_mask)}, {len(self.behaviour_logprobs)}"
            )
